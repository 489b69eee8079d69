/* What a C awaitable that drives another one needs, shared by the C modules that wrap an awaitable
 * on the event loop (the vLLM plugin's `_outputs.c`: `Taking`; the ingress middleware's
 * `_send_guard.c`: `SendGuard`): the inner iterator to drive, a send's result as a Python-level
 * call returns it, and `throw` / `close` handed to the inner one.
 */
#ifndef PHASELENS_AWAITING_H
#define PHASELENS_AWAITING_H

#include <Python.h>

/* what `await awaitable` drives: a coroutine itself, else its __await__ iterator (a new reference);
 * NULL with an exception set when it is not awaitable */
static inline PyObject *awaiting_iter(PyObject *awaitable) {
    if (PyCoro_CheckExact(awaitable))
        return Py_NewRef(awaitable);
    unaryfunc await = Py_TYPE(awaitable)->tp_as_async ? Py_TYPE(awaitable)->tp_as_async->am_await : NULL;
    if (await == NULL) {
        PyErr_Format(PyExc_TypeError, "%.100s is not awaitable", Py_TYPE(awaitable)->tp_name);
        return NULL;
    }
    return await(awaitable);
}

/* a PySendResult as a Python-level `send` returns it: the yielded value, or NULL with
 * StopIteration(the returned value) or the error set */
static inline PyObject *awaiting_call_result(PySendResult status, PyObject *result) {
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

/* inner.throw(*args): what it yields, or NULL with its StopIteration or error set */
static inline PyObject *awaiting_throw(PyObject *inner, PyObject *const *args, Py_ssize_t nargs) {
    if (inner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse an already awaited awaitable");
        return NULL;
    }
    PyObject *throw = PyObject_GetAttrString(inner, "throw");
    if (throw == NULL)
        return NULL;
    PyObject *result = PyObject_Vectorcall(throw, args, nargs, NULL);
    Py_DECREF(throw);
    return result;
}

/* inner.close() */
static inline PyObject *awaiting_close(PyObject *inner) {
    if (inner == NULL)
        Py_RETURN_NONE;
    return PyObject_CallMethod(inner, "close", NULL);
}

#endif
