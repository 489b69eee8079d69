/* BoundedHandOff: a bounded single-consumer queue between the serving loop and a sink's thread
 * (`sink.py`).
 *
 * `offer(item)` -> bool: `offered` += 1; with `capacity` items waiting the item is dropped
 * (`dropped` += 1, False), else appended (True). Never blocks, never raises for a full queue.
 * `drain()` -> list: every item waiting, oldest first, the queue left empty. `close()`: every later
 * offer is dropped and what was waiting is counted dropped. `len()`: the items waiting.
 *
 * Why C: the producers are the hot path (the loop's closed requests, one record per engine step):
 * a Python `offer` was one more frame per record, ~1.2k instructions. Each method runs under the GIL
 * with no call back into Python, so each is atomic for the producer threads and the one consumer;
 * `drain` swaps the list for an empty one (no per-item work, as the deque's pops were).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *items; /* a list, oldest first */
    Py_ssize_t capacity;
    Py_ssize_t offered;
    Py_ssize_t dropped;
} HandOff;

static PyObject *handoff_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"capacity", NULL};
    Py_ssize_t capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n:BoundedHandOff", keywords, &capacity))
        return NULL;
    if (capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "BoundedHandOff(capacity): capacity must be >= 0");
        return NULL;
    }
    HandOff *self = (HandOff *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if ((self->items = PyList_New(0)) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->capacity = capacity;
    return (PyObject *)self;
}

static int handoff_traverse(HandOff *self, visitproc visit, void *arg) {
    Py_VISIT(self->items);
    return 0;
}

static int handoff_clear(HandOff *self) {
    Py_CLEAR(self->items);
    return 0;
}

static void handoff_dealloc(HandOff *self) {
    PyObject_GC_UnTrack(self);
    handoff_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *handoff_offer(HandOff *self, PyObject *item) {
    self->offered++;
    if (PyList_GET_SIZE(self->items) >= self->capacity) {
        self->dropped++;
        Py_RETURN_FALSE;
    }
    if (PyList_Append(self->items, item) < 0) { /* no memory: dropped and counted, as a full queue */
        PyErr_Clear();
        self->dropped++;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *handoff_drain(HandOff *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *empty = PyList_New(0);
    if (empty == NULL)
        return NULL;
    PyObject *items = self->items;
    self->items = empty;
    return items;
}

static PyObject *handoff_close(HandOff *self, PyObject *Py_UNUSED(ignored)) {
    self->capacity = 0;
    self->dropped += PyList_GET_SIZE(self->items);
    return PyList_SetSlice(self->items, 0, PyList_GET_SIZE(self->items), NULL) < 0 ? NULL : Py_NewRef(Py_None);
}

static Py_ssize_t handoff_len(HandOff *self) {
    return PyList_GET_SIZE(self->items);
}

static PyMethodDef handoff_methods[] = {
    {"offer", (PyCFunction)handoff_offer, METH_O, "offer(item) -> bool: appended, or dropped and counted (full)."},
    {"drain", (PyCFunction)handoff_drain, METH_NOARGS, "drain() -> list: every item waiting, oldest first."},
    {"close", (PyCFunction)handoff_close, METH_NOARGS, "close(): later offers dropped; what waits counted dropped."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef handoff_members[] = {
    {"capacity", T_PYSSIZET, offsetof(HandOff, capacity), READONLY, "The most items waiting at once."},
    {"offered", T_PYSSIZET, offsetof(HandOff, offered), READONLY, "Items offered so far."},
    {"dropped", T_PYSSIZET, offsetof(HandOff, dropped), READONLY, "Items dropped so far (full, or closed)."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods handoff_as_sequence = {.sq_length = (lenfunc)handoff_len};

static PyTypeObject HandOffType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.pipeline._handoff.BoundedHandOff",
    .tp_basicsize = sizeof(HandOff),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "BoundedHandOff(capacity): a bounded single-consumer queue (module comment).",
    .tp_new = handoff_new,
    .tp_traverse = (traverseproc)handoff_traverse,
    .tp_clear = (inquiry)handoff_clear,
    .tp_dealloc = (destructor)handoff_dealloc,
    .tp_methods = handoff_methods,
    .tp_members = handoff_members,
    .tp_as_sequence = &handoff_as_sequence,
};

static struct PyModuleDef handoff_module = {
    PyModuleDef_HEAD_INIT, "_handoff", "A bounded single-consumer hand-off (module comment).", -1, NULL,
    NULL,                  NULL,       NULL,                                                   NULL,
};

PyMODINIT_FUNC PyInit__handoff(void) {
    if (PyType_Ready(&HandOffType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&handoff_module);
    if (module != NULL && PyModule_AddObjectRef(module, "BoundedHandOff", (PyObject *)&HandOffType) < 0)
        Py_CLEAR(module);
    return module;
}
