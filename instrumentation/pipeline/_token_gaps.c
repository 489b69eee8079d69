/* A request's decode tokens and inter-token gaps from its int64 stamp buffers (`phases`).
 *
 * Why C: numpy's per-call overhead (frombuffer, slicing, a ufunc, sort, tolist) was ~45k
 * instructions a request for ~128 int64s; a list of the gaps ~10k more, most of it its ints (the
 * gaps are read for a few quantiles, so they stay packed).
 *
 * token_gaps(first_token_ts, token_ts, token_n) -> (decode_tokens, gaps):
 *   decode_tokens = sum(token_n) (int64), gaps = [token_ts[0] - first_token_ts] + [token_ts[i] -
 *   token_ts[i-1] for i >= 1], ascending (empty when token_ts is), as bytes of native int64s
 *   (`records.int64s` reads them). Both buffers: native int64 (array('q') / records.int64s).
 *
 * itl_ms(gaps) -> (p50_ms, p99_ms, max_ms, stall_ms): llm.decode's ITL figures from the ascending
 *   gaps, the floats `spans.decode_attributes` wrote with `common.quantile.quantile` and the stall
 *   formula of `phases` (each ns / 1e6; 0.0 each for no gap), with Python's arithmetic on its ints
 *   and floats step by step (an int quantile stays exact, an int compared with a float exactly), so
 *   the values are those floats bit for bit (tests/test_instrumentation_phases.py compares them on
 *   any gaps): ~2k instructions where the Python took ~20k.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Sorting: an LSD radix sort, 8 bits a pass, of the keys (x ^ sign bit) - min, so that passes stop
 * at the range's top byte (~3 passes for a request's gaps) and a pass whose digit is the same for
 * every key is skipped: no compare to mispredict (the shellsort it replaced was ~19k instructions
 * for a request's ~128 gaps, about a third of `compute_phases`). Insertion sort below 16 values. */
#define RADIX_BITS 8
#define RADIX (1 << RADIX_BITS)
#define SMALL_SORT 16
#define STACK_VALUES 512

static void insertion_sort(int64_t *a, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) {
        int64_t v = a[i];
        Py_ssize_t j = i;
        for (; j > 0 && a[j - 1] > v; j--)
            a[j] = a[j - 1];
        a[j] = v;
    }
}

static inline uint64_t radix_key(int64_t v, uint64_t min) { return ((uint64_t)v ^ (UINT64_C(1) << 63)) - min; }

/* One stable pass on the digit at `shift`, src -> dst; 0 (nothing moved) when every key has the same digit. */
static int radix_pass(const int64_t *src, int64_t *dst, Py_ssize_t n, uint64_t min, int shift) {
    Py_ssize_t count[RADIX] = {0};
    for (Py_ssize_t i = 0; i < n; i++)
        count[(radix_key(src[i], min) >> shift) & (RADIX - 1)]++;
    if (count[(radix_key(src[0], min) >> shift) & (RADIX - 1)] == n)
        return 0;
    for (Py_ssize_t d = 0, at = 0; d < RADIX; d++) {
        Py_ssize_t c = count[d];
        count[d] = at;
        at += c;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        dst[count[(radix_key(src[i], min) >> shift) & (RADIX - 1)]++] = src[i];
    return 1;
}

/* Ascending, in place; -1 (MemoryError set) when no scratch memory. */
static int sort_ascending(int64_t *a, Py_ssize_t n) {
    if (n <= SMALL_SORT) {
        insertion_sort(a, n);
        return 0;
    }
    int64_t stack[STACK_VALUES], *scratch = n <= STACK_VALUES ? stack : PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (!scratch) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t min = UINT64_MAX, max = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = radix_key(a[i], 0);
        min = k < min ? k : min;
        max = k > max ? k : max;
    }
    int64_t *src = a, *dst = scratch;
    for (int shift = 0; shift < 64 && ((max - min) >> shift); shift += RADIX_BITS)
        if (radix_pass(src, dst, n, min, shift)) {
            int64_t *t = src;
            src = dst;
            dst = t;
        }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(int64_t));
    if (scratch != stack)
        PyMem_Free(scratch);
    return 0;
}

static int int64_view(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a buffer of int64s expected");
        return -1;
    }
    return 0;
}

/* The gaps, ascending, as native int64s in a new bytes (no int object per gap). */
static PyObject *gaps_bytes(int64_t first_token_ts, const int64_t *stamps, Py_ssize_t n) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!out)
        return NULL;
    int64_t *gaps = (int64_t *)PyBytes_AS_STRING(out); /* aligned: the bytes object's data is */
    for (Py_ssize_t i = 0; i < n; i++)
        gaps[i] = stamps[i] - (i ? stamps[i - 1] : first_token_ts);
    if (sort_ascending(gaps, n) < 0)
        Py_CLEAR(out);
    return out;
}

