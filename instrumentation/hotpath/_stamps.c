/* TimelineCore: the C base of `timeline.RequestTimeline`, holding its per-token stamps inline.
 *
 * Why C: a decode step stamps each running request once (`token()`), and between steps the model
 * evicts the caches, so what a stamp costs is mostly the cache lines it touches. Here the stamp and
 * its count sit side by side in one buffer the object points at ((stamp, count) pairs), beside the
 * clock in the object itself: a token touches the object's head and one buffer line (with two
 * int64 logs it touched the handle, two log objects and their two buffers), and `token` is a
 * METH_FASTCALL C method (no Python frame, no argument parsing).
 *
 * `token(n=1)`: clock_ns() and n appended as one pair. Where clock_ns is time.monotonic_ns on Linux
 * (CLOCK_MONOTONIC, the clock it reads) the stamp is read with clock_gettime here: the same integer
 * on the same clock, no int object made. Another clock (tests, replays) is called.
 * `token_at(t, n)`: the pair (t, n), stamped by the caller (the vLLM tracker, at a batch's output).
 * A value outside int64 raises OverflowError, a negative one ValueError, a non-int TypeError; a
 * call that raises stores nothing.
 *
 * `token_ts` / `token_n` read the stamps and the counts as copies: read-only int64 memoryviews
 * (format "q", as a frozen `records.RequestRecord` holds them), so a reader on another thread never
 * holds a view of the buffer the loop grows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    int64_t *tokens;      /* (stamp, count) pairs */
    Py_ssize_t size;      /* pairs stored */
    Py_ssize_t allocated; /* pairs room */
    PyObject *clock_ns;   /* never NULL */
} TimelineCore;

#define INITIAL_PAIRS 16 /* a request's first 16 decode steps without a realloc */

static PyObject *monotonic_ns; /* time.monotonic_ns, fetched at import */
static PyTypeObject TimelineCoreType;

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    /* a subclass's __init__ takes the arguments; the base itself takes none */
    if (type == &TimelineCoreType &&
        (!_PyArg_NoKeywords("TimelineCore", kwargs) || !_PyArg_NoPositional("TimelineCore", args)))
        return NULL;
    TimelineCore *self = (TimelineCore *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->clock_ns = Py_NewRef(monotonic_ns);
    return (PyObject *)self;
}

static int core_traverse(TimelineCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->clock_ns);
    return 0;
}

static int core_clear(TimelineCore *self) {
    /* breaks a cycle through the clock (a bound method of an object that holds the timeline);
     * the clock stays callable */
    Py_SETREF(self->clock_ns, Py_NewRef(monotonic_ns));
    return 0;
}

static void core_dealloc(TimelineCore *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->clock_ns);
    PyMem_Free(self->tokens);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the int as a non-negative int64; -1 with an exception set when it is not one */
static int64_t as_stamp(PyObject *value) {
    int64_t v;
#if LONG_MAX == INT64_MAX
    v = PyLong_AsLong(value); /* PyLong_AsLongLong goes through _PyLong_AsByteArray past 30 bits */
#else
    v = PyLong_AsLongLong(value);
#endif
    if (v < 0 && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "a token stamp or count must not be negative, got %lld", (long long)v);
    return v < 0 ? -1 : v;
}

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
    int64_t t = as_stamp(stamp);
    Py_DECREF(stamp);
    return t;
}

/* append the pair (t, n); NULL with an exception set when there is no room */
static PyObject *append(TimelineCore *self, int64_t t, int64_t n) {
    if (self->size == self->allocated) {
        Py_ssize_t allocated = self->allocated ? 2 * self->allocated : INITIAL_PAIRS;
        int64_t *tokens = allocated > PY_SSIZE_T_MAX / (Py_ssize_t)(2 * sizeof(int64_t))
                              ? NULL
                              : PyMem_Realloc(self->tokens, (size_t)allocated * 2 * sizeof(int64_t));
        if (tokens == NULL)
            return PyErr_NoMemory();
        self->tokens = tokens;
        self->allocated = allocated;
    }
    int64_t *pair = self->tokens + 2 * self->size++;
    pair[0] = t;
    pair[1] = n;
    Py_RETURN_NONE;
}

