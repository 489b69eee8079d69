/* A request's decode tokens and inter-token gaps from its int64 stamp buffers (`phases`).
 *
 * Why C: numpy's per-call overhead (frombuffer, slicing, a ufunc, sort, tolist) was ~45k
 * instructions a request for ~128 int64s; here ~10k, most of it the list's ints.
 *
 * token_gaps(first_token_ts, token_ts, token_n) -> (decode_tokens, gaps):
 *   decode_tokens = sum(token_n) (int64), gaps = [token_ts[0] - first_token_ts] + [token_ts[i] -
 *   token_ts[i-1] for i >= 1], ascending ([] when token_ts is empty). Both buffers: native int64
 *   (array('q') / records.int64s).
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

static PyObject *gaps_list(int64_t first_token_ts, const int64_t *stamps, Py_ssize_t n) {
    int64_t *gaps = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!gaps)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++)
        gaps[i] = stamps[i] - (i ? stamps[i - 1] : first_token_ts);
    sort_ascending(gaps, n);
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *gap = PyLong_FromLongLong(gaps[i]);
        if (!gap) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, gap);
    }
    PyMem_Free(gaps);
    return list;
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
    PyObject *gaps = gaps_list(first_token_ts, ts.buf, ts.len / (Py_ssize_t)sizeof(int64_t));
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
