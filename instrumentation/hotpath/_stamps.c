/* The serving loop's records in C: a request timeline's per-token stamps and its step link
 * (`TimelineCore`, the base of `timeline.RequestTimeline`), and an engine step's record with its
 * members' links packed (`StepRecorderCore`, the base of `timeline.StepRecorder`).
 *
 * TimelineCore holds the per-token stamps inline.
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
 *
 * The response's content-chunk stamps live in the struct too (`handle.ServerRequest`'s, written on the
 * event loop once per output and per body chunk): `first_token_ts`, `output_ready_ts`,
 * `first_chunk_ts`, `first_chunk_sent_ts`, `last_chunk_ts` (monotonic ns, 0 = not stamped),
 * `visible_tokens`, `body_bytes`, `output_pending`, read and written from Python as plain attributes,
 * and the three methods that write them per output and per chunk, `output_ready(output_tokens=0)`,
 * `body_sending(nbytes, carries_output=False)` and `chunk_sent()` (one C call each, no Python frame;
 * the clock read as `token()` reads it). `sends` (flat [stamp, body bytes through it, ...], at most
 * FIRST_SENDS_MAX pairs) is held inline and read as a copy, like `token_ts`.
 *
 * `link`: what an engine step links, the request's SERVER span ids packed (`records.pack_link`,
 * set at receipt), kept in the struct beside the stamps (a step reads the lines its members'
 * token stamps have just brought in) and copied from there into the step's packed links: no link
 * object referenced by the step's record, for the shipper to free cold on its thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

#include "_timeline_core.h"


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

static PyObject *core_token(TimelineCore *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t n = 1;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "token() takes at most 1 argument (n), %zd given", nargs);
        return NULL;
    }
    if (nargs == 1 && (n = as_stamp(args[0])) == -1)
        return NULL;
    int64_t t = read_clock(self->clock_ns);
    return t == -1 || timeline_append(self, t, n) < 0 ? NULL : Py_NewRef(Py_None);
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
    return n == -1 || timeline_append(self, t, n) < 0 ? NULL : Py_NewRef(Py_None);
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

/* n int64s, every `stride`-th from `items`, as a read-only int64 memoryview of their own copy */
static PyObject *int64_view(const int64_t *items, Py_ssize_t n, Py_ssize_t stride) {
    Int64Block *block = PyObject_NewVar(Int64Block, &Int64BlockType, n);
    if (block == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        block->items[i] = items[stride * i];
    PyObject *view = PyMemoryView_FromObject((PyObject *)block);
    Py_DECREF(block);
    return view;
}

static PyObject *core_token_ts(TimelineCore *self, void *Py_UNUSED(closure)) {
    return int64_view(self->tokens, self->size, 2);
}

static PyObject *core_token_n(TimelineCore *self, void *Py_UNUSED(closure)) {
    return int64_view(self->tokens + 1, self->size, 2);
}

static PyObject *core_sends(TimelineCore *self, void *Py_UNUSED(closure)) {
    return int64_view(self->sends, self->sends_size, 1);
}

/* output_ready(output_tokens=0): observer.RequestHandle.output_ready (timeline_output_ready) */
static PyObject *core_output_ready(TimelineCore *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t tokens = 0;
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "output_ready() takes at most 1 argument (output_tokens), %zd given", nargs);
        return NULL;
    }
    if (nargs == 1 && (tokens = as_stamp(args[0])) == -1)
        return NULL;
    if (timeline_output_ready(self, tokens) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* body_sending(nbytes, carries_output=False) (timeline_body_sending) */
static PyObject *core_body_sending(TimelineCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "body_sending() takes 1 or 2 arguments (nbytes, carries_output), %zd given",
                     nargs);
        return NULL;
    }
    int64_t nbytes = as_stamp(args[0]);
    if (nbytes == -1)
        return NULL;
    int carries = nargs == 2 ? PyObject_IsTrue(args[1]) : 0;
    if (carries < 0 || timeline_body_sending(self, nbytes, carries) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* chunk_sent(): that `send` returned (its bytes written, or queued behind a full socket buffer) */
static PyObject *core_chunk_sent(TimelineCore *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->first_chunk_sent_ts) {
        int64_t t = read_clock(self->clock_ns);
        if (t == -1)
            return NULL;
        self->first_chunk_sent_ts = t;
    }
    self->output_pending = 0;
    Py_RETURN_NONE;
}

