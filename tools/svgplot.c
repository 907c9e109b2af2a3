// tools/svgplot.c: a line chart as SVG from a TSV of named series, with no dependencies (the demo's pictures).
//
//   ./svgplot [-o OUT.svg] [--title T] [--xlabel X] [--ylabel Y] [--logx] [--ymin Y] [--ymax Y] [INPUT.tsv|-]
//
// Input: one point per line, `series<TAB>x<TAB>y`; blank lines and lines starting with '#' are skipped. Series
// keep the order of their first line, points are drawn sorted by x. Output: axes with "nice" ticks (1-2-5 steps;
// with --logx powers of 2, or of 10 over wide ranges), a line with markers per series, a legend, a title. Without
// --ymin/--ymax the y range is the data's, padded. A malformed line, a non-finite number or (with --logx) x <= 0
// is refused with file:line and exit status 1.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLOT_MAX_SERIES 16
#define PLOT_ERR 512
#define PLOT_W 760
#define PLOT_H 460
#define PLOT_LEFT 72   // margins around the plotting area
#define PLOT_RIGHT 180 // room for the legend
#define PLOT_TOP 48
#define PLOT_BOTTOM 56
#define PLOT_MAX_TICKS 64 // per axis: a bound on the tick loops whatever the range's rounding (about 10 are drawn)

static const char *PLOT_COLORS[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                    "#9467bd", "#8c564b", "#e377c2", "#17becf"};

typedef struct {
    char name[64];
    int n, cap;
    double *x, *y;  // [n]
} Series;

typedef struct {
    const char *title, *xlabel, *ylabel;
    int logx, has_ymin, has_ymax;
    double ymin, ymax;
} PlotOpts;

static int plot_fail(char *err, const char *what, const char *where, long line) {
    snprintf(err, PLOT_ERR, "%s:%ld: %s", where, line, what);
    return -1;
}

static int plot_number(const char *s, double *out) {
    char *end;
    *out = strtod(s, &end);
    return end != s && (*end == 0 || *end == '\n' || *end == '\r') && isfinite(*out);
}

// Series of the TSV text in f (named `where` in messages) into s [PLOT_MAX_SERIES]; *ns series. 0 or -1 with err.
static int plot_read(FILE *f, const char *where, const PlotOpts *o, Series *s, int *ns, char *err) {
    char line[4096];
    long lineno = 0;
    *ns = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n' || line[0] == '\r' || line[0] == 0) continue;
        char *t1 = strchr(line, '\t'), *t2 = t1 ? strchr(t1 + 1, '\t') : NULL;
        if (!t2 || strchr(t2 + 1, '\t')) return plot_fail(err, "expected series<TAB>x<TAB>y", where, lineno);
        *t1 = *t2 = 0;
        double x, y;
        if (!plot_number(t1 + 1, &x) || !plot_number(t2 + 1, &y))
            return plot_fail(err, "x and y must be finite numbers", where, lineno);
        if (o->logx && x <= 0) return plot_fail(err, "x must be > 0 with --logx", where, lineno);
        int k = 0;
        while (k < *ns && strncmp(s[k].name, line, sizeof s[k].name - 1)) k++;
        if (k == *ns) {
            if (k == PLOT_MAX_SERIES) return plot_fail(err, "too many series (at most 16)", where, lineno);
            memset(&s[k], 0, sizeof s[k]);
            snprintf(s[k].name, sizeof s[k].name, "%.63s", line);
            (*ns)++;
        }
        Series *p = &s[k];
        if (p->n == p->cap) {
            p->cap = p->cap ? 2 * p->cap : 16;
            p->x = (double *)realloc(p->x, sizeof(double) * (size_t)p->cap);
            p->y = (double *)realloc(p->y, sizeof(double) * (size_t)p->cap);
            if (!p->x || !p->y) return plot_fail(err, "out of memory", where, lineno);
        }
        p->x[p->n] = x;
        p->y[p->n++] = y;
    }
    if (*ns == 0) return plot_fail(err, "no points", where, lineno);
    return 0;
}

static void plot_free(Series *s, int ns) {
    for (int k = 0; k < ns; k++) {
        free(s[k].x);
        free(s[k].y);
    }
}

// Text with the five XML specials escaped.
static void plot_text(FILE *out, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", out); break;
        case '<': fputs("&lt;", out); break;
        case '>': fputs("&gt;", out); break;
        case '"': fputs("&quot;", out); break;
        case '\'': fputs("&apos;", out); break;
        default: fputc(*s, out);
        }
    }
}

