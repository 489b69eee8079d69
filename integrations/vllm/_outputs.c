/* vLLM's outputs on its API-server event loop, the plugin's per-output work in C (hooks.py,
 * tracker.py): the output batch's token stamps, and the request's task taking its output.
 *
 * Why C: this runs once per output of every request and once per engine step. In Python each
 * output cost loop iterations in `before_outputs` / `after_outputs`, and each take a coroutine and
 * frame of the `get` wrapper (each resume going through both) and a call of `output_taken`; each
 * step three frames of the tracker's (before, after, the step's bookkeeping).
 *
 * `Batch(open, observer, clock_ns)`: the output batch in hand and the engine step it makes, the state
 * the tracker's Python shares (`open`: vLLM request id → open handle, `members`, `first_tokens`,
 * `scheduled_ts`, `finished_now`, `idle`, ...):
 * `before(outputs, end_s, iteration_stats, states)`: before vLLM processes a batch, its stamp, stats
 * and live requests noted, and [handle, new tokens, None, ...] (flat triples) for its outputs when
 * every output's request has an open handle, else None: a batch with a request seen for the first
 * time goes through the tracker's Python (its handle opened, its stats read), which gives the same
 * triples with the stats ([] once `idle`).
 * `after(seen, now)`: after it, each handle's tokens stamped `now` (as `token_at`, none for 0
 * tokens) and the handles appended to `members` (the step's, in the batch's order), when no triple
 * holds stats and every handle is a request timeline: True; else False, nothing done (the tracker's
 * Python does a first sight's).
 * `step(scheduler_stats)`: once per output batch, the step's state taken (the next starts empty) and,
 * when it had members and the tracker is not idle, one engine step's record handed to
 * `observer.step(stats, members)`. On the EngineCore's clock (ns):
 *     end = int(end_s × 1e9) (its stamp of the batch; without one, clock_ns() now)
 *     start = max(previous step's end, scheduled_ts) or end   (the engine was busy since the previous
 *             batch, or idle until it first scheduled a request new in this one)
 *     prefill = num_prompt_tokens, decode = max(0, num_generation_tokens − first_tokens),
 *     preemptions = num_preempted_reqs     (of vLLM's IterationStats; 0 without)
 *     kv used, total = round(kv_cache_usage × KV_SCALE), KV_SCALE   (0, 0 without a usage)
 *     queue = num_waiting_reqs (0 without)
 *   True when the tracker's Python has work of the step: KV-connector stats, a request finished in
 *   it (`finished_now`), or every SWEEP_EVERY_STEPS steps the sweep of vanished requests.
 *
 * `output_taken(handle, output)`: output (a vLLM RequestOutput: `outputs`, each with `text`, and
 * `finished`) that renders text is `output_ready`: the first time with the tokens handed to the
 * stream so far (1 + sum(token_n): the first token and the later ones), so the decode steps of
 * tokens that rendered none are `held_back`; every time, so that the middleware stamps each content
 * chunk's `send`. A finished output without text is the answer still (one token that renders none:
 * a P/D prefill half). Nothing before the first token (`first_token_ts` 0: not this request's yet).
 * The handle is a request timeline (`ServerRequest`): its C struct is read and written directly
 * (`instrumentation/hotpath/_timeline_core.h`).
 *
 * `CollectorHook(original, current, on_error, awaits)`: the `get` / `get_nowait` wrappers themselves
 * (C method descriptors: no frame of ours per call), below.
 *
 * `Taking(awaitable, handle, on_error)`: what the `get` wrapper returns, vLLM's coroutine awaited
 * (`am_send`, the protocol `await` uses; `send` / `throw` / `close` for everything else) and, when
 * it returns output, `output_taken` run: no frame of ours per output. A failure there never reaches
 * vLLM: `on_error(exception)` is called (hooks.py logs it once) and the output goes on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

#include "../../instrumentation/hotpath/_awaiting.h"
#include "../../instrumentation/hotpath/_timeline_core.h"

static PyObject *str_outputs, *str_text, *str_finished, *str_request_id, *str_new_token_ids, *str_num_prompt_tokens,
    *str_num_generation_tokens, *str_num_preempted_reqs, *str_kv_cache_usage, *str_num_waiting_reqs, *str_step, *str_kv_connector_stats;
static PyObject *kv_scale, *builtin_round; /* KV_SCALE as an int; builtins.round */
static PyTypeObject *step_stats_type;      /* records.StepStats */
#define KV_SCALE 1000000 /* vLLM gives KV use as a fraction: written as used/total per million */
static PyTypeObject *timeline_type; /* _stamps.TimelineCore */

#if PY_VERSION_HEX < 0x030D0000
#define PyObject_GetOptionalAttr _PyObject_LookupAttr
#endif