static PyObject *core_get_clock(TimelineCore *self, void *Py_UNUSED(closure)) { return Py_NewRef(self->clock_ns); }

static int core_set_clock(TimelineCore *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL || !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "clock_ns must be a callable that returns monotonic ns");
        return -1;
    }
    Py_SETREF(self->clock_ns, Py_NewRef(value));
    return 0;
}

static PyObject *core_get_link(TimelineCore *self, void *Py_UNUSED(closure)) {
    if (!self->linked)
        Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)self->link, LINK_BYTES);
}

static int core_set_link(TimelineCore *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == Py_None) {
        self->linked = 0;
        return 0;
    }
    if (value == NULL || !PyBytes_Check(value) || PyBytes_GET_SIZE(value) != LINK_BYTES) {
        PyErr_Format(PyExc_TypeError, "link: a packed link (records.pack_link: %d bytes) or None expected", LINK_BYTES);
        return -1;
    }
    memcpy(self->link, PyBytes_AS_STRING(value), LINK_BYTES);
    self->linked = 1;
    return 0;
}

static PyMethodDef core_methods[] = {
    {"token", (PyCFunction)(void (*)(void))core_token, METH_FASTCALL,
     "token(n=1): a decode step gave n tokens; stamped clock_ns() now."},
    {"token_at", (PyCFunction)(void (*)(void))core_token_at, METH_FASTCALL,
     "token_at(t, n): a decode step gave n tokens, stamped t (monotonic ns) by the caller."},
    {"output_ready", (PyCFunction)(void (*)(void))core_output_ready, METH_FASTCALL,
     "output_ready(output_tokens=0): the API layer took output that renders text (observer.RequestHandle)."},
    {"body_sending", (PyCFunction)(void (*)(void))core_body_sending, METH_FASTCALL,
     "body_sending(nbytes, carries_output=False): nbytes of response body handed to the server's send."},
    {"chunk_sent", (PyCFunction)core_chunk_sent, METH_NOARGS, "chunk_sent(): that send returned."},
    {NULL, NULL, 0, NULL},
};

#define STAMP(name, doc) {#name, T_LONGLONG, offsetof(TimelineCore, name), 0, doc}
static PyMemberDef core_members[] = {
    STAMP(first_token_ts, "The first token was handed to the request's stream (monotonic ns, 0: not yet)."),
    STAMP(output_ready_ts, "The API layer took the first output that renders text."),
    STAMP(first_chunk_ts, "The first body chunk carrying output was handed to the server's send."),
    STAMP(first_chunk_sent_ts, "That send returned."),
    STAMP(last_chunk_ts, "The last body chunk carrying output so far was handed to send."),
    STAMP(visible_tokens, "Output tokens handed to the stream when the first text reached the API layer (0: unknown)."),
    STAMP(body_bytes, "Response body bytes handed to send so far."),
    {"output_pending", T_BOOL, offsetof(TimelineCore, output_pending), 0,
     "output_ready() was called since the last body chunk carrying output."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"token_ts", (getter)core_token_ts, NULL, "One stamp per decode step that gave tokens (a copy).", NULL},
    {"token_n", (getter)core_token_n, NULL, "The tokens each of those steps gave (a copy).", NULL},
    {"sends", (getter)core_sends, NULL, "Flat [stamp, body bytes through it, ...] of the first sends (a copy).", NULL},
    {"clock_ns", (getter)core_get_clock, (setter)core_set_clock, "The clock stamps are read from.", NULL},
    {"link", (getter)core_get_link, (setter)core_set_link,
     "What an engine step links: the SERVER span's ids packed (records.pack_link), None when not sampled.", NULL},
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
    .tp_members = core_members,
    .tp_getset = core_getset,
};

/* StepRecorderCore: `timeline.StepRecorder`'s C part. step(stats, requests) submits
 * record_type(index, *stats, len(requests), links): links = the members' links packed end to end
 * (LINK_BYTES each), read from each TimelineCore's struct; any other member (NullRequest, a loop's
 * own object) is linked when its `link` attribute is a packed link, else only counted. */