// The 1-2-5 step giving at most about `want` intervals over [lo, hi].
static double plot_nice_step(double lo, double hi, int want) {
    double raw = (hi - lo) / want, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return mag * (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10);
}

typedef struct {
    double lo, hi;  // data range mapped to the axis (log2 of x with logx)
    int log;
} Axis;

static double plot_map(const Axis *a, double v, double p0, double p1) {
    double u = a->log ? log2(v) : v;
    return p0 + (p1 - p0) * (u - a->lo) / (a->hi - a->lo);
}

static void plot_sort(Series *p) {  // insertion sort by x: few points
    for (int i = 1; i < p->n; i++)
        for (int j = i; j > 0 && p->x[j - 1] > p->x[j]; j--) {
            double tx = p->x[j], ty = p->y[j];
            p->x[j] = p->x[j - 1];
            p->y[j] = p->y[j - 1];
            p->x[j - 1] = tx;
            p->y[j - 1] = ty;
        }
}

static void plot_write_svg(FILE *out, Series *s, int ns, const PlotOpts *o) {
    const double x0 = PLOT_LEFT, x1 = PLOT_W - PLOT_RIGHT, y0 = PLOT_H - PLOT_BOTTOM, y1 = PLOT_TOP;
    Axis ax = {INFINITY, -INFINITY, o->logx}, ay = {INFINITY, -INFINITY, 0};
    for (int k = 0; k < ns; k++) {
        plot_sort(&s[k]);
        for (int i = 0; i < s[k].n; i++) {
            double u = o->logx ? log2(s[k].x[i]) : s[k].x[i];
            ax.lo = fmin(ax.lo, u);
            ax.hi = fmax(ax.hi, u);
            ay.lo = fmin(ay.lo, s[k].y[i]);
            ay.hi = fmax(ay.hi, s[k].y[i]);
        }
    }
    if (ax.hi == ax.lo) {
        ax.lo -= 1;
        ax.hi += 1;
    }
    double pad = ay.hi > ay.lo ? 0.05 * (ay.hi - ay.lo) : 0.5;
    ay.lo = o->has_ymin ? o->ymin : ay.lo - pad;
    ay.hi = o->has_ymax ? o->ymax : ay.hi + pad;
    if (ay.hi <= ay.lo) ay.hi = ay.lo + 1;

    fprintf(out, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                 "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
                 "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n", PLOT_W, PLOT_H, PLOT_W, PLOT_H);
    fprintf(out, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", PLOT_W, PLOT_H);
    if (o->title) {
        fprintf(out, "<text x=\"%.1f\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">", (x0 + x1) / 2);
        plot_text(out, o->title);
        fputs("</text>\n", out);
    }
    // y ticks and grid
    double step = plot_nice_step(ay.lo, ay.hi, 6), first = ceil(ay.lo / step - 1e-9);
    for (int i = 0; i < PLOT_MAX_TICKS; i++) {
        double v = (first + i) * step;  // not v += step: a step below the rounding of v would never move it
        if (!(v <= ay.hi + 1e-9 * step)) break;
        double py = plot_map(&ay, v, y0, y1);
        fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n", x0, py, x1, py);
        fprintf(out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n", x0 - 6, py + 4,
                fabs(v) < 1e-12 * step ? 0.0 : v);
    }
    // x ticks: powers of 2 (or 10 over wide ranges) in log mode, 1-2-5 steps otherwise
    if (ax.log) {
        double span = ax.hi - ax.lo, every = span > 24 ? log2(10) : fmax(1, ceil(span / 10));
        double first_u = ceil(ax.lo / every - 1e-9);
        for (int i = 0; i < PLOT_MAX_TICKS; i++) {
            double u = (first_u + i) * every;
            if (!(u <= ax.hi + 1e-9)) break;
            double px = x0 + (x1 - x0) * (u - ax.lo) / (ax.hi - ax.lo);
            fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n", px, y0, px,
                    y1);
            fprintf(out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", px, y0 + 18,
                    round(exp2(u) * 1e6) / 1e6);
        }
    } else {
        double xs = plot_nice_step(ax.lo, ax.hi, 8), first_x = ceil(ax.lo / xs - 1e-9);
        for (int i = 0; i < PLOT_MAX_TICKS; i++) {
            double v = (first_x + i) * xs;
            if (!(v <= ax.hi + 1e-9 * xs)) break;
            double px = plot_map(&ax, v, x0, x1);
            fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e6e6e6\"/>\n", px, y0, px,
                    y1);
            fprintf(out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n", px, y0 + 18,
                    fabs(v) < 1e-12 * xs ? 0.0 : v);
        }
    }
    fprintf(out, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333\"/>\n", x0, y1,
            x1 - x0, y0 - y1);
    if (o->xlabel) {
        fprintf(out, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">", (x0 + x1) / 2, PLOT_H - 14);
        plot_text(out, o->xlabel);
        fputs("</text>\n", out);
    }
    if (o->ylabel) {
        fprintf(out, "<text x=\"18\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 18 %.1f)\">",
                (y0 + y1) / 2, (y0 + y1) / 2);
        plot_text(out, o->ylabel);
        fputs("</text>\n", out);
    }
    // series: a polyline and its markers, clipped to the plotting area; the legend to the right
    fprintf(out, "<clipPath id=\"area\"><rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\"/></clipPath>\n", x0,
            y1, x1 - x0, y0 - y1);
    for (int k = 0; k < ns; k++) {
        const char *color = PLOT_COLORS[k % (int)(sizeof PLOT_COLORS / sizeof PLOT_COLORS[0])];
        fprintf(out,
                "<g clip-path=\"url(#area)\" stroke=\"%s\" fill=\"%s\">\n"
                "<polyline fill=\"none\" stroke-width=\"2\" points=\"",
                color, color);
        for (int i = 0; i < s[k].n; i++)
            fprintf(out, "%s%.1f,%.1f", i ? " " : "", plot_map(&ax, s[k].x[i], x0, x1),
                    plot_map(&ay, s[k].y[i], y0, y1));
        fputs("\"/>\n", out);
        for (int i = 0; i < s[k].n; i++)
            fprintf(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\"/>\n", plot_map(&ax, s[k].x[i], x0, x1),
                    plot_map(&ay, s[k].y[i], y0, y1));
        fputs("</g>\n", out);
        double ly = y1 + 12 + 20 * k;
        fprintf(out, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"/>\n",
                x1 + 14, ly, x1 + 38, ly, color);
        fprintf(out, "<text x=\"%.1f\" y=\"%.1f\">", x1 + 44, ly + 4);
        plot_text(out, s[k].name);
        fputs("</text>\n", out);
    }
    fputs("</svg>\n", out);
}