/* the attribute's truth: 1, 0, or -1 with an exception set; `missing` when it has none */
static int attr_true(PyObject *obj, PyObject *name, int missing) {
    PyObject *value;
    if (PyObject_GetOptionalAttr(obj, name, &value) < 0)
        return -1;
    if (value == NULL)
        return missing;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* whether any of output.outputs has non-empty text: 1, 0, -1 with an exception set */
static int renders_text(PyObject *output) {
    PyObject *outputs;
    if (PyObject_GetOptionalAttr(output, str_outputs, &outputs) < 0)
        return -1;
    if (outputs == NULL)
        return 0;
    PyObject *seq = PySequence_Fast(outputs, "RequestOutput.outputs must be a sequence");
    Py_DECREF(outputs);
    if (seq == NULL)
        return -1;
    int found = 0;
    for (Py_ssize_t i = 0; found == 0 && i < PySequence_Fast_GET_SIZE(seq); i++)
        found = attr_true(PySequence_Fast_GET_ITEM(seq, i), str_text, 0);
    Py_DECREF(seq);
    return found;
}

/* the batch's [handle, new tokens, None, ...] when every output's request is open in `open`, else
 * None (module comment: `Batch.before`); NULL with an exception set */
static PyObject *outputs_seen(PyObject *outputs, PyObject *open) {
    PyObject *seq = PySequence_Fast(outputs, "Batch.before(): outputs must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *seen = PyList_New(3 * n);
    /* an output's attribute may run Python code that changes the list: its size is read again */
    for (Py_ssize_t i = 0; seen != NULL && i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(seq)) { /* shrunk: the tracker's Python reads it */
            Py_CLEAR(seen);
            break;
        }
        PyObject *output = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i)), *handle = NULL, *tokens = NULL;
        PyObject *req_id = PyObject_GetAttr(output, str_request_id);
        if (req_id != NULL) {
            handle = Py_XNewRef(PyDict_GetItemWithError(open, req_id));
            Py_DECREF(req_id);
        }
        PyObject *ids = handle != NULL ? PyObject_GetAttr(output, str_new_token_ids) : NULL;
        if (ids != NULL) {
            Py_ssize_t count = PyObject_Length(ids);
            Py_DECREF(ids);
            tokens = count < 0 ? NULL : PyLong_FromSsize_t(count);
        }
        Py_DECREF(output);
        if (tokens == NULL) { /* an error, or a request without an open handle: None */
            Py_XDECREF(handle);
            Py_CLEAR(seen);
            break;
        }
        PyList_SET_ITEM(seen, 3 * i, handle);
        PyList_SET_ITEM(seen, 3 * i + 1, tokens);
        PyList_SET_ITEM(seen, 3 * i + 2, Py_NewRef(Py_None));
    }
    Py_DECREF(seq);
    if (seen == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return seen;
}

/* the batch's token stamps at `now` and its handles appended to `members` (module comment:
 * `Batch.after`): 1; 0 with nothing done for a triple with stats or a handle that is no timeline; -1
 * with an exception set */