typedef struct {
    PyObject_HEAD
    PyObject *submit;      /* NULL until __init__ */
    PyObject *record_type; /* a tuple subclass: records.StepRecord */
    Py_ssize_t stats;      /* the items a step's stats holds: the record's fields less three */
    Py_ssize_t index;      /* the next step's */
    PyObject *member_type; /* the last members' type found to be a TimelineCore: the check is a compare */
} StepRecorderCore;

static int recorder_init(StepRecorderCore *self, PyObject *args, PyObject *kwargs) {
    PyObject *submit, *record_type;
    if (!_PyArg_NoKeywords("StepRecorderCore", kwargs) ||
        !PyArg_UnpackTuple(args, "StepRecorderCore", 2, 2, &submit, &record_type))
        return -1;
    if (!PyCallable_Check(submit) || !PyType_Check(record_type) ||
        !PyType_IsSubtype((PyTypeObject *)record_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "StepRecorderCore(submit: callable, record_type: a NamedTuple type)");
        return -1;
    }
    PyObject *fields = PyObject_GetAttrString(record_type, "_fields");
    if (fields == NULL)
        return -1;
    Py_ssize_t count = PyObject_Length(fields);
    Py_DECREF(fields);
    if (count < 0)
        return -1;
    if (count < 3) {
        PyErr_SetString(PyExc_TypeError, "StepRecorderCore: the record holds index, stats, num_seqs, links");
        return -1;
    }
    Py_XSETREF(self->submit, Py_NewRef(submit));
    Py_XSETREF(self->record_type, Py_NewRef(record_type));
    self->stats = count - 3;
    return 0;
}

static int recorder_traverse(StepRecorderCore *self, visitproc visit, void *arg) {
    Py_VISIT(self->submit);
    Py_VISIT(self->record_type);
    Py_VISIT(self->member_type);
    return 0;
}

static int recorder_clear(StepRecorderCore *self) {
    Py_CLEAR(self->submit);
    Py_CLEAR(self->record_type);
    Py_CLEAR(self->member_type);
    return 0;
}