static PyObject *token_gaps(PyObject *self, PyObject *args) {
    (void)self;
    long long first_token_ts;
    PyObject *token_ts, *token_n;
    if (!PyArg_ParseTuple(args, "LOO:token_gaps", &first_token_ts, &token_ts, &token_n))
        return NULL;
    Py_buffer ts, tn;
    if (int64_view(token_ts, &ts) < 0)
        return NULL;
    if (int64_view(token_n, &tn) < 0) {
        PyBuffer_Release(&ts);
        return NULL;
    }
    int64_t tokens = 0;
    const int64_t *counts = tn.buf;
    for (Py_ssize_t i = 0; i < tn.len / (Py_ssize_t)sizeof(int64_t); i++)
        tokens += counts[i];
    PyObject *gaps = gaps_bytes(first_token_ts, ts.buf, ts.len / (Py_ssize_t)sizeof(int64_t));
    PyBuffer_Release(&ts);
    PyBuffer_Release(&tn);
    if (!gaps)
        return NULL;
    return Py_BuildValue("(LN)", (long long)tokens, gaps);
}

/* A quantile as common.quantile computes it, then `or 0`: exact (an int, in *exact) when it returns a
 * stamp (a == b, or h == lo); else the float a + (b - a) * (h - lo), with -0.0 and 0.0 as the int 0. */
typedef struct {
    int is_exact;
    int64_t exact;
    double value;
} Quantile;

static Quantile quantile_of(const int64_t *x, Py_ssize_t n, double q) {
    double h = q * (double)(n - 1);
    Py_ssize_t lo = (Py_ssize_t)h, hi = lo + 1 < n ? lo + 1 : n - 1;
    int64_t a = x[lo], b = x[hi];
    if (a == b || h == (double)lo)
        return (Quantile){1, a, 0.0};
    double value = (double)a + (double)((__int128)b - a) * (h - (double)lo);
    return value == 0.0 ? (Quantile){1, 0, 0.0} : (Quantile){0, 0, value};
}

static double quantile_ms(Quantile v) { return (v.is_exact ? (double)v.exact : v.value) / 1e6; }

/* g > t for an int64 g and a float t, exactly (Python compares an int and a float without rounding). */
static int int_above(int64_t g, double t) {
    if (t != t)
        return 0;
    if (t >= 9223372036854775808.0)
        return 0;
    if (t < -9223372036854775808.0)
        return 1;
    int64_t whole = (int64_t)t; /* toward 0; t - whole exact */
    return g != whole ? g > whole : t - (double)whole < 0.0;
}

/* phases' stall: Σ (g − p50) over g > 2·p50 = Σ tail − p50·len(tail), the tail of the ascending gaps. */
static double stall_ms(const int64_t *x, Py_ssize_t n, Quantile median) {
    Py_ssize_t first = n;
    while (first > 0 && (median.is_exact ? (__int128)x[first - 1] > 2 * (__int128)median.exact
                                          : int_above(x[first - 1], 2.0 * median.value)))
        first--;
    __int128 sum = 0;
    for (Py_ssize_t i = first; i < n; i++)
        sum += x[i];
    Py_ssize_t count = n - first;
    if (median.is_exact)
        return (double)(sum - (__int128)median.exact * count) / 1e6;
    return ((double)sum - median.value * (double)count) / 1e6;
}

static PyObject *itl_ms(PyObject *self, PyObject *gaps) {
    (void)self;
    Py_buffer view;
    if (int64_view(gaps, &view) < 0)
        return NULL;
    const int64_t *x = view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(int64_t);
    double p50 = 0.0, p99 = 0.0, max = 0.0, stall = 0.0;
    if (n) {
        Quantile median = quantile_of(x, n, 0.5);
        p50 = quantile_ms(median);
        p99 = quantile_ms(quantile_of(x, n, 0.99));
        max = (double)x[n - 1] / 1e6;
        stall = stall_ms(x, n, median);
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(dddd)", p50, p99, max, stall);
}

static PyMethodDef methods[] = {
    {"token_gaps", token_gaps, METH_VARARGS, "(decode_tokens, ascending gaps) of a request's token stamps."},
    {"itl_ms", itl_ms, METH_O, "(p50_ms, p99_ms, max_ms, stall_ms) of ascending gaps."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_token_gaps", NULL, -1, methods};

PyMODINIT_FUNC PyInit__token_gaps(void) { return PyModule_Create(&module); }