#ifndef SVGPLOT_TESTING
static void usage(void) {
    fputs("usage: svgplot [-o OUT.svg] [--title T] [--xlabel X] [--ylabel Y] [--logx] [--ymin Y] [--ymax Y] [INPUT|-]\n"
          "  INPUT: lines series<TAB>x<TAB>y ('#' comments); standard input when absent or -\n",
          stderr);
    exit(2);
}

int main(int argc, char **argv) {
    PlotOpts o;
    memset(&o, 0, sizeof o);
    const char *in = "-", *outp = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int more = i + 1 < argc;
        if (!strcmp(a, "--logx")) o.logx = 1;
        else if (a[0] != '-' || !strcmp(a, "-")) in = a;
        else if (!more) usage();
        else if (!strcmp(a, "-o")) outp = argv[++i];
        else if (!strcmp(a, "--title")) o.title = argv[++i];
        else if (!strcmp(a, "--xlabel")) o.xlabel = argv[++i];
        else if (!strcmp(a, "--ylabel")) o.ylabel = argv[++i];
        else if (!strcmp(a, "--ymin") || !strcmp(a, "--ymax")) {
            int is_min = !strcmp(a, "--ymin");
            if (!plot_number(argv[++i], is_min ? &o.ymin : &o.ymax)) {
                fprintf(stderr, "svgplot: %s: not a number\n", a);
                return 1;
            }
            if (is_min) o.has_ymin = 1; else o.has_ymax = 1;
        } else usage();
    }
    FILE *f = strcmp(in, "-") ? fopen(in, "r") : stdin;
    if (!f) { fprintf(stderr, "svgplot: %s: cannot open\n", in); return 1; }
    Series s[PLOT_MAX_SERIES];
    int ns = 0;
    char err[PLOT_ERR];
    int rc = plot_read(f, strcmp(in, "-") ? in : "<stdin>", &o, s, &ns, err);
    if (f != stdin) fclose(f);
    if (rc) { plot_free(s, ns); fprintf(stderr, "svgplot: %s\n", err); return 1; }
    FILE *out = outp ? fopen(outp, "w") : stdout;
    if (!out) { plot_free(s, ns); fprintf(stderr, "svgplot: %s: cannot create\n", outp); return 1; }
    plot_write_svg(out, s, ns, &o);
    int bad = ferror(out) | (out != stdout && fclose(out) != 0);
    plot_free(s, ns);
    if (bad) { fprintf(stderr, "svgplot: %s: write failed\n", outp ? outp : "<stdout>"); return 1; }
    return 0;
}
#endif
