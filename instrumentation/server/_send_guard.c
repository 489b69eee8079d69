/* SendGuard(awaitable, on_raise): awaits the server's `send(message)` for the ingress middleware
 * (asgi.py); when it raises an Exception (not a BaseException such as a cancellation),
 * `on_raise()` is called first (the middleware marks the client gone), then the exception goes on.
 *
 * Why C: the middleware wraps every body chunk's `send`; the chunks after the first content
 * chunk need nothing after `send` returns but this, and an `async def` for it was a coroutine and a
 * frame per chunk on the event loop. The awaitable is driven as `await` drives one (`am_send`), or
 * by hand (`send`, `throw`, `close`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *inner; /* the awaitable's iterator (a coroutine is its own) */
    PyObject *on_raise;
} SendGuard;

static PyObject *str_throw, *str_close;

static PyObject *guard_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *awaitable, *on_raise;
    if (!_PyArg_NoKeywords("SendGuard", kwargs) || !PyArg_UnpackTuple(args, "SendGuard", 2, 2, &awaitable, &on_raise))
        return NULL;
    if (!PyCallable_Check(on_raise)) {
        PyErr_SetString(PyExc_TypeError, "SendGuard(awaitable, on_raise): on_raise must be callable");
        return NULL;
    }
    PyObject *inner;
    if (PyCoro_CheckExact(awaitable)) {
        inner = Py_NewRef(awaitable);
    } else {
        unaryfunc await = Py_TYPE(awaitable)->tp_as_async ? Py_TYPE(awaitable)->tp_as_async->am_await : NULL;
        if (await == NULL) {
            PyErr_Format(PyExc_TypeError, "SendGuard(): %.100s is not awaitable", Py_TYPE(awaitable)->tp_name);
            return NULL;
        }
        if ((inner = await(awaitable)) == NULL)
            return NULL;
    }
    SendGuard *self = (SendGuard *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(inner);
        return NULL;
    }
    self->inner = inner;
    self->on_raise = Py_NewRef(on_raise);
    return (PyObject *)self;
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

/* a PySendResult as a Python-level call's result: the yielded value, or NULL with StopIteration(the
 * returned value) or the error set */
static PyObject *as_call_result(PySendResult status, PyObject *result) {
    if (status != PYGEN_RETURN)
        return result;
    PyObject *stop = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (stop != NULL) {
        PyErr_SetObject(PyExc_StopIteration, stop);
        Py_DECREF(stop);
    }
    return NULL;
}

static PyObject *guard_iternext(SendGuard *self) {
    PyObject *result;
    PySendResult status = guard_am_send(self, Py_None, &result);
    return as_call_result(status, result);
}

static PyObject *guard_send(SendGuard *self, PyObject *value) {
    PyObject *result;
    PySendResult status = guard_am_send(self, value, &result);
    return as_call_result(status, result);
}

static PyObject *guard_throw(SendGuard *self, PyObject *const *args, Py_ssize_t nargs) {
    if (self->inner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse an already awaited SendGuard");
        return NULL;
    }
    PyObject *throw = PyObject_GetAttr(self->inner, str_throw);
    if (throw == NULL)
        return NULL;
    PyObject *result = PyObject_Vectorcall(throw, args, nargs, NULL);
    Py_DECREF(throw);
    if (result == NULL && !PyErr_ExceptionMatches(PyExc_StopIteration))
        raised(self);
    return result;
}

static PyObject *guard_close(SendGuard *self, PyObject *Py_UNUSED(ignored)) {
    if (self->inner == NULL)
        Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs(self->inner, str_close);
}

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

static struct PyModuleDef guard_module = {
    PyModuleDef_HEAD_INIT, "_send_guard", "The ingress middleware's send, awaited with its error noted.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__send_guard(void) {
    if ((str_throw = PyUnicode_InternFromString("throw")) == NULL ||
        (str_close = PyUnicode_InternFromString("close")) == NULL || PyType_Ready(&SendGuardType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&guard_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "SendGuard", (PyObject *)&SendGuardType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