static int stamp_seen(PyObject *seen, int64_t now, PyObject *members) {
    if (!PyList_Check(seen) || PyList_GET_SIZE(seen) % 3) {
        PyErr_SetString(PyExc_TypeError, "Batch.after(seen: a list of triples, now)");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(seen);
    for (Py_ssize_t i = 0; i < n; i += 3)
        if (PyList_GET_ITEM(seen, i + 2) != Py_None || !PyObject_TypeCheck(PyList_GET_ITEM(seen, i), timeline_type))
            return 0;
    for (Py_ssize_t i = 0; i < n; i += 3) { /* nothing below runs Python code: the list stays as it is */
        TimelineCore *handle = (TimelineCore *)PyList_GET_ITEM(seen, i);
        int64_t tokens = as_stamp(PyList_GET_ITEM(seen, i + 1));
        if (tokens == -1 || (tokens && timeline_append(handle, now, tokens) < 0) ||
            PyList_Append(members, (PyObject *)handle) < 0)
            return -1;
    }
    return 1;
}

/* items[2], [3], [6] of a step (prefill, decode, preemptions) from vLLM's IterationStats (0 without);
 * 0, or -1 with an exception set */
static int step_iteration(PyObject *iteration, int64_t first_tokens, PyObject **items) {
    if (iteration == Py_None) {
        items[2] = PyLong_FromLong(0);
        items[3] = PyLong_FromLong(0);
        items[6] = PyLong_FromLong(0);
        return items[2] && items[3] && items[6] ? 0 : -1;
    }
    if ((items[2] = PyObject_GetAttr(iteration, str_num_prompt_tokens)) == NULL)
        return -1;
    PyObject *generated = PyObject_GetAttr(iteration, str_num_generation_tokens);
    if (generated == NULL)
        return -1;
    long long produced = PyLong_AsLongLong(generated);
    Py_DECREF(generated);
    if (produced == -1 && PyErr_Occurred())
        return -1;
    /* max(0, generated − first tokens) */
    if ((items[3] = PyLong_FromLongLong(produced > first_tokens ? produced - first_tokens : 0)) == NULL)
        return -1;
    return (items[6] = PyObject_GetAttr(iteration, str_num_preempted_reqs)) == NULL ? -1 : 0;
}

/* items[4], [5] of a step: round(kv_cache_usage × KV_SCALE), KV_SCALE (0, 0 without a usage); 0, or -1
 * with an exception set */
static int step_kv(PyObject *scheduler_stats, PyObject **items) {
    PyObject *usage;
    if (PyObject_GetOptionalAttr(scheduler_stats, str_kv_cache_usage, &usage) < 0)
        return -1;
    if (usage == NULL || usage == Py_None) {
        Py_XDECREF(usage);
        items[4] = PyLong_FromLong(0);
        items[5] = PyLong_FromLong(0);
        return items[4] && items[5] ? 0 : -1;
    }
    PyObject *scaled = PyNumber_Multiply(usage, kv_scale);
    Py_DECREF(usage);
    items[4] = scaled ? PyObject_CallOneArg(builtin_round, scaled) : NULL;
    Py_XDECREF(scaled);
    if (items[4] == NULL)
        return -1;
    items[5] = Py_NewRef(kv_scale);
    return 0;
}

/* one output batch's StepStats by the formulas (module comment: `Batch.step`), handed to
 * observer.step(stats, members); its end_ts (ns), or -1 with an exception set */
static int64_t record_step(PyObject *observer, PyObject *members, PyObject *scheduler_stats, PyObject *iteration,
                           PyObject *end_s, int64_t floor_ts, int64_t first_tokens, PyObject *clock_ns) {
    int64_t end_ts;
    int timed = PyObject_IsTrue(end_s);
    if (timed < 0)
        return -1;
    if (timed) {
        double seconds = PyFloat_AsDouble(end_s);
        if (seconds == -1.0 && PyErr_Occurred())
            return -1;
        end_ts = (int64_t)(seconds * 1e9); /* int(seconds * 1e9), as `_mono_ts` */
    } else if ((end_ts = read_clock(clock_ns)) == -1) {
        return -1;
    }
    /* (start, end, prefill, decode, kv used, kv total, preemptions, queue); the first failure ends it */
    PyObject *items[8] = {NULL}, *stats = NULL;
    if ((items[0] = PyLong_FromLongLong(floor_ts ? floor_ts : end_ts)) == NULL ||
        (items[1] = PyLong_FromLongLong(end_ts)) == NULL || step_iteration(iteration, first_tokens, items) < 0 ||
        step_kv(scheduler_stats, items) < 0 ||
        PyObject_GetOptionalAttr(scheduler_stats, str_num_waiting_reqs, &items[7]) < 0 ||
        (items[7] == NULL && (items[7] = PyLong_FromLong(0)) == NULL) ||
        (stats = step_stats_type->tp_alloc(step_stats_type, 8)) == NULL) {
        for (int i = 0; i < 8; i++)
            Py_XDECREF(items[i]);
        return -1;
    }
    for (int i = 0; i < 8; i++)
        PyTuple_SET_ITEM(stats, i, items[i]); /* the references move into the record */
    PyObject *call[] = {observer, stats, members};
    PyObject *done = PyObject_VectorcallMethod(str_step, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(stats);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return end_ts;
}

/* output_taken(handle, output) (module comment); 0, or -1 with an exception set */
static int taken(PyObject *handle, PyObject *output) {
    if (!PyObject_TypeCheck(handle, timeline_type)) {
        PyErr_Format(PyExc_TypeError, "output_taken(): a request timeline expected, not %.100s", Py_TYPE(handle)->tp_name);
        return -1;
    }
    TimelineCore *timeline = (TimelineCore *)handle;
    if (!timeline->first_token_ts)
        return 0;
    int text = renders_text(output);
    if (text < 0)
        return -1;
    if (!text) {
        int finished = timeline->output_ready_ts ? 0 : attr_true(output, str_finished, 0);
        if (finished <= 0)
            return finished;
    }
    return timeline_output_ready(timeline, timeline->output_ready_ts ? 0 : timeline_tokens_handed(timeline));
}

static PyObject *output_taken(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "output_taken() takes 2 arguments (handle, output), %zd given", nargs);
        return NULL;
    }
    if (taken(args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Taking(awaitable, handle, on_error): awaits `awaitable`; the output it returns is `taken` by
 * `handle` before it is handed on */
typedef struct {
    PyObject_HEAD
    PyObject *inner; /* the awaitable's iterator (a coroutine is its own) */
    PyObject *handle;
    PyObject *on_error;
} Taking;

static PyTypeObject TakingType;

static PyObject *taking_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *awaitable, *handle, *on_error;
    if (!_PyArg_NoKeywords("Taking", kwargs) || !PyArg_UnpackTuple(args, "Taking", 3, 3, &awaitable, &handle, &on_error))
        return NULL;
    if (!PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError, "Taking(awaitable, handle, on_error): on_error must be callable");
        return NULL;
    }
    PyObject *inner = awaiting_iter(awaitable);
    if (inner == NULL)
        return NULL;
    Taking *self = (Taking *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(inner);
        return NULL;
    }
    self->inner = inner;
    self->handle = Py_NewRef(handle);
    self->on_error = Py_NewRef(on_error);
    return (PyObject *)self;
}

static int taking_traverse(Taking *self, visitproc visit, void *arg) {
    Py_VISIT(self->inner);
    Py_VISIT(self->handle);
    Py_VISIT(self->on_error);
    return 0;
}

static int taking_clear(Taking *self) {
    Py_CLEAR(self->inner);
    Py_CLEAR(self->handle);
    Py_CLEAR(self->on_error);
    return 0;
}

static void taking_dealloc(Taking *self) {
    PyObject_GC_UnTrack(self);
    taking_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the exception set, handed to on_error(exception) and cleared: it goes no further */
static void report(PyObject *on_error) {
    PyObject *type, *exc, *traceback;
    PyErr_Fetch(&type, &exc, &traceback);
    PyErr_NormalizeException(&type, &exc, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(exc, traceback);
    PyObject *logged = PyObject_CallOneArg(on_error, exc);
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(traceback);
    if (logged == NULL)
        PyErr_WriteUnraisable(on_error);
    Py_XDECREF(logged);
}

/* the awaitable returned `output`: taken by the handle; a failure goes to on_error, never on */
static void returned(Taking *self, PyObject *output) {
    if (self->handle != NULL && taken(self->handle, output) < 0)
        report(self->on_error);
}

static PySendResult taking_am_send(Taking *self, PyObject *arg, PyObject **result) {
    if (self->inner == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse an already awaited Taking");
        *result = NULL;
        return PYGEN_ERROR;
    }
    PySendResult status = PyIter_Send(self->inner, arg, result);
    if (status == PYGEN_RETURN)
        returned(self, *result);
    return status;
}

static PyObject *taking_iternext(Taking *self) {
    PyObject *result;
    PySendResult status = taking_am_send(self, Py_None, &result);
    return awaiting_call_result(status, result);
}

static PyObject *taking_send(Taking *self, PyObject *value) {
    PyObject *result;
    PySendResult status = taking_am_send(self, value, &result);
    return awaiting_call_result(status, result);
}

/* throw(...) into the awaitable: what it yields, or its return (taken), or its error */
static PyObject *taking_throw(Taking *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *result = awaiting_throw(self->inner, args, nargs), *value;
    if (result != NULL || !PyErr_ExceptionMatches(PyExc_StopIteration) || _PyGen_FetchStopIterationValue(&value) < 0)
        return result;
    returned(self, value);
    return awaiting_call_result(PYGEN_RETURN, value);
}

static PyObject *taking_close(Taking *self, PyObject *Py_UNUSED(ignored)) { return awaiting_close(self->inner); }

static PyObject *taking_await(Taking *self) { return Py_NewRef(self); }

static PyAsyncMethods taking_async = {
    .am_await = (unaryfunc)taking_await,
    .am_send = (sendfunc)taking_am_send,
};

static PyMethodDef taking_methods[] = {
    {"send", (PyCFunction)taking_send, METH_O, "send(value): into the awaitable."},
    {"throw", (PyCFunction)(void (*)(void))taking_throw, METH_FASTCALL, "throw(...): into the awaitable."},
    {"close", (PyCFunction)taking_close, METH_NOARGS, "close(): the awaitable."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TakingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.integrations.vllm._outputs.Taking",
    .tp_basicsize = sizeof(Taking),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Taking(awaitable, handle, on_error): awaits it; its output taken by the handle (module comment).",
    .tp_new = taking_new,
    .tp_dealloc = (destructor)taking_dealloc,
    .tp_traverse = (traverseproc)taking_traverse,
    .tp_clear = (inquiry)taking_clear,
    .tp_as_async = &taking_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)taking_iternext,
    .tp_methods = taking_methods,
};

/* CollectorHook(original, current, on_error, awaits): `RequestOutputCollector.get` (awaits true) or
 * `get_nowait` wrapped, as a method of the class (a method descriptor: `q.get()` calls it with no
 * bound method made). vLLM's `original` is called as it was; where `current` (a ContextVar) holds a
 * handle, `get`'s coroutine is returned inside a `Taking`, and `get_nowait`'s output is taken at once
 * (a failure to `on_error`, the output handed on). */
typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *current;
    PyObject *on_error;
    int awaits;
    vectorcallfunc vectorcall;
} CollectorHook;

static PyTypeObject CollectorHookType;

static PyObject *hook_call(CollectorHook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL || result == Py_None)
        return result;
    PyObject *handle;
    if (PyContextVar_Get(self->current, NULL, &handle) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    if (handle == NULL || handle == Py_None) {
        Py_XDECREF(handle);
        return result;
    }
    if (self->awaits) {
        Taking *taking = (Taking *)TakingType.tp_alloc(&TakingType, 0);
        if (taking != NULL) {
            taking->inner = result; /* vLLM's coroutine (an `async def`) */
            taking->handle = handle;
            taking->on_error = Py_NewRef(self->on_error);
            return (PyObject *)taking;
        }
        Py_DECREF(result);
        Py_DECREF(handle);
        return NULL;
    }
    if (taken(handle, result) < 0)
        report(self->on_error);
    Py_DECREF(handle);
    return result;
}

static PyObject *hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *original, *current, *on_error;
    int awaits;
    if (!_PyArg_NoKeywords("CollectorHook", kwargs) ||
        !PyArg_ParseTuple(args, "OOOp:CollectorHook", &original, &current, &on_error, &awaits))
        return NULL;
    if (!PyCallable_Check(original) || !PyContextVar_CheckExact(current) || !PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError, "CollectorHook(original: callable, current: ContextVar, on_error: callable, awaits)");
        return NULL;
    }
    CollectorHook *self = (CollectorHook *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->original = Py_NewRef(original);
    self->current = Py_NewRef(current);
    self->on_error = Py_NewRef(on_error);
    self->awaits = awaits;
    self->vectorcall = (vectorcallfunc)hook_call;
    return (PyObject *)self;
}

static int hook_traverse(CollectorHook *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->current);
    Py_VISIT(self->on_error);
    return 0;
}

