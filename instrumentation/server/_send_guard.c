/* The ingress middleware's `send` for the body chunks of a stream (asgi.py), in C.
 *
 * BodySender(handle, send, tracked, client_gone): the `send` the app gets for one request. A body
 * chunk after the first content chunk's `send` returned, not the last (a dict message of type
 * "http.response.body" with `more_body` true, the handle's `first_chunk_sent_ts` stamped), is
 * stamped here (`body_sending`: carrying output when `output_pending`, which is cleared at once:
 * only the request's task sets it, and nothing is stamped after its `send`), and `send(message)` is
 * returned inside a SendGuard(client_gone). Any other message (the start, the chunks up to the
 * first content chunk's `send`, the last) goes to `tracked(message)`, the middleware's coroutine.
 *
 * SendGuard(awaitable, on_raise): awaits it; when it raises an Exception (not a BaseException such
 * as a cancellation), `on_raise()` is called first (the middleware marks the client gone), then the
 * exception goes on. Driven as `await` drives an awaitable (`am_send`), or by hand (`send`, `throw`,
 * `close`).
 *
 * Why C: most chunks of a stream come after the first content chunk, and each was an `async def`
 * of the middleware's: a coroutine, a frame and ~20 lines of Python per chunk on the event loop.
 * The handle's stamps are its C struct's (`instrumentation/hotpath/_timeline_core.h`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#include "../hotpath/_awaiting.h"
#include "../hotpath/_timeline_core.h"

typedef struct {
    PyObject_HEAD
    PyObject *inner; /* the awaitable's iterator (a coroutine is its own) */
    PyObject *on_raise;
} SendGuard;

static PyObject *str_type, *str_more_body, *str_body, *str_body_type;
static PyTypeObject *timeline_type; /* _stamps.TimelineCore */
static PyTypeObject SendGuardType;

/* a SendGuard awaiting `awaitable` (a new reference); NULL with an exception set */
static PyObject *make_guard(PyTypeObject *type, PyObject *awaitable, PyObject *on_raise) {
    PyObject *inner = awaiting_iter(awaitable);
    if (inner == NULL)
        return NULL;
    SendGuard *self = (SendGuard *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(inner);
        return NULL;
    }
    self->inner = inner;
    self->on_raise = Py_NewRef(on_raise);
    return (PyObject *)self;
}

static PyObject *guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *awaitable, *on_raise;
    if (!_PyArg_NoKeywords("SendGuard", kwargs) || !PyArg_UnpackTuple(args, "SendGuard", 2, 2, &awaitable, &on_raise))
        return NULL;
    if (!PyCallable_Check(on_raise)) {
        PyErr_SetString(PyExc_TypeError, "SendGuard(awaitable, on_raise): on_raise must be callable");
        return NULL;
    }
    return make_guard(type, awaitable, on_raise);
}

static int guard_traverse(SendGuard *self, visitproc visit, void *arg) {
    Py_VISIT(self->inner);
    Py_VISIT(self->on_raise);
    return 0;
}

static int guard_clear(SendGuard *self) {
    Py_CLEAR(self->inner);
    Py_CLEAR(self->on_raise);
    return 0;
}

