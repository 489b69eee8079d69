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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Shellsort, Ciura's gaps extended by x2.25: compares inline (libc's qsort calls a comparison
 * function per compare: ~3x the instructions for the ~128 gaps of a request). */
static void sort_ascending(int64_t *a, Py_ssize_t n) {
    Py_ssize_t gaps[48] = {1, 4, 10, 23, 57, 132, 301, 701};
    int count = 8;
    while (count < 48 && gaps[count - 1] < n / 2) {
        gaps[count] = (Py_ssize_t)((double)gaps[count - 1] * 2.25);
        count++;
    }
    while (count--) {
        Py_ssize_t h = gaps[count];
        for (Py_ssize_t i = h; i < n; i++) {
            int64_t v = a[i];
            Py_ssize_t j = i;
            for (; j >= h && a[j - h] > v; j -= h)
                a[j] = a[j - h];
            a[j] = v;
        }
    }
}

static int int64_view(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "token_gaps: a buffer of int64s expected");
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
    sort_ascending(gaps, n);
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

static PyMethodDef methods[] = {
    {"token_gaps", token_gaps, METH_VARARGS, "(decode_tokens, ascending gaps) of a request's token stamps."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_token_gaps", NULL, -1, methods};

PyMODINIT_FUNC PyInit__token_gaps(void) { return PyModule_Create(&module); }