static int hook_clear(CollectorHook *self) {
    Py_CLEAR(self->original);
    Py_CLEAR(self->current);
    Py_CLEAR(self->on_error);
    return 0;
}

static void hook_dealloc(CollectorHook *self) {
    PyObject_GC_UnTrack(self);
    hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *hook_get(PyObject *self, PyObject *obj, PyObject *Py_UNUSED(type)) {
    if (obj == NULL || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyMemberDef hook_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(CollectorHook, original), READONLY, "vLLM's method."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CollectorHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.integrations.vllm._outputs.CollectorHook",
    .tp_basicsize = sizeof(CollectorHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CollectorHook(original, current, on_error, awaits): vLLM's collector method wrapped (see above).",
    .tp_new = hook_new,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_traverse = (traverseproc)hook_traverse,
    .tp_clear = (inquiry)hook_clear,
    .tp_vectorcall_offset = offsetof(CollectorHook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = hook_get,
    .tp_members = hook_members,
};

/* Batch(open, observer, clock_ns): the output batch in hand and the engine step it makes (module
 * comment). The tracker's Python reads and writes the same state for what the C does not do (a first
 * sight, KV records, the sweep), through the members below. */
#define SWEEP_EVERY_STEPS 32 /* how often the tracker closes requests that vanished (aborts) */
typedef struct {
    PyObject_HEAD
    PyObject *open;         /* vLLM request id → its handle (the tracker's) */
    PyObject *members;      /* the step's handles so far, in the batches' order */
    PyObject *finished_now; /* finished in this step: its KV records come with the step */
    PyObject *observer;     /* the telemetry's step observer */
    PyObject *clock_ns;
    PyObject *end_s;     /* the EngineCore's stamp of the batch (s), None before one */
    PyObject *iteration; /* vLLM's IterationStats of the batch, None before one */
    PyObject *states;    /* the output processor's live requests, None before a batch */
    long long first_tokens, scheduled_ts, prev_end_ts, steps_seen;
    char idle;
} Batch;

static PyObject *batch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *open, *observer, *clock_ns;
    if (!_PyArg_NoKeywords("Batch", kwargs) || !PyArg_UnpackTuple(args, "Batch", 3, 3, &open, &observer, &clock_ns))
        return NULL;
    if (!PyDict_Check(open) || !PyCallable_Check(clock_ns)) {
        PyErr_SetString(PyExc_TypeError, "Batch(open: dict, observer, clock_ns: callable)");
        return NULL;
    }
    Batch *self = (Batch *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->open = Py_NewRef(open);
    self->observer = Py_NewRef(observer);
    self->clock_ns = Py_NewRef(clock_ns);
    self->end_s = Py_NewRef(Py_None);
    self->iteration = Py_NewRef(Py_None);
    self->states = Py_NewRef(Py_None);
    if ((self->members = PyList_New(0)) == NULL || (self->finished_now = PyDict_New()) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int batch_traverse(Batch *self, visitproc visit, void *arg) {
    Py_VISIT(self->open);
    Py_VISIT(self->members);
    Py_VISIT(self->finished_now);
    Py_VISIT(self->observer);
    Py_VISIT(self->clock_ns);
    Py_VISIT(self->end_s);
    Py_VISIT(self->iteration);
    Py_VISIT(self->states);
    return 0;
}

static int batch_clear(Batch *self) {
    Py_CLEAR(self->open);
    Py_CLEAR(self->members);
    Py_CLEAR(self->finished_now);
    Py_CLEAR(self->observer);
    Py_CLEAR(self->clock_ns);
    Py_CLEAR(self->end_s);
    Py_CLEAR(self->iteration);
    Py_CLEAR(self->states);
    return 0;
}

static void batch_dealloc(Batch *self) {
    PyObject_GC_UnTrack(self);
    batch_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* the batch noted (its stamp, stats, live requests); its triples, None for a first sight, [] when
 * idle; NULL with an exception set */
static PyObject *batch_note(Batch *self, PyObject *outputs, PyObject *end_s, PyObject *iteration, PyObject *states) {
    if (self->idle)
        return PyList_New(0);
    Py_SETREF(self->end_s, Py_NewRef(end_s));
    Py_SETREF(self->iteration, Py_NewRef(iteration));
    Py_XSETREF(self->states, Py_NewRef(states));
    return outputs_seen(outputs, self->open);
}

/* before(outputs, end_s, iteration_stats, states): the batch noted; its triples, or None for a first sight */
static PyObject *batch_before(Batch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "before() takes 4 arguments (outputs, end_s, iteration_stats, states), %zd given", nargs);
        return NULL;
    }
    return batch_note(self, args[0], args[1], args[2], args[3]);
}

/* after(seen, now): the triples' tokens stamped and their handles made members; False: nothing done */
static PyObject *batch_after(Batch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "after() takes 2 arguments (seen, now), %zd given", nargs);
        return NULL;
    }
    int64_t now = as_stamp(args[1]);
    if (now == -1)
        return NULL;
    int done = stamp_seen(args[0], now, self->members);
    return done < 0 ? NULL : PyBool_FromLong(done);
}

/* the batch's engine step recorded (module comment): 1 when the tracker's Python has work of the step
 * (KV records, a request finished in it, the sweep), 0 when not, -1 with an exception set */
static int batch_record(Batch *self, PyObject *scheduler_stats) {
    PyObject *kv;
    if (PyObject_GetOptionalAttr(scheduler_stats, str_kv_connector_stats, &kv) < 0)
        return -1;
    int due = (kv != NULL && kv != Py_None) || PyDict_GET_SIZE(self->finished_now) > 0;
    Py_XDECREF(kv);
    PyObject *members = PyList_New(0), *end_s = self->end_s, *iteration = self->iteration;
    if (members == NULL)
        return -1;
    /* the step's state moves out here, before any call that could fail: the next step starts clean */
    PyObject *taken = self->members;
    self->members = members;
    self->end_s = Py_NewRef(Py_None);
    self->iteration = Py_NewRef(Py_None);
    long long first_tokens = self->first_tokens;
    self->first_tokens = 0;
    due |= ++self->steps_seen % SWEEP_EVERY_STEPS == 0;
    int64_t end_ts = 0;
    if (PyList_GET_SIZE(taken) && !self->idle) {
        int64_t floor_ts = self->prev_end_ts > self->scheduled_ts ? self->prev_end_ts : self->scheduled_ts;
        end_ts = record_step(self->observer, taken, scheduler_stats, iteration, end_s, floor_ts, first_tokens, self->clock_ns);
        if (end_ts != -1) {
            self->prev_end_ts = end_ts;
            self->scheduled_ts = 0;
        }
    }
    Py_DECREF(taken);
    Py_DECREF(end_s);
    Py_DECREF(iteration);
    return end_ts == -1 ? -1 : due;
}

/* step(scheduler_stats): the batch's engine step recorded; True when the tracker's Python has work of it */
static PyObject *batch_step(Batch *self, PyObject *scheduler_stats) {
    int due = batch_record(self, scheduler_stats);
    return due < 0 ? NULL : PyBool_FromLong(due);
}

static PyMethodDef batch_methods[] = {
    {"before", (PyCFunction)(void (*)(void))batch_before, METH_FASTCALL,
     "before(outputs, end_s, iteration_stats, states): the batch's triples, or None (module comment)."},
    {"after", (PyCFunction)(void (*)(void))batch_after, METH_FASTCALL,
     "after(seen, now): the batch's token stamps; False for a first sight (module comment)."},
    {"step", (PyCFunction)batch_step, METH_O,
     "step(scheduler_stats): the engine step recorded; True when the tracker has work of it (module comment)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef batch_members[] = {
    {"open", T_OBJECT, offsetof(Batch, open), READONLY, "vLLM request id → its open handle."},
    {"members", T_OBJECT, offsetof(Batch, members), READONLY, "The step's handles so far."},
    {"finished_now", T_OBJECT, offsetof(Batch, finished_now), READONLY, "Finished in this step: id → handle."},
    {"states", T_OBJECT, offsetof(Batch, states), 0, "The output processor's live requests (None before one is seen)."},
    {"first_tokens", T_LONGLONG, offsetof(Batch, first_tokens), 0, "First tokens in this step."},
    {"scheduled_ts", T_LONGLONG, offsetof(Batch, scheduled_ts), 0, "Latest first scheduling of a request new in it (ns)."},
    {"prev_end_ts", T_LONGLONG, offsetof(Batch, prev_end_ts), READONLY, "The previous step's end (ns)."},
    {"steps_seen", T_LONGLONG, offsetof(Batch, steps_seen), READONLY, "Steps so far."},
    {"idle", T_BOOL, offsetof(Batch, idle), 0, "Nothing recorded: the tracker stopped."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.integrations.vllm._outputs.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Batch(open, observer, clock_ns): the output batch in hand and its engine step (module comment).",
    .tp_new = batch_new,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_traverse = (traverseproc)batch_traverse,
    .tp_clear = (inquiry)batch_clear,
    .tp_methods = batch_methods,
    .tp_members = batch_members,
};

/* BatchHook(kind, original, namespace, untraced, on_error): `OutputProcessor.process_outputs` (kind
 * OUTPUTS_HOOK) or `update_scheduler_stats` (STATS_HOOK) wrapped, as a method descriptor of the class
 * (as CollectorHook): vLLM's `original` is called as it was, and around it, where the processor
 * traces (`tracing_enabled`), the tracker's batch is noted and stamped, or its step recorded, in C:
 * no frame of ours per output batch. The tracker is `namespace["tracker"]()` at each call (the
 * hooks module's `tracker`, looked up as its own functions look it up). The tracker's Python is
 * called only for what the batch leaves to it (`first_sights`, `after_first_sights`, `step_work`); a
 * processor that does not trace calls `untraced()` (the plugin's one warning). A failure in
 * phaselens's part goes to `on_error(exception)` and never to vLLM. */
enum { OUTPUTS_HOOK, STATS_HOOK };
static PyObject *str_tracing_enabled, *str_request_states, *str_batch, *str_first_sights, *str_after_first_sights,
    *str_step_work, *str_engine_core_timestamp, *str_iteration_stats, *str_scheduler_stats, *str_tracker;

typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *namespace; /* the hooks module's dict: its `tracker()` is the process's tracker */
    PyObject *untraced;
    PyObject *on_error;
    vectorcallfunc vectorcall; /* the kind's: outputs_hook_call or stats_hook_call */
} BatchHook;

/* the tracker and its batch (new references: the tracker's Python may replace its batch meanwhile);
 * NULL with an exception set */
static PyObject *hook_tracker(BatchHook *self, Batch **batch) {
    PyObject *tracker_of = PyDict_GetItemWithError(self->namespace, str_tracker);
    if (tracker_of == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_LookupError, "BatchHook: the namespace has no tracker");
        return NULL;
    }
    PyObject *tracker = PyObject_CallNoArgs(tracker_of);
    PyObject *found = tracker ? PyObject_GetAttr(tracker, str_batch) : NULL;
    if (found != NULL && !PyObject_TypeCheck(found, &BatchType)) {
        PyErr_SetString(PyExc_TypeError, "BatchHook: the tracker's batch is not a Batch");
        Py_CLEAR(found);
    }
    if (found == NULL) {
        Py_XDECREF(tracker);
        return NULL;
    }
    *batch = (Batch *)found;
    return tracker;
}

/* the call's argument at `index` or by keyword `name`; None without (borrowed) */
static PyObject *call_arg(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t index, PyObject *name) {
    if (index < nargs)
        return args[index];
    Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < keywords; i++)
        if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), name) == 0)
            return args[nargs + i];
    return Py_None;
}