static PyObject *core_token(TimelineCore *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t n = 1;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "token() takes at most 1 argument (n), %zd given", nargs);
        return NULL;
    }
    if (nargs == 1 && (n = as_stamp(args[0])) == -1)
        return NULL;
    int64_t t = read_clock(self->clock_ns);
    return t == -1 ? NULL : append(self, t, n);
}

static PyObject *core_token_at(TimelineCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "token_at() takes 2 arguments (t, n), %zd given", nargs);
        return NULL;
    }
    int64_t t = as_stamp(args[0]);
    if (t == -1)
        return NULL;
    int64_t n = as_stamp(args[1]);
    return n == -1 ? NULL : append(self, t, n);
}

/* Int64Block: a column's copy, immutable, read through a memoryview of format "q" (the type is
 * not in the module: only its views are handed out). memoryview(bytes).cast("q") made from C went
 * through a method call of ~4k instructions a column. */
typedef struct {
    PyObject_VAR_HEAD
    int64_t items[1];
} Int64Block;

static int block_getbuffer(Int64Block *self, Py_buffer *view, int flags) {
    Py_ssize_t n = Py_SIZE(self);
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->items, n * (Py_ssize_t)sizeof(int64_t), 1, flags) < 0)
        return -1;
    if (flags & PyBUF_FORMAT)
        view->format = "q";
    if (flags & PyBUF_ND) {
        view->ndim = 1;
        view->itemsize = sizeof(int64_t);
        view->shape = &((PyVarObject *)self)->ob_size;
    }
    if ((flags & PyBUF_STRIDES) == PyBUF_STRIDES)
        view->strides = &view->itemsize;
    return 0;
}

static PyBufferProcs block_as_buffer = {.bf_getbuffer = (getbufferproc)block_getbuffer};

static PyTypeObject Int64BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.hotpath._stamps.Int64Block",
    .tp_basicsize = offsetof(Int64Block, items),
    .tp_itemsize = sizeof(int64_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A copy of a timeline's stamps or counts, read through a memoryview.",
    .tp_as_buffer = &block_as_buffer,
};

/* one column of the pairs (0: stamps, 1: counts) as a read-only int64 memoryview of its own copy */
static PyObject *column(TimelineCore *self, Py_ssize_t which) {
    Int64Block *block = PyObject_NewVar(Int64Block, &Int64BlockType, self->size);
    if (block == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->size; i++)
        block->items[i] = self->tokens[2 * i + which];
    PyObject *view = PyMemoryView_FromObject((PyObject *)block);
    Py_DECREF(block);
    return view;
}

static PyObject *core_token_ts(TimelineCore *self, void *Py_UNUSED(closure)) { return column(self, 0); }

static PyObject *core_token_n(TimelineCore *self, void *Py_UNUSED(closure)) { return column(self, 1); }

static PyObject *core_get_clock(TimelineCore *self, void *Py_UNUSED(closure)) { return Py_NewRef(self->clock_ns); }

static int core_set_clock(TimelineCore *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL || !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "clock_ns must be a callable that returns monotonic ns");
        return -1;
    }
    Py_SETREF(self->clock_ns, Py_NewRef(value));
    return 0;
}

static PyMethodDef core_methods[] = {
    {"token", (PyCFunction)(void (*)(void))core_token, METH_FASTCALL,
     "token(n=1): a decode step gave n tokens; stamped clock_ns() now."},
    {"token_at", (PyCFunction)(void (*)(void))core_token_at, METH_FASTCALL,
     "token_at(t, n): a decode step gave n tokens, stamped t (monotonic ns) by the caller."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"token_ts", (getter)core_token_ts, NULL, "One stamp per decode step that gave tokens (a copy).", NULL},
    {"token_n", (getter)core_token_n, NULL, "The tokens each of those steps gave (a copy).", NULL},
    {"clock_ns", (getter)core_get_clock, (setter)core_set_clock, "The clock stamps are read from.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TimelineCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.hotpath._stamps.TimelineCore",
    .tp_basicsize = sizeof(TimelineCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A timeline's per-token stamps (see the module's header comment).",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_getset = core_getset,
};

static struct PyModuleDef stamps_module = {
    PyModuleDef_HEAD_INIT, "_stamps", "The timeline's per-token stamps.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stamps(void) {
    if (PyType_Ready(&TimelineCoreType) < 0 || PyType_Ready(&Int64BlockType) < 0)
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
    if (PyModule_AddObjectRef(module, "TimelineCore", (PyObject *)&TimelineCoreType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
