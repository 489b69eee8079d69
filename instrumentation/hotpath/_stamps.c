/* Int64Log: a growable vector of native int64s, for the timeline's per-token stamps
 * (`timeline.RequestTimeline.token_ts` / `token_n`).
 *
 * Why C: `array('l').append` parses its argument with PyArg_Parse (~550 instructions an append,
 * callgrind; two appends a token, once per request a decode step: the largest part of the loop's
 * stamps). `append` here is METH_O with PyLong_AsLong where a C long is 64 bits (PyLong_AsLongLong
 * goes through _PyLong_AsByteArray for any int past 30 bits, as every ns stamp is).
 *
 * What readers of a live timeline use, as an int64 array gives it: append, len, truth, x[i]
 * (negative i from the end), iteration, tolist(), tobytes(), the buffer protocol (format "q":
 * native int64, read-only; `append` raises BufferError while a view is held, as array does)
 *
 * `stamps.stamp(counts, n, clock_ns)`: a decode step's token stamp, one call for the two appends:
 * clock_ns() to `stamps`, n to `counts`; both or neither. Where clock_ns is time.monotonic_ns on
 * Linux (CLOCK_MONOTONIC, the clock it reads) the stamp is read with clock_gettime here: no int
 * object made and parsed again.. An int outside int64 raises OverflowError and stores nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    int64_t *items;
    Py_ssize_t size;
    Py_ssize_t allocated;
    Py_ssize_t exports;
} Int64Log;

#define INITIAL_ITEMS 16 /* a request's first 16 decode steps without a realloc */

static PyObject *log_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (!_PyArg_NoKeywords("Int64Log", kwargs) || !_PyArg_NoPositional("Int64Log", args))
        return NULL;
    Int64Log *self = (Int64Log *)type->tp_alloc(type, 0);
    return (PyObject *)self;
}

static void log_dealloc(Int64Log *self) {
    PyMem_Free(self->items);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int grow(Int64Log *self) {
    Py_ssize_t allocated = self->allocated ? 2 * self->allocated : INITIAL_ITEMS;
    int64_t *items = PyMem_Realloc(self->items, (size_t)allocated * sizeof(int64_t));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->items = items;
    self->allocated = allocated;
    return 0;
}

/* the int as an int64; -1 with an exception set when it is not one */
static int64_t as_int64(PyObject *value) {
#if LONG_MAX == INT64_MAX
    return PyLong_AsLong(value);
#else
    return PyLong_AsLongLong(value);
#endif
}

/* room for one more item: 0, or -1 with an exception set */
static int reserve_one(Int64Log *self) {
    if (self->exports > 0) { /* a view's length and shape point at size: it stays fixed */
        PyErr_SetString(PyExc_BufferError, "cannot resize an Int64Log that is exporting buffers");
        return -1;
    }
    return self->size == self->allocated ? grow(self) : 0;
}

static PyObject *log_append(Int64Log *self, PyObject *value) {
    int64_t v = as_int64(value);
    if ((v == -1 && PyErr_Occurred()) || reserve_one(self) < 0)
        return NULL;
    self->items[self->size++] = v;
    Py_RETURN_NONE;
}

static PyObject *monotonic_ns; /* time.monotonic_ns, fetched at import */

/* clock_ns(), read directly where it is CLOCK_MONOTONIC's reader; -1 with an exception set */
static int64_t read_clock(PyObject *clock_ns) {
#ifdef __linux__
    struct timespec ts;
    if (clock_ns == monotonic_ns && clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
    PyObject *stamp = PyObject_CallNoArgs(clock_ns);
    if (stamp == NULL)
        return -1;
    int64_t t = as_int64(stamp);
    Py_DECREF(stamp);
    return t;
}

static PyTypeObject Int64LogType;

static PyObject *log_stamp(Int64Log *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "stamp() takes 3 arguments (counts, n, clock_ns), %zd given", nargs);
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &Int64LogType)) {
        PyErr_SetString(PyExc_TypeError, "stamp(): counts must be an Int64Log");
        return NULL;
    }
    Int64Log *counts = (Int64Log *)args[0];
    int64_t n = as_int64(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    int64_t t = read_clock(args[2]);
    if ((t == -1 && PyErr_Occurred()) || reserve_one(self) < 0 || reserve_one(counts) < 0)
        return NULL;
    self->items[self->size++] = t;
    counts->items[counts->size++] = n;
    Py_RETURN_NONE;
}