/* before vLLM's process_outputs: the batch's triples (a new reference), or NULL (nothing to stamp;
 * a failure reported) */
static PyObject *outputs_noted(BatchHook *self, PyObject *tracker, Batch *batch, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    PyObject *outputs = args[1], *seen = NULL;
    PyObject *states = PyObject_GetAttr(args[0], str_request_states);
    if (states != NULL) {
        seen = batch_note(batch, outputs, call_arg(args, nargs, kwnames, 2, str_engine_core_timestamp),
                          call_arg(args, nargs, kwnames, 3, str_iteration_stats), states);
        Py_DECREF(states);
    }
    if (seen == Py_None) { /* a request seen for the first time: the tracker opens it */
        Py_DECREF(seen);
        seen = PyObject_CallMethodOneArg(tracker, str_first_sights, outputs);
    }
    if (seen == NULL)
        report(self->on_error);
    return seen;
}

/* after it: the triples' tokens stamped now (the tracker's Python for a first sight's) */
static void outputs_stamped(BatchHook *self, PyObject *tracker, Batch *batch, PyObject *seen) {
    int64_t now = read_clock(batch->clock_ns);
    int done = now == -1 ? -1 : stamp_seen(seen, now, batch->members);
    if (done == 0) {
        PyObject *stamp = PyLong_FromLongLong(now), *called = NULL;
        if (stamp != NULL) {
            PyObject *call[] = {tracker, seen, stamp};
            called = PyObject_VectorcallMethod(str_after_first_sights, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
            Py_DECREF(stamp);
        }
        done = called == NULL ? -1 : 1;
        Py_XDECREF(called);
    }
    if (done < 0)
        report(self->on_error);
}

/* `untraced()`, its failure reported */
static void notify(PyObject *untraced) {
    PyObject *done = PyObject_CallNoArgs(untraced);
    if (done == NULL)
        PyErr_WriteUnraisable(untraced);
    Py_XDECREF(done);
}

static PyObject *outputs_hook_call(BatchHook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    int tracing = nargs >= 2 ? attr_true(args[0], str_tracing_enabled, 0) : 0; /* fewer: vLLM's own raises */
    if (tracing < 0)
        return NULL;
    if (!tracing && nargs >= 2)
        notify(self->untraced);
    Batch *batch = NULL;
    PyObject *tracker = tracing ? hook_tracker(self, &batch) : NULL, *seen = NULL;
    if (tracing && tracker == NULL)
        report(self->on_error);
    if (tracker != NULL)
        seen = outputs_noted(self, tracker, batch, args, nargs, kwnames);
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result != NULL && seen != NULL && PyList_Check(seen) && PyList_GET_SIZE(seen) > 0)
        outputs_stamped(self, tracker, batch, seen);
    Py_XDECREF(seen);
    Py_XDECREF(batch);
    Py_XDECREF(tracker);
    return result;
}