static void recorder_dealloc(StepRecorderCore *self) {
    PyObject_GC_UnTrack(self);
    recorder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the member is a TimelineCore (PyObject_TypeCheck walks the subclass's MRO: ~20 instructions) */
static int is_timeline(StepRecorderCore *self, PyObject *member) {
    if ((PyObject *)Py_TYPE(member) == self->member_type)
        return 1;
    if (!PyObject_TypeCheck(member, &TimelineCoreType))
        return 0;
    Py_XSETREF(self->member_type, Py_NewRef((PyObject *)Py_TYPE(member)));
    return 1;
}

/* a member's link copied to `at`: 1, or 0 when it has none; -1 with an exception set */
static int member_link(StepRecorderCore *self, PyObject *member, unsigned char *at) {
    if (is_timeline(self, member)) {
        TimelineCore *timeline = (TimelineCore *)member;
        if (timeline->linked)
            memcpy(at, timeline->link, LINK_BYTES);
        return timeline->linked;
    }
    PyObject *link = PyObject_GetAttrString(member, "link");
    if (link == NULL) { /* a loop's own object: counted, not linked */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    int linked = PyBytes_Check(link) && PyBytes_GET_SIZE(link) == LINK_BYTES;
    if (linked)
        memcpy(at, PyBytes_AS_STRING(link), LINK_BYTES);
    Py_DECREF(link);
    return linked;
}

/* the members' links end to end; *members = how many there were */
static PyObject *pack_links(StepRecorderCore *self, PyObject *requests, Py_ssize_t *members) {
    PyObject *seq = PySequence_Fast(requests, "step(): requests must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), used = 0;
    PyObject *links = n > PY_SSIZE_T_MAX / LINK_BYTES ? PyErr_NoMemory() : PyBytes_FromStringAndSize(NULL, n * LINK_BYTES);
    /* a foreign member's `link` may run Python code that changes a list of requests: the size is
     * read again each member, and no more than n are read */
    for (Py_ssize_t i = 0; links != NULL && i < n && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *member = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        int linked = member_link(self, member, (unsigned char *)PyBytes_AS_STRING(links) + used);
        Py_DECREF(member);
        if (linked < 0)
            Py_CLEAR(links);
        else
            used += linked * LINK_BYTES;
    }
    Py_DECREF(seq);
    if (links != NULL && used != n * LINK_BYTES && _PyBytes_Resize(&links, used) < 0)
        return NULL;
    *members = n;
    return links;
}

static PyObject *recorder_step(StepRecorderCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "step() takes 2 arguments (stats, requests), %zd given", nargs);
        return NULL;
    }
    if (self->submit == NULL) {
        PyErr_SetString(PyExc_TypeError, "step(): the recorder was not initialised");
        return NULL;
    }
    PyObject *stats = args[0];
    if (!PyTuple_Check(stats) || PyTuple_GET_SIZE(stats) != self->stats) {
        PyErr_Format(PyExc_TypeError, "step(): stats must be a StepStats (%zd items)", self->stats);
        return NULL;
    }
    Py_ssize_t members;
    PyObject *links = pack_links(self, args[1], &members);
    if (links == NULL)
        return NULL;
    PyObject *index = PyLong_FromSsize_t(self->index), *count = PyLong_FromSsize_t(members);
    PyTypeObject *type = (PyTypeObject *)self->record_type;
    PyObject *record = index && count ? type->tp_alloc(type, self->stats + 3) : NULL;
    if (record == NULL) {
        Py_XDECREF(index);
        Py_XDECREF(count);
        Py_DECREF(links);
        return NULL;
    }
    /* tuple.__new__'s way for a subclass: the items set once, every one made beforehand */
    PyTuple_SET_ITEM(record, 0, index);
    for (Py_ssize_t i = 0; i < self->stats; i++)
        PyTuple_SET_ITEM(record, i + 1, Py_NewRef(PyTuple_GET_ITEM(stats, i)));
    PyTuple_SET_ITEM(record, self->stats + 1, count);
    PyTuple_SET_ITEM(record, self->stats + 2, links);
    self->index++;
    PyObject *submitted = PyObject_CallOneArg(self->submit, record);
    Py_DECREF(record);
    if (submitted == NULL)
        return NULL;
    Py_DECREF(submitted);
    Py_RETURN_NONE;
}

static PyObject *recorder_get_submit(StepRecorderCore *self, void *Py_UNUSED(closure)) {
    return Py_NewRef(self->submit ? self->submit : Py_None);
}

static int recorder_set_submit(StepRecorderCore *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL || !PyCallable_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "submit must be a callable that takes a step's record");
        return -1;
    }
    Py_XSETREF(self->submit, Py_NewRef(value));
    return 0;
}

static PyGetSetDef recorder_getset[] = {
    {"submit", (getter)recorder_get_submit, (setter)recorder_set_submit, "Where each step's record goes.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef recorder_methods[] = {
    {"step", (PyCFunction)(void (*)(void))recorder_step, METH_FASTCALL,
     "step(stats, requests): one engine iteration's record, its members' links packed, submitted."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepRecorderCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.hotpath._stamps.StepRecorderCore",
    .tp_basicsize = sizeof(StepRecorderCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "StepRecorderCore(submit, record_type): engine steps' records (see the comment above it).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)recorder_init,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_methods = recorder_methods,
    .tp_getset = recorder_getset,
};

static struct PyModuleDef stamps_module = {
    PyModuleDef_HEAD_INIT, "_stamps", "The serving loop's records: a timeline's token stamps, an engine step's links.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stamps(void) {
    if (PyType_Ready(&TimelineCoreType) < 0 || PyType_Ready(&StepRecorderCoreType) < 0 ||
        PyType_Ready(&Int64BlockType) < 0)
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
    if (PyModule_AddObjectRef(module, "TimelineCore", (PyObject *)&TimelineCoreType) < 0 ||
        PyModule_AddObjectRef(module, "StepRecorderCore", (PyObject *)&StepRecorderCoreType) < 0 ||
        PyModule_AddIntConstant(module, "FIRST_SENDS_MAX", FIRST_SENDS_MAX) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
