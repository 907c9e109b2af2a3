// tests/fuzz/fuzz_svgplot.c: tools/svgplot.c's TSV reader (plot_read) and, for an accepted input, its SVG writer
// (axes, ticks, series), so a number the reader lets through cannot hang or crash the drawing. The first byte sets
// the options: bit 0 --logx, bit 1 --ymin 0, bit 2 --ymax 1. Promises checked: a refusal names fuzz.tsv and a line
// that exists; an accepted file's points are finite (positive x with --logx); the SVG is written in bounded time.
#define SVGPLOT_TESTING
#include "tools/svgplot.c"
#include "tests/fuzz/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    PlotOpts o;
    memset(&o, 0, sizeof o);
    o.logx = data[0] & 1;
    o.has_ymin = (data[0] >> 1) & 1;
    o.has_ymax = (data[0] >> 2) & 1;
    o.ymax = 1;
    o.title = "fuzz";
    FILE *in = fmemopen((void *)(data + 1), size - 1, "r");
    if (!in) return 0; // fmemopen of 0 bytes fails on some libcs
    Series s[PLOT_MAX_SERIES];
    int ns = 0;
    char err[PLOT_ERR] = "";
    int rc = plot_read(in, "fuzz.tsv", &o, s, &ns, err);
    fclose(in);
    int lines = 1;
    for (size_t i = 1; i + 1 < size; i++) lines += data[i] == '\n';
    if (rc != 0) {
        long line = 0;
        FUZZ_ASSERT(sscanf(err, "fuzz.tsv:%ld:", &line) == 1 && line >= 0 && line <= lines, "unclear refusal '%s'",
                    err);
    } else {
        for (int k = 0; k < ns; k++)
            for (int i = 0; i < s[k].n; i++)
                FUZZ_ASSERT(isfinite(s[k].x[i]) && isfinite(s[k].y[i]) && (!o.logx || s[k].x[i] > 0),
                            "point (%g, %g) accepted", s[k].x[i], s[k].y[i]);
        FILE *out = fopen("/dev/null", "w");
        plot_write_svg(out, s, ns, &o);
        fclose(out);
    }
    plot_free(s, ns);
    return 0;
}