static PyObject *stats_hook_call(BatchHook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *result = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (result == NULL || nargs < 1)
        return result;
    int tracing = attr_true(args[0], str_tracing_enabled, 0);
    if (tracing <= 0) {
        if (tracing < 0)
            Py_CLEAR(result);
        return result;
    }
    Batch *batch = NULL;
    PyObject *tracker = hook_tracker(self, &batch), *stats = call_arg(args, nargs, kwnames, 1, str_scheduler_stats);
    int due = tracker ? batch_record(batch, stats) : -1;
    if (due < 0) {
        report(self->on_error);
        due = tracker != NULL; /* the step's KV records and finished requests still go on */
    }
    if (due) {
        PyObject *done = PyObject_CallMethodOneArg(tracker, str_step_work, stats);
        if (done == NULL)
            report(self->on_error);
        Py_XDECREF(done);
    }
    Py_XDECREF(batch);
    Py_XDECREF(tracker);
    return result;
}

static PyObject *batch_hook_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *original, *namespace, *untraced, *on_error;
    int kind;
    if (!_PyArg_NoKeywords("BatchHook", kwargs) ||
        !PyArg_ParseTuple(args, "iOOOO:BatchHook", &kind, &original, &namespace, &untraced, &on_error))
        return NULL;
    if ((kind != OUTPUTS_HOOK && kind != STATS_HOOK) || !PyCallable_Check(original) || !PyDict_Check(namespace) ||
        !PyCallable_Check(untraced) || !PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError,
                        "BatchHook(kind: OUTPUTS_HOOK or STATS_HOOK, original, namespace: dict, untraced, on_error)");
        return NULL;
    }
    BatchHook *self = (BatchHook *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->original = Py_NewRef(original);
    self->namespace = Py_NewRef(namespace);
    self->untraced = Py_NewRef(untraced);
    self->on_error = Py_NewRef(on_error);
    self->vectorcall = (vectorcallfunc)(kind == OUTPUTS_HOOK ? outputs_hook_call : stats_hook_call);
    return (PyObject *)self;
}