static void guard_dealloc(SendGuard *self) {
    PyObject_GC_UnTrack(self);
    guard_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the awaitable raised (the exception set): on_raise() for an Exception; the exception kept, or
 * on_raise's own in its place */
static void raised(SendGuard *self) {
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *done = PyObject_CallNoArgs(self->on_raise);
    if (done == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return;
    }
    Py_DECREF(done);
    PyErr_Restore(type, value, traceback);
}

static PySendResult guard_am_send(SendGuard *self, PyObject *arg, PyObject **result) {
    if (self->inner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse an already awaited SendGuard");
        *result = NULL;
        return PYGEN_ERROR;
    }
    PySendResult status = PyIter_Send(self->inner, arg, result);
    if (status == PYGEN_ERROR)
        raised(self);
    return status;
}

static PyObject *guard_iternext(SendGuard *self) {
    PyObject *result;
    PySendResult status = guard_am_send(self, Py_None, &result);
    return awaiting_call_result(status, result);
}

static PyObject *guard_send(SendGuard *self, PyObject *value) {
    PyObject *result;
    PySendResult status = guard_am_send(self, value, &result);
    return awaiting_call_result(status, result);
}

static PyObject *guard_throw(SendGuard *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *result = awaiting_throw(self->inner, args, nargs);
    if (result == NULL && !PyErr_ExceptionMatches(PyExc_StopIteration))
        raised(self);
    return result;
}

static PyObject *guard_close(SendGuard *self, PyObject *Py_UNUSED(ignored)) { return awaiting_close(self->inner); }

static PyObject *guard_await(SendGuard *self) { return Py_NewRef(self); }

static PyAsyncMethods guard_async = {
    .am_await = (unaryfunc)guard_await,
    .am_send = (sendfunc)guard_am_send,
};

static PyMethodDef guard_methods[] = {
    {"send", (PyCFunction)guard_send, METH_O, "send(value): into the awaitable."},
    {"throw", (PyCFunction)(void (*)(void))guard_throw, METH_FASTCALL, "throw(...): into the awaitable."},
    {"close", (PyCFunction)guard_close, METH_NOARGS, "close(): the awaitable."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SendGuardType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.server._send_guard.SendGuard",
    .tp_basicsize = sizeof(SendGuard),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SendGuard(awaitable, on_raise): awaits it; on_raise() when it raises an Exception.",
    .tp_new = guard_new,
    .tp_dealloc = (destructor)guard_dealloc,
    .tp_traverse = (traverseproc)guard_traverse,
    .tp_clear = (inquiry)guard_clear,
    .tp_as_async = &guard_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)guard_iternext,
    .tp_methods = guard_methods,
};

typedef struct {
    PyObject_HEAD
    PyObject *handle; /* a request timeline */
    PyObject *send;
    PyObject *tracked;
    PyObject *client_gone;
    vectorcallfunc vectorcall;
} BodySender;

/* the body chunk's bytes when `message` is one BodySender stamps itself (module comment), else -1;
 * -2 with an exception set */
static Py_ssize_t later_body_chunk(TimelineCore *handle, PyObject *message) {
    if (!handle->first_chunk_sent_ts || !PyDict_CheckExact(message))
        return -1;
    PyObject *type = PyDict_GetItemWithError(message, str_type);
    if (type == NULL || !PyUnicode_CheckExact(type) || PyUnicode_Compare(type, str_body_type) != 0)
        return PyErr_Occurred() ? -2 : -1;
    PyObject *more = PyDict_GetItemWithError(message, str_more_body);
    if (more != Py_True) /* ASGI's more_body is a bool; anything else goes the tracked way */
        return PyErr_Occurred() ? -2 : -1;
    PyObject *body = PyDict_GetItemWithError(message, str_body);
    if (body == NULL || body == Py_None)
        return PyErr_Occurred() ? -2 : 0;
    Py_ssize_t nbytes = PyObject_Length(body);
    return nbytes < 0 ? -2 : nbytes;
}

static PyObject *sender_call(BodySender *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    TimelineCore *handle = (TimelineCore *)self->handle;
    Py_ssize_t nbytes = PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL ? later_body_chunk(handle, args[0]) : -1;
    if (nbytes == -2)
        return NULL;
    if (nbytes == -1)
        return PyObject_Vectorcall(self->tracked, args, nargsf, kwnames);
    if (timeline_body_sending(handle, nbytes, handle->output_pending) < 0)
        return NULL;
    handle->output_pending = 0;
    PyObject *sending = PyObject_CallOneArg(self->send, args[0]);
    if (sending == NULL)
        return NULL;
    PyObject *guard = make_guard(&SendGuardType, sending, self->client_gone);
    Py_DECREF(sending);
    return guard;
}

static PyObject *sender_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *handle, *send, *tracked, *client_gone;
    if (!_PyArg_NoKeywords("BodySender", kwargs) ||
        !PyArg_UnpackTuple(args, "BodySender", 4, 4, &handle, &send, &tracked, &client_gone))
        return NULL;
    if (!PyObject_TypeCheck(handle, timeline_type) || !PyCallable_Check(send) || !PyCallable_Check(tracked) ||
        !PyCallable_Check(client_gone)) {
        PyErr_SetString(PyExc_TypeError, "BodySender(handle: a request timeline, send, tracked, client_gone: callables)");
        return NULL;
    }
    BodySender *self = (BodySender *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->handle = Py_NewRef(handle);
    self->send = Py_NewRef(send);
    self->tracked = Py_NewRef(tracked);
    self->client_gone = Py_NewRef(client_gone);
    self->vectorcall = (vectorcallfunc)sender_call;
    return (PyObject *)self;
}

static int sender_traverse(BodySender *self, visitproc visit, void *arg) {
    Py_VISIT(self->handle);
    Py_VISIT(self->send);
    Py_VISIT(self->tracked);
    Py_VISIT(self->client_gone);
    return 0;
}

static int sender_clear(BodySender *self) {
    Py_CLEAR(self->handle);
    Py_CLEAR(self->send);
    Py_CLEAR(self->tracked);
    Py_CLEAR(self->client_gone);
    return 0;
}

static void sender_dealloc(BodySender *self) {
    PyObject_GC_UnTrack(self);
    sender_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BodySenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.instrumentation.server._send_guard.BodySender",
    .tp_basicsize = sizeof(BodySender),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "BodySender(handle, send, tracked, client_gone): the middleware's send (module comment).",
    .tp_new = sender_new,
    .tp_dealloc = (destructor)sender_dealloc,
    .tp_traverse = (traverseproc)sender_traverse,
    .tp_clear = (inquiry)sender_clear,
    .tp_vectorcall_offset = offsetof(BodySender, vectorcall),
    .tp_call = PyVectorcall_Call,
};

static struct PyModuleDef guard_module = {
    PyModuleDef_HEAD_INIT, "_send_guard", "The ingress middleware's send for a stream's body chunks (BodySender, SendGuard).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__send_guard(void) {
    struct {
        PyObject **name;
        const char *text;
    } names[] = {
        {&str_type, "type"}, {&str_more_body, "more_body"}, {&str_body, "body"}, {&str_body_type, "http.response.body"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].name = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    if ((timeline_type = timeline_import()) == NULL || PyType_Ready(&SendGuardType) < 0 ||
        PyType_Ready(&BodySenderType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&guard_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "SendGuard", (PyObject *)&SendGuardType) < 0 ||
        PyModule_AddObjectRef(module, "BodySender", (PyObject *)&BodySenderType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
