// tests/test_svgplot.c: tools/svgplot.c on in-memory TSV: the SVG is well formed (every element closed, in
// order, one root), has one polyline per series with its points in x order inside the plotting area and every
// series named in the legend (XML-escaped), and malformed input is refused with its line number.
#define _POSIX_C_SOURCE 200809L  // fmemopen, open_memstream
#define SVGPLOT_TESTING
#include "tools/svgplot.c"
#include "tests/test.h"

// 0 when every tag is closed in order under a single <svg> root; else the offset of the first problem + 1.
static long xml_check(const char *s) {
    char stack[64][32];
    int depth = 0, roots = 0;
    for (const char *p = s; (p = strchr(p, '<')) != NULL;) {
        const char *end = strchr(p, '>');
        if (!end) return p - s + 1;
        if (p[1] == '?') { p = end + 1; continue; }  // the XML declaration
        int closing = p[1] == '/', selfclosing = end[-1] == '/';
        const char *name = p + 1 + closing;
        size_t len = strcspn(name, " />");
        if (len == 0 || len >= sizeof stack[0] || memchr(p + 1, '<', (size_t)(end - p - 1))) return p - s + 1;
        if (closing) {
            if (depth == 0 || strncmp(stack[depth - 1], name, len) || stack[depth - 1][len]) return p - s + 1;
            depth--;
        } else if (!selfclosing) {
            if (depth == 64) return p - s + 1;
            if (depth == 0) roots++;
            memcpy(stack[depth], name, len);
            stack[depth++][len] = 0;
        } else if (depth == 0) {
            return p - s + 1;
        }
        p = end + 1;
    }
    return depth == 0 && roots == 1 ? 0 : (long)strlen(s) + 1;
}

// The SVG of `tsv` in a malloc'ed string, or NULL with err set.
static char *plot(const char *tsv, const PlotOpts *o, char *err) {
    FILE *in = fmemopen((void *)tsv, strlen(tsv), "r");
    Series s[PLOT_MAX_SERIES];
    int ns = 0;
    int rc = plot_read(in, "test.tsv", o, s, &ns, err);
    fclose(in);
    if (rc) { plot_free(s, ns); return NULL; }
    char *buf = NULL;
    size_t n = 0;
    FILE *out = open_memstream(&buf, &n);
    plot_write_svg(out, s, ns, o);
    fclose(out);
    plot_free(s, ns);
    return buf;
}

static int count(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)) != NULL; p++) n++;
    return n;
}

static void test_chart(int logx) {
    const char *tsv = "# step 1000\nsdm\t1024\t0.9\nswa & <co>\t1\t0.1\nsdm\t1\t0.5\n\nswa & <co>\t1024\t0.12\n"
                      "sdm\t32\t0.7\nswa & <co>\t32\t0.11\nfull\t1\t1\nfull\t1024\t1\nfull\t32\t1\n";
    PlotOpts o = {"MQAR \"exact\" by gap", "gap (tokens)", "exact", logx, 1, 1, 0, 1};
    char err[PLOT_ERR] = "";
    char *svg = plot(tsv, &o, err);
    CHECK(svg != NULL, "refused: %s", err);
    if (!svg) return;
    long bad = xml_check(svg);
    CHECK(bad == 0, "logx %d: malformed at offset %ld: %.60s", logx, bad - 1, bad ? svg + bad - 1 : "");
    CHECK(count(svg, "<polyline") == 3 && count(svg, "<circle") == 9, "logx %d: %d polylines, %d markers", logx,
          count(svg, "<polyline"), count(svg, "<circle"));
    CHECK(strstr(svg, ">sdm</text>") && strstr(svg, ">swa &amp; &lt;co&gt;</text>") && strstr(svg, ">full</text>"),
          "legend lacks a series name");
    CHECK(strstr(svg, "MQAR &quot;exact&quot; by gap") && strstr(svg, ">gap (tokens)</text>"),
          "title or label missing");
    // the sdm line: points sorted by x, x increasing left to right, inside the plotting area
    const char *pts = strstr(svg, "points=\"");
    double x[3], y[3];
    int got = pts ? sscanf(pts, "points=\"%lf,%lf %lf,%lf %lf,%lf\"", &x[0], &y[0], &x[1], &y[1], &x[2], &y[2]) : 0;
    CHECK(got == 6 && x[0] < x[1] && x[1] < x[2] && x[0] >= PLOT_LEFT && x[2] <= PLOT_W - PLOT_RIGHT && y[2] < y[1] &&
          y[1] < y[0] && y[0] <= PLOT_H - PLOT_BOTTOM && y[2] >= PLOT_TOP,
          "logx %d: sdm points %d: %.80s", logx, got, pts);
    if (logx)  // 32 is halfway between 1 and 1024 on a log axis
        CHECK(got == 6 && fabs(x[1] - (x[0] + x[2]) / 2) < 0.2, "log x: 32 at %.1f, not midway of %.1f..%.1f", x[1],
              x[0], x[2]);
    free(svg);
}