static int batch_hook_traverse(BatchHook *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->namespace);
    Py_VISIT(self->untraced);
    Py_VISIT(self->on_error);
    return 0;
}

static int batch_hook_clear(BatchHook *self) {
    Py_CLEAR(self->original);
    Py_CLEAR(self->namespace);
    Py_CLEAR(self->untraced);
    Py_CLEAR(self->on_error);
    return 0;
}

static void batch_hook_dealloc(BatchHook *self) {
    PyObject_GC_UnTrack(self);
    batch_hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef batch_hook_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(BatchHook, original), READONLY, "vLLM's method."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject BatchHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "phaselens.integrations.vllm._outputs.BatchHook",
    .tp_basicsize = sizeof(BatchHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "BatchHook(kind, original, namespace, untraced, on_error): vLLM's output processor method wrapped (see above).",
    .tp_new = batch_hook_new,
    .tp_dealloc = (destructor)batch_hook_dealloc,
    .tp_traverse = (traverseproc)batch_hook_traverse,
    .tp_clear = (inquiry)batch_hook_clear,
    .tp_vectorcall_offset = offsetof(BatchHook, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = hook_get,
    .tp_members = batch_hook_members,
};

static PyMethodDef module_methods[] = {
    {"output_taken", (PyCFunction)(void (*)(void))output_taken, METH_FASTCALL,
     "output_taken(handle, output): the request's task took output (module comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef taken_module = {
    PyModuleDef_HEAD_INIT, "_outputs", "vLLM's outputs on the API server's event loop: a batch's token stamps, the task's take.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__outputs(void) {
    struct {
        PyObject **name;
        const char *text;
    } names[] = {
        {&str_outputs, "outputs"}, {&str_text, "text"}, {&str_finished, "finished"},
        {&str_num_prompt_tokens, "num_prompt_tokens"}, {&str_num_generation_tokens, "num_generation_tokens"},
        {&str_num_preempted_reqs, "num_preempted_reqs"}, {&str_kv_cache_usage, "kv_cache_usage"},
        {&str_num_waiting_reqs, "num_waiting_reqs"}, {&str_step, "step"},
        {&str_request_id, "request_id"}, {&str_new_token_ids, "new_token_ids"},
        {&str_kv_connector_stats, "kv_connector_stats"}, {&str_tracing_enabled, "tracing_enabled"},
        {&str_request_states, "request_states"}, {&str_batch, "batch"}, {&str_first_sights, "first_sights"},
        {&str_after_first_sights, "after_first_sights"}, {&str_step_work, "step_work"},
        {&str_engine_core_timestamp, "engine_core_timestamp"}, {&str_iteration_stats, "iteration_stats"},
        {&str_scheduler_stats, "scheduler_stats"}, {&str_tracker, "tracker"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].name = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    if ((timeline_type = timeline_import()) == NULL || PyType_Ready(&TakingType) < 0 ||
        PyType_Ready(&CollectorHookType) < 0 || PyType_Ready(&BatchType) < 0 || PyType_Ready(&BatchHookType) < 0 || (kv_scale = PyLong_FromLong(KV_SCALE)) == NULL)
        return NULL;
    PyObject *builtins = PyImport_ImportModule("builtins");
    builtin_round = builtins ? PyObject_GetAttrString(builtins, "round") : NULL;
    Py_XDECREF(builtins);
    PyObject *records = builtin_round ? PyImport_ImportModule("phaselens.instrumentation.hotpath.records") : NULL;
    step_stats_type = records ? (PyTypeObject *)PyObject_GetAttrString(records, "StepStats") : NULL;
    Py_XDECREF(records);
    if (step_stats_type == NULL)
        return NULL;
    if (!PyType_Check(step_stats_type) || !PyType_IsSubtype(step_stats_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "records.StepStats is not a tuple type");
        return NULL;
    }
    PyObject *module = PyModule_Create(&taken_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Taking", (PyObject *)&TakingType) < 0 ||
        PyModule_AddObjectRef(module, "CollectorHook", (PyObject *)&CollectorHookType) < 0 ||
        PyModule_AddObjectRef(module, "Batch", (PyObject *)&BatchType) < 0 ||
        PyModule_AddObjectRef(module, "BatchHook", (PyObject *)&BatchHookType) < 0 ||
        PyModule_AddIntConstant(module, "OUTPUTS_HOOK", OUTPUTS_HOOK) < 0 ||
        PyModule_AddIntConstant(module, "STATS_HOOK", STATS_HOOK) < 0 ||
        PyModule_AddIntConstant(module, "SWEEP_EVERY_STEPS", SWEEP_EVERY_STEPS) < 0 ||
        PyModule_AddIntConstant(module, "KV_SCALE", KV_SCALE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
