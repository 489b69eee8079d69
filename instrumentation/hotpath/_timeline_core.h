/* The C layout of `_stamps.TimelineCore` (a request timeline's C base: `timeline.RequestTimeline`,
 * `handle.ServerRequest`) and its writers, shared by the C modules that stamp a request's handle on
 * the event loop without a Python call: `_stamps.c` defines the type, the others (the vLLM plugin's
 * `_outputs.c`, the ingress middleware's `_send_guard.c`) check an object against it
 * (`timeline_import`) and write its struct through these functions.
 */
#ifndef PHASELENS_TIMELINE_CORE_H
#define PHASELENS_TIMELINE_CORE_H

#include <Python.h>
#include <stdint.h>
#include <time.h>

#define LINK_BYTES 25      /* records.LINK: trace id (high, low), span id, trace flags */
#define FIRST_SENDS_MAX 32 /* names.FIRST_SENDS_MAX (tests/test_stamps.py holds them equal) */

typedef struct {
    PyObject_HEAD
    int64_t *tokens;      /* (stamp, count) pairs */
    Py_ssize_t size;      /* pairs stored */
    Py_ssize_t allocated; /* pairs room */
    PyObject *clock_ns;   /* never NULL */
    int64_t first_token_ts, output_ready_ts, first_chunk_ts, first_chunk_sent_ts, last_chunk_ts;
    int64_t visible_tokens, body_bytes;
    int64_t sends[2 * FIRST_SENDS_MAX]; /* (stamp, body bytes through it) pairs */
    Py_ssize_t sends_size;              /* int64s stored */
    char output_pending;                /* output_ready() was called; the next body chunk carries it */
    unsigned char linked; /* link holds this request's SERVER span ids (sampled and ours) */
    unsigned char link[LINK_BYTES];
} TimelineCore;


static PyObject *monotonic_ns; /* time.monotonic_ns, fetched at each module's import */

/* the int as a non-negative int64; -1 with an exception set when it is not one */
static inline int64_t as_stamp(PyObject *value) {
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
static inline int64_t read_clock(PyObject *clock_ns) {
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

#define INITIAL_PAIRS 16 /* a request's first 16 decode steps without a realloc */

/* append the token pair (t, n); 0, or -1 with an exception set when there is no room */
static inline int timeline_append(TimelineCore *self, int64_t t, int64_t n) {
    if (self->size == self->allocated) {
        Py_ssize_t allocated = self->allocated ? 2 * self->allocated : INITIAL_PAIRS;
        int64_t *tokens = allocated > PY_SSIZE_T_MAX / (Py_ssize_t)(2 * sizeof(int64_t))
                              ? NULL
                              : PyMem_Realloc(self->tokens, (size_t)allocated * 2 * sizeof(int64_t));
        if (tokens == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->tokens = tokens;
        self->allocated = allocated;
    }
    int64_t *pair = self->tokens + 2 * self->size++;
    pair[0] = t;
    pair[1] = n;
    return 0;
}

/* output_ready: the first call stamps output_ready_ts and visible_tokens = `tokens`, every call
 * marks the next body chunk as carrying output; 0, or -1 with an exception set (nothing stored) */
static inline int timeline_output_ready(TimelineCore *self, int64_t tokens) {
    if (!self->output_ready_ts) {
        int64_t t = read_clock(self->clock_ns);
        if (t == -1)
            return -1;
        self->output_ready_ts = t;
        self->visible_tokens = tokens;
    }
    self->output_pending = 1;
    return 0;
}

/* body_sending: `nbytes` of response body handed to `send`, a chunk carrying output when `carries`
 * (first_chunk / last_chunk stamped, one clock read); from the first content chunk on, the first
 * FIRST_SENDS_MAX non-empty ones are stamped with the body bytes through them; 0, or -1 with an
 * exception set (nothing stored) */
static inline int timeline_body_sending(TimelineCore *self, int64_t nbytes, int carries) {
    int64_t t = 0;
    if (carries) {
        if ((t = read_clock(self->clock_ns)) == -1)
            return -1;
        if (!self->first_chunk_ts)
            self->first_chunk_ts = t;
        self->last_chunk_ts = t;
    }
    int stamped = nbytes && self->first_chunk_ts && self->sends_size < 2 * FIRST_SENDS_MAX;
    if (stamped && !t && (t = read_clock(self->clock_ns)) == -1)
        return -1;
    self->body_bytes += nbytes;
    if (stamped) {
        self->sends[self->sends_size++] = t;
        self->sends[self->sends_size++] = self->body_bytes;
    }
    return 0;
}

/* 1 + the tokens of the timeline's token stamps: the tokens handed to the stream so far */
static inline int64_t timeline_tokens_handed(const TimelineCore *self) {
    int64_t total = 1;
    for (Py_ssize_t i = 0; i < self->size; i++)
        total += self->tokens[2 * i + 1];
    return total;
}

/* for a module other than `_stamps`: the TimelineCore type (a new reference) and time.monotonic_ns;
 * NULL with an exception set */
static inline PyTypeObject *timeline_import(void) {
    PyObject *time_module = PyImport_ImportModule("time");
    if (time_module == NULL)
        return NULL;
    monotonic_ns = PyObject_GetAttrString(time_module, "monotonic_ns"); /* kept for the process */
    Py_DECREF(time_module);
    PyObject *stamps = monotonic_ns ? PyImport_ImportModule("phaselens.instrumentation.hotpath._stamps") : NULL;
    if (stamps == NULL)
        return NULL;
    PyObject *type = PyObject_GetAttrString(stamps, "TimelineCore");
    Py_DECREF(stamps);
    if (type != NULL && !PyType_Check(type)) {
        Py_DECREF(type);
        PyErr_SetString(PyExc_TypeError, "_stamps.TimelineCore is not a type");
        return NULL;
    }
    return (PyTypeObject *)type;
}

#endif