static void test_refusals(void) {
    PlotOpts o = {NULL, NULL, NULL, 0, 0, 0, 0, 0}, logx = o;
    logx.logx = 1;
    char err[PLOT_ERR] = "";
    struct { const char *tsv; const PlotOpts *o; const char *want; } cases[] = {
        {"a\t1\t2\na\t1\n", &o, "test.tsv:2: expected series<TAB>x<TAB>y"},
        {"a\t1\t2\t3\n", &o, "test.tsv:1: expected"},
        {"a\tone\t2\n", &o, "test.tsv:1: x and y must be finite"},
        {"a\t1\tnan\n", &o, "finite"},
        {"a\t0\t2\n", &logx, "test.tsv:1: x must be > 0 with --logx"},
        {"# nothing\n\n", &o, "no points"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char *svg = plot(cases[k].tsv, cases[k].o, err);
        CHECK(svg == NULL && strstr(err, cases[k].want), "case %zu: got '%s', wanted '%s'", k, svg ? "an SVG" : err,
              cases[k].want);
        free(svg);
    }
    char many[2048] = "";
    for (int k = 0; k <= PLOT_MAX_SERIES; k++)
        snprintf(many + strlen(many), sizeof many - strlen(many), "s%d\t1\t1\n", k);
    char *svg = plot(many, &o, err);
    CHECK(svg == NULL && strstr(err, "test.tsv:17: too many series"), "17 series: %s", svg ? "accepted" : err);
    free(svg);
}

// Ranges narrower than the rounding of their values (found by tests/fuzz/fuzz_svgplot.c): the tick loops added a
// step of 0.2 to y = 3.28e15, whose neighbours are 0.5 apart, so v never moved and svgplot hung. Each must give a
// well-formed SVG with a bounded number of grid lines.
static void test_narrow_ranges(void) {
    PlotOpts o = {NULL, NULL, NULL, 0, 0, 0, 0, 0}, logx = o;
    logx.logx = 1;
    const struct { const char *tsv; const PlotOpts *o; } cases[] = {
        {"1s\t1\t03280078736850944.1\n", &o},                      // the fuzzer's input: one point, y axis
        {"a\t3280078736850944\t1\na\t3280078736850945\t2\n", &o},  // the x axis
        {"a\t1e300\t1\na\t1.0000000000001e300\t2\n", &logx},       // the log x axis
        {"a\t1\t1e308\na\t2\t-1e308\n", &o},                      // a y range that overflows
    };
    char err[PLOT_ERR] = "";
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char *svg = plot(cases[k].tsv, cases[k].o, err);
        CHECK(svg && xml_check(svg) == 0 && count(svg, "stroke=\"#e6e6e6\"") <= 2 * PLOT_MAX_TICKS,
              "narrow range %zu: %s", k, svg ? "malformed or too many ticks" : err);
        free(svg);
    }
}

int main(void) {
    test_chart(0);
    test_chart(1);
    test_refusals();
    test_narrow_ranges();
    return test_summary();
}