static PyObject *log_tolist(Int64Log *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *list = PyList_New(self->size);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->size; i++) {
        PyObject *item = PyLong_FromLongLong(self->items[i]);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *log_tobytes(Int64Log *self, PyObject *Py_UNUSED(ignored)) {
    return PyBytes_FromStringAndSize((const char *)self->items, self->size * (Py_ssize_t)sizeof(int64_t));
}

static Py_ssize_t log_length(Int64Log *self) { return self->size; }

static PyObject *log_item(Int64Log *self, Py_ssize_t i) {
    if (i < 0 || i >= self->size) {
        PyErr_SetString(PyExc_IndexError, "Int64Log index out of range");
        return NULL;
    }
    return PyLong_FromLongLong(self->items[i]);
}

static PyObject *log_repr(Int64Log *self) {
    PyObject *list = log_tolist(self, NULL);
    if (list == NULL)
        return NULL;
    PyObject *repr = PyUnicode_FromFormat("Int64Log(%R)", list);
    Py_DECREF(list);
    return repr;
}

static int log_getbuffer(Int64Log *self, Py_buffer *view, int flags) {
    /* format "q" (long long): native int64 everywhere; the view is read-only */
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->items, self->size * (Py_ssize_t)sizeof(int64_t), 1, flags) < 0)
        return -1;
    if (flags & PyBUF_FORMAT)
        view->format = "q";
    if (flags & PyBUF_ND) {
        view->ndim = 1;
        view->itemsize = sizeof(int64_t);
        view->shape = &self->size;
    }
    if ((flags & PyBUF_STRIDES) == PyBUF_STRIDES)
        view->strides = &view->itemsize;
    self->exports++;
    return 0;
}

static void log_releasebuffer(Int64Log *self, Py_buffer *Py_UNUSED(view)) { self->exports--; }

static PyMethodDef log_methods[] = {
    {"append", (PyCFunction)log_append, METH_O, "append(x): store the int x (int64)."},
    {"stamp", (PyCFunction)(void (*)(void))log_stamp, METH_FASTCALL,
     "stamp(counts, n, clock_ns): append clock_ns() here and n to counts (both or neither)."},
    {"tolist", (PyCFunction)log_tolist, METH_NOARGS, "The values as a list of ints."},
    {"tobytes", (PyCFunction)log_tobytes, METH_NOARGS, "The values as native int64 bytes."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods log_as_sequence = {
    .sq_length = (lenfunc)log_length,
    .sq_item = (ssizeargfunc)log_item,
};

static PyBufferProcs log_as_buffer = {
    .bf_getbuffer = (getbufferproc)log_getbuffer,
    .bf_releasebuffer = (releasebufferproc)log_releasebuffer,
};

static PyTypeObject Int64LogType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.hotpath._stamps.Int64Log",
    .tp_basicsize = sizeof(Int64Log),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A growable vector of native int64s (see the module's header comment).",
    .tp_new = log_new,
    .tp_dealloc = (destructor)log_dealloc,
    .tp_repr = (reprfunc)log_repr,
    .tp_methods = log_methods,
    .tp_as_sequence = &log_as_sequence,
    .tp_as_buffer = &log_as_buffer,
};

static struct PyModuleDef stamps_module = {
    PyModuleDef_HEAD_INIT, "_stamps", "The timeline's per-token stamp storage.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stamps(void) {
    if (PyType_Ready(&Int64LogType) < 0)
        return NULL;
    PyObject *time_module = PyImport_ImportModule("time");
    if (time_module == NULL)
        return NULL;
    monotonic_ns = PyObject_GetAttrString(time_module, "monotonic_ns"); /* kept for the process */
    Py_DECREF(time_module);
    if (monotonic_ns == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&stamps_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&Int64LogType);
    if (PyModule_AddObject(module, "Int64Log", (PyObject *)&Int64LogType) < 0) {
        Py_DECREF(&Int64LogType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
