/* Span descriptions (`span_data.SpanData`) -> OTLP protobuf bytes, as the SDK's exporter writes them.
 *
 * Why C: the SDK path makes a ReadableSpan per span, an SDK Link per engine-step link and then a
 * protobuf object tree per span, ~90 us a span in all; here a description is read once and written
 * once (~1 us). The bytes are those of `opentelemetry.exporter.otlp.proto.common.trace_encoder`
 * (fields in number order, the same presence rules), so a request made here and one made by the
 * SDK from the same spans decode to the same message, field by field (tests/test_otlp_fast.py).
 *
 * encode_spans(spans, limits) -> list[bytes]: one `ScopeSpans.spans` entry (tag, length, Span) per
 *   description, so a batch is their concatenation. `limits` are the SDK's SpanLimits as ints (-1:
 *   none): (span attributes, span attribute length, events, links, event attributes, link
 *   attributes, event/link attribute length), applied as the SDK applies them: the last N
 *   attributes, events and links are kept, the rest counted in the dropped_*_count fields, and
 *   strings (also inside arrays and maps) cut to the length in characters.
 * encode_step(step, trace_id, span_id, start_ns, end_ns, name, keys, limits) -> bytes: one entry as
 *   encode_spans makes it, for an engine step's span straight from its `spans.PackedStep`.
 * encode_steps(steps, random_bits, new_ids, offset_ns, name, keys, limits) -> list[bytes]: those
 *   entries for a run of steps (the ones with a sampled member), ids drawn for all in one call.
 * encode_root(record, phases, offset_ns, texts, summary, keys, constants, limits) -> bytes: one entry as
 *   encode_spans makes it, for a request's SERVER span straight from its record and `Phases`.
 * encode_request(resource_attributes, scope_name, scope_version, spans) -> bytes: an
 *   ExportTraceServiceRequest holding one ResourceSpans with one ScopeSpans of `spans` (entries
 *   from encode_spans).
 * present(keys, values[, into]) -> dict: the pairs of two tuples of one length whose value is not
 *   None, in order, added to `into` (returned) or to a new dict: the SERVER span's ~40 attributes,
 *   ~2k instructions where the dict comprehension over zip() took ~20k.
 *
 * Attribute values: str, bool, int (int64), float, bytes, None, and lists, tuples and dicts of
 * those, with no per-key code: a new attribute needs nothing here. A value the SDK's encoder cannot
 * write either (an int outside int64, a str that is not valid UTF-8) is left out as it leaves it
 * out; another type is a TypeError (the builder counts the record in build_errors).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h> /* T_OBJECT_EX: a __slots__ member */
#include <string.h>

enum { VARINT = 0, I64 = 1, LEN = 2, I32 = 5 };
#define FLAGS_HAS_IS_REMOTE 0x100u
#define FLAGS_IS_REMOTE 0x200u
#define PACKED_LINK 25 /* records.LINK.size */
#define SKIP 2 /* a value the SDK's encoder leaves out: its key-value pair is rolled back (errors: -1 or 1) */

/* Output starts in `stack` (a span, a step's 64 links included, fits): no allocation per call; past
 * it, on the heap. Initialised by buf_init, released by buf_free; never copied. */
typedef struct {
    uint8_t *data;
    size_t len, cap;
    uint8_t stack[8192];
} Buf;

static void buf_init(Buf *b) {
    b->data = b->stack;
    b->len = 0;
    b->cap = sizeof b->stack;
}

static void buf_free(Buf *b) {
    if (b->data != b->stack)
        PyMem_Free(b->data);
}

typedef struct {
    Py_ssize_t attributes, attribute_length, events, links, event_attributes, link_attributes, other_length;
} Limits;

static __attribute__((noinline)) int grow(Buf *b, size_t extra) {
    size_t cap = b->cap;
    while (cap < b->len + extra)
        cap *= 2;
    uint8_t *data = b->data == b->stack ? PyMem_Malloc(cap) : PyMem_Realloc(b->data, cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    if (b->data == b->stack)
        memcpy(data, b->stack, b->len);
    b->data = data;
    b->cap = cap;
    return 0;
}

static inline int reserve(Buf *b, size_t extra) { return b->len + extra <= b->cap ? 0 : grow(b, extra); }

static int put(Buf *b, const void *p, size_t n) {
    if (reserve(b, n))
        return -1;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

static inline size_t varint_len(uint64_t v) { return (size_t)(64 - __builtin_clzll(v | 1) + 6) / 7; }

/* Writes v at p (room for 10 bytes reserved); returns the byte after it. */
static inline uint8_t *write_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

static inline uint8_t *write_le(uint8_t *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++)
        *p++ = (uint8_t)(v >> (8 * i));
    return p;
}

static inline int put_varint(Buf *b, uint64_t v) {
    if (reserve(b, 10))
        return -1;
    b->len = (size_t)(write_varint(b->data + b->len, v) - b->data);
    return 0;
}

static int put_tag(Buf *b, uint32_t field, int wire) { return put_varint(b, ((uint64_t)field << 3) | (uint64_t)wire); }

static int put_fixed(Buf *b, uint32_t field, uint64_t v, int bytes) {
    if (reserve(b, 5 + 8))
        return -1;
    uint8_t *p = write_varint(b->data + b->len, ((uint64_t)field << 3) | (uint64_t)(bytes == 8 ? I64 : I32));
    b->len = (size_t)(write_le(p, v, bytes) - b->data);
    return 0;
}

static int put_bytes(Buf *b, uint32_t field, const void *p, size_t n) {
    if (reserve(b, 15 + n))
        return -1;
    uint8_t *o = write_varint(write_varint(b->data + b->len, ((uint64_t)field << 3) | LEN), n);
    memcpy(o, p, n);
    b->len = (size_t)(o + n - b->data);
    return 0;
}

/* A length-delimited submessage: open() writes the tag and reserves one length byte; close() writes
 * the body's length, moving the body when it needs more than one byte (upb writes minimal varints). */
static int open_message(Buf *b, uint32_t field, size_t *mark) {
    if (put_tag(b, field, LEN) || reserve(b, 1))
        return -1;
    *mark = b->len++;
    return 0;
}

static int close_message(Buf *b, size_t mark) {
    size_t body = b->len - mark - 1, extra = varint_len(body) - 1;
    if (extra) {
        if (reserve(b, extra))
            return -1;
        memmove(b->data + mark + 1 + extra, b->data + mark + 1, body);
        b->len += extra;
    }
    write_varint(b->data + mark, body);
    return 0;
}

/* A str as UTF-8, cut to `limit` characters (-1: whole); SKIP when it has no UTF-8 form. `*owner`
 * holds a cut copy, to be released by the caller. */
static int utf8_of(PyObject *s, Py_ssize_t limit, const char **p, Py_ssize_t *n, PyObject **owner) {
    *owner = NULL;
    if (limit >= 0 && PyUnicode_GetLength(s) > limit) {
        *owner = PyUnicode_Substring(s, 0, limit);
        if (!*owner)
            return -1;
        s = *owner;
    }
    *p = PyUnicode_AsUTF8AndSize(s, n);
    if (!*p) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError))
            return -1;
        PyErr_Clear();
        Py_CLEAR(*owner);
        return SKIP;
    }
    return 0;
}

static int put_str(Buf *b, uint32_t field, PyObject *s, Py_ssize_t limit, int omit_empty) {
    const char *p;
    Py_ssize_t n;
    PyObject *owner;
    int r = utf8_of(s, limit, &p, &n, &owner);
    if (r)
        return r;
    r = (n == 0 && omit_empty) ? 0 : put_bytes(b, field, p, (size_t)n);
    Py_XDECREF(owner);
    return r;
}

static int put_str_field(Buf *b, uint32_t field, PyObject *s, const char *what) {
    if (s == Py_None)
        return 0;
    if (!PyUnicode_Check(s)) {
        PyErr_Format(PyExc_TypeError, "%s: expected str, got %.80s", what, Py_TYPE(s)->tp_name);
        return -1;
    }
    int r = put_str(b, field, s, -1, 1);
    if (r == SKIP)
        PyErr_Format(PyExc_ValueError, "%s: not encodable as UTF-8", what);
    return r ? -1 : 0;
}

/* An unsigned id of `bytes` bytes into `be`, big-endian, as int.to_bytes(bytes, "big") writes it
 * (a span id range-checked, then masked from its digits: not through the byte-array conversion that
 * PyLong_AsUnsignedLongLong takes for its 3 digits). */
static int id_of(PyObject *v, int bytes, uint8_t *be, const char *what) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "%s: expected int", what);
        return -1;
    }
    int bad;
    if (bytes == 8) {
        /* checked, then masked: AsUnsignedLongLong takes an id's 3 digits through _PyLong_AsByteArray */
        bad = _PyLong_Sign(v) < 0 || _PyLong_NumBits(v) > 64;
        uint64_t x = bad ? 0 : PyLong_AsUnsignedLongLongMask(v);
        for (int i = 0; i < 8; i++)
            be[i] = (uint8_t)(x >> (56 - 8 * i));
    } else {
#if PY_VERSION_HEX >= 0x030D0000
        Py_ssize_t need = PyLong_AsNativeBytes(v, be, bytes, Py_ASNATIVEBYTES_BIG_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER |
                                                             Py_ASNATIVEBYTES_REJECT_NEGATIVE);
        bad = need < 0 || need > bytes;
#else
        bad = _PyLong_AsByteArray((PyLongObject *)v, be, (size_t)bytes, 0, 0) < 0;
#endif
    }
    if (bad) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: not an unsigned %d-bit int", what, 8 * bytes);
        return -1;
    }
    return 0;
}

static int put_id(Buf *b, uint32_t field, PyObject *v, int bytes, const char *what) {
    uint8_t be[16];
    return id_of(v, bytes, be, what) || put_bytes(b, field, be, (size_t)bytes);
}

/* A ScopeSpans.spans entry (field 2) is written as its Span after ENTRY_HEAD free bytes, its tag and
 * length then put just before it: no body moved for a length of two or more bytes (close_message). */
#define ENTRY_HEAD 6

static void begin_entry(Buf *b) { b->len = ENTRY_HEAD; /* b->cap >= sizeof b->stack */ }

static PyObject *entry_bytes(Buf *b) {
    size_t body = b->len - ENTRY_HEAD, head = 1 + varint_len(body);
    if (head > ENTRY_HEAD) {
        PyErr_SetString(PyExc_OverflowError, "span: over 2**35 bytes");
        return NULL;
    }
    uint8_t *start = b->data + ENTRY_HEAD - head;
    *start = 2 << 3 | LEN;
    write_varint(start + 1, body);
    return PyBytes_FromStringAndSize((const char *)start, (Py_ssize_t)(b->len + head - ENTRY_HEAD));
}

/* An empty Status (field 15) and flags (field 16, fixed32): has-is-remote, a local parent. */
static const uint8_t LOCAL_SPAN_TAIL[8] = {15 << 3 | LEN, 0, (16 << 3 | I32) | 0x80, 1, FLAGS_HAS_IS_REMOTE & 0xFF,
                                           FLAGS_HAS_IS_REMOTE >> 8, 0, 0};

static int u64_of(PyObject *v, uint64_t *out, const char *what) {
    *out = PyLong_Check(v) ? PyLong_AsUnsignedLongLong(v) : (uint64_t)-1;
    if (*out == (uint64_t)-1 && (PyErr_Occurred() || !PyLong_Check(v))) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected an int in [0, 2**64)", what);
        return -1;
    }
    return 0;
}

/* ---------- attributes ---------- */

/* A scalar attribute value known in C: an int64, a double or a bool (AnyValue fields 3, 4, 2). */
typedef struct {
    enum { V_INT, V_DOUBLE, V_BOOL } type;
    long long i; /* V_INT, V_BOOL */
    double d;    /* V_DOUBLE */
} Scalar;

/* A KeyValue (as entry `field`) of a str key and a scalar, its lengths known up front (the bytes of
 * the generic path below at ~1/3 of its instructions); SKIP when the key has no UTF-8 form. */
static int put_scalar_key_value(Buf *b, uint32_t field, PyObject *key, const Scalar *v);

/* put_scalar_key_value of a key given as UTF-8. */
static int put_scalar_utf8(Buf *b, uint32_t field, const char *p, Py_ssize_t n, const Scalar *v) {
    size_t any = v->type == V_DOUBLE ? 9 : 1 + varint_len((uint64_t)v->i);
    size_t kv = (n ? 1 + varint_len((size_t)n) + (size_t)n : 0) + 1 + varint_len(any) + any;
    if (reserve(b, 15 + kv)) /* written in place: one reservation, no call per field */
        return -1;
    uint8_t *o = write_varint(write_varint(b->data + b->len, ((uint64_t)field << 3) | LEN), kv);
    if (n) {
        *o++ = 1 << 3 | LEN;
        o = write_varint(o, (uint64_t)n);
        memcpy(o, p, (size_t)n);
        o += n;
    }
    *o++ = 2 << 3 | LEN;
    *o++ = (uint8_t)any; /* at most 11 */
    if (v->type == V_DOUBLE) {
        uint64_t bits;
        memcpy(&bits, &v->d, 8);
        *o++ = 4 << 3 | I64;
        o = write_le(o, bits, 8);
    } else {
        *o++ = (uint8_t)((v->type == V_INT ? 3 : 2) << 3 | VARINT);
        o = write_varint(o, (uint64_t)v->i);
    }
    b->len = (size_t)(o - b->data);
    return 0;
}

static int put_scalar_key_value(Buf *b, uint32_t field, PyObject *key, const Scalar *v) {
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(key, &n);
    if (!p) {
        PyErr_Clear();
        return SKIP;
    }
    return put_scalar_utf8(b, field, p, n, v);
}

/* An int64, float or bool value as a Scalar; 0 for any other value (an int past int64 too). */
static int scalar_of(PyObject *value, Scalar *v) {
    if (PyBool_Check(value)) {
        *v = (Scalar){V_BOOL, value == Py_True, 0};
        return 1;
    }
    if (PyFloat_Check(value)) {
        *v = (Scalar){V_DOUBLE, 0, PyFloat_AS_DOUBLE(value)};
        return 1;
    }
    if (!PyLong_Check(value))
        return 0;
    int overflow;
    *v = (Scalar){V_INT, PyLong_AsLongLongAndOverflow(value, &overflow), 0};
    if (overflow || (v->i == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}


static int put_key_value(Buf *b, uint32_t field, PyObject *key, PyObject *value, Py_ssize_t limit);

/* AnyValue's oneof: always written, also when empty or zero (the SDK sets it explicitly). */
static int put_any_value(Buf *b, PyObject *v, Py_ssize_t limit) {
    if (v == Py_None)
        return 0;
    if (PyBool_Check(v))
        return put_tag(b, 2, VARINT) || put_varint(b, v == Py_True);
    if (PyUnicode_Check(v))
        return put_str(b, 1, v, limit, 0);
    if (PyLong_Check(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred())
            return -1;
        if (overflow)
            return SKIP;
        return put_tag(b, 3, VARINT) || put_varint(b, (uint64_t)x);
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t bits;
        memcpy(&bits, &d, 8);
        return put_fixed(b, 4, bits, 8);
    }
    if (PyBytes_Check(v))
        return put_bytes(b, 7, PyBytes_AS_STRING(v), (size_t)PyBytes_GET_SIZE(v));
    size_t outer, inner;
    if (PyList_Check(v) || PyTuple_Check(v)) {
        PyObject *seq = PySequence_Fast(v, "attribute array");
        if (!seq || open_message(b, 5, &outer)) {
            Py_XDECREF(seq);
            return -1;
        }
        int r = 0;
        for (Py_ssize_t i = 0, n = PySequence_Fast_GET_SIZE(seq); i < n && !r; i++) {
            r = open_message(b, 1, &inner);
            if (!r)
                r = put_any_value(b, PySequence_Fast_GET_ITEM(seq, i), limit);
            if (!r)
                r = close_message(b, inner);
        }
        Py_DECREF(seq);
        return r ? r : close_message(b, outer);
    }
    if (PyDict_Check(v)) {
        if (open_message(b, 6, &outer))
            return -1;
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        int r = 0;
        while (!r && PyDict_Next(v, &pos, &key, &value))
            if (PyUnicode_Check(key) && PyUnicode_GET_LENGTH(key) > 0) /* the SDK drops other keys */
                r = put_key_value(b, 1, key, value, limit);
        return r ? r : close_message(b, outer);
    }
    PyErr_Format(PyExc_TypeError, "attribute value of type %.80s: expected str, bool, int, float, bytes, None, "
                 "or a list, tuple or dict of those", Py_TYPE(v)->tp_name);
    return -1;
}

/* A KeyValue of a str key and a str value, its lengths known up front (the generic path's bytes, at
 * ~1/2 of its instructions: a SERVER span has ~10 such); SKIP when either has no UTF-8 form. */
static int put_str_key_value(Buf *b, uint32_t field, PyObject *key, PyObject *value, Py_ssize_t limit) {
    Py_ssize_t kn, vn;
    const char *k = PyUnicode_AsUTF8AndSize(key, &kn), *v;
    PyObject *owner;
    if (!k) {
        PyErr_Clear();
        return SKIP;
    }
    int r = utf8_of(value, limit, &v, &vn, &owner);
    if (r)
        return r;
    size_t any = 1 + varint_len((size_t)vn) + (size_t)vn;
    size_t kv = (kn ? 1 + varint_len((size_t)kn) + (size_t)kn : 0) + 1 + varint_len(any) + any;
    if (!(r = reserve(b, 15 + kv))) {
        uint8_t *o = write_varint(write_varint(b->data + b->len, ((uint64_t)field << 3) | LEN), kv);
        if (kn) {
            *o++ = 1 << 3 | LEN;
            o = write_varint(o, (uint64_t)kn);
            memcpy(o, k, (size_t)kn);
            o += kn;
        }
        *o++ = 2 << 3 | LEN;
        o = write_varint(o, any);
        *o++ = 1 << 3 | LEN;
        o = write_varint(o, (uint64_t)vn);
        memcpy(o, v, (size_t)vn);
        b->len = (size_t)(o + vn - b->data);
    }
    Py_XDECREF(owner);
    return r;
}

static int put_key_value(Buf *b, uint32_t field, PyObject *key, PyObject *value, Py_ssize_t limit) {
    Scalar scalar;
    if (scalar_of(value, &scalar)) {
        int r = put_scalar_key_value(b, field, key, &scalar);
        return r == SKIP ? 0 : r; /* SKIP: as below, left out */
    }
    if (PyUnicode_Check(value)) {
        int r = put_str_key_value(b, field, key, value, limit);
        return r == SKIP ? 0 : r;
    }
    size_t start = b->len, kv, any;
    int r = open_message(b, field, &kv);
    if (!r)
        r = put_str(b, 1, key, -1, 1);
    if (!r)
        r = open_message(b, 2, &any);
    if (!r)
        r = put_any_value(b, value, limit);
    if (!r)
        r = close_message(b, any);
    if (!r)
        r = close_message(b, kv);
    if (r == SKIP) { /* as the SDK's encoder: logged there, left out */
        b->len = start;
        return 0;
    }
    return r ? -1 : 0;
}

/* `attributes` (a dict, or None) bounded as BoundedAttributes bounds them: keys that are not
 * non-empty str dropped, then the last `max` kept; returns the dropped count, or -1. */
static Py_ssize_t put_attributes(Buf *b, uint32_t field, PyObject *attributes, Py_ssize_t max, Py_ssize_t limit) {
    if (attributes == Py_None)
        return 0;
    if (!PyDict_Check(attributes)) {
        PyErr_SetString(PyExc_TypeError, "attributes: expected a dict");
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0, valid = 0, invalid = 0;
    if (max >= 0 && PyDict_GET_SIZE(attributes) > max) /* else all valid keys are kept: no counting pass */
        while (PyDict_Next(attributes, &pos, &key, &value))
            (PyUnicode_Check(key) && PyUnicode_GET_LENGTH(key) > 0) ? valid++ : invalid++;
    Py_ssize_t skip = (max >= 0 && valid > max) ? valid - max : 0;
    pos = 0, valid = invalid = 0;
    while (PyDict_Next(attributes, &pos, &key, &value)) {
        if (!PyUnicode_Check(key) || PyUnicode_GET_LENGTH(key) == 0) {
            invalid++;
            continue;
        }
        valid++;
        if (skip) {
            skip--;
            continue;
        }
        if (put_key_value(b, field, key, value, limit))
            return -1;
    }
    return invalid + ((max >= 0 && valid > max) ? valid - max : 0);
}

static int put_dropped(Buf *b, uint32_t field, Py_ssize_t dropped) {
    return dropped > 0 ? (put_tag(b, field, VARINT) || put_varint(b, (uint64_t)dropped)) : 0;
}

/* ---------- spans ---------- */

enum {
    F_NAME, F_KIND, F_TRACE_ID, F_SPAN_ID, F_PARENT_ID, F_PARENT_REMOTE, F_TRACE_FLAGS, F_TRACE_STATE,
    F_START, F_END, F_ATTRIBUTES, F_EVENTS, F_LINKS, F_STATUS_CODE, F_STATUS_MESSAGE, N_FIELDS
};

/* The last `max` items of a tuple or list (-1: all): the first index kept. */
static int bounded(PyObject *items, Py_ssize_t max, const char *what, Py_ssize_t *first) {
    if (!PyTuple_Check(items) && !PyList_Check(items)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a tuple or list", what);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    *first = (max >= 0 && n > max) ? n - max : 0;
    return 0;
}

/* Event: (name, time_unix_nano, attributes). */
static int put_event(Buf *b, PyObject *event, const Limits *limits) {
    if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) != 3) {
        PyErr_SetString(PyExc_TypeError, "event: expected (name, time_ns, attributes)");
        return -1;
    }
    size_t mark;
    uint64_t time_ns;
    if (open_message(b, 11, &mark) || u64_of(PyTuple_GET_ITEM(event, 1), &time_ns, "event time"))
        return -1;
    if ((time_ns && put_fixed(b, 1, time_ns, 8)) || put_str_field(b, 2, PyTuple_GET_ITEM(event, 0), "event name"))
        return -1;
    Py_ssize_t dropped =
        put_attributes(b, 3, PyTuple_GET_ITEM(event, 2), limits->event_attributes, limits->other_length);
    return dropped < 0 || put_dropped(b, 4, dropped) || close_message(b, mark);
}

/* A span's events (the last `events` limit of them kept), then how many were left out. */
static int put_events(Buf *b, PyObject *events, const Limits *limits) {
    Py_ssize_t first;
    if (bounded(events, limits->events, "events", &first))
        return -1;
    for (Py_ssize_t i = first; i < PySequence_Fast_GET_SIZE(events); i++)
        if (put_event(b, PySequence_Fast_GET_ITEM(events, i), limits))
            return -1;
    return put_dropped(b, 12, first);
}

/* A link packed as records.LINK (trace id, span id, flags; big-endian), written at once; a local
 * context (flags: has-is-remote). */
static int put_packed_link(Buf *b, const char *p) {
    static const uint8_t flags[5] = {6 << 3 | I32, FLAGS_HAS_IS_REMOTE & 0xFF, FLAGS_HAS_IS_REMOTE >> 8, 0, 0};
    if (reserve(b, 35))
        return -1;
    uint8_t *out = b->data + b->len;
    out[0] = 13 << 3 | LEN, out[1] = 33, out[2] = 1 << 3 | LEN, out[3] = 16;
    memcpy(out + 4, p, 16);
    out[20] = 2 << 3 | LEN, out[21] = 8;
    memcpy(out + 22, p + 16, 8);
    memcpy(out + 30, flags, 5);
    b->len += 35;
    return 0;
}

/* Link: PACKED_LINK bytes (records.LINK) or (trace_id, span_id, trace_flags[, attributes]). */
static int put_link(Buf *b, PyObject *link, const Limits *limits) {
    size_t mark;
    if (PyBytes_Check(link) && PyBytes_GET_SIZE(link) == PACKED_LINK)
        return put_packed_link(b, PyBytes_AS_STRING(link));
    Py_ssize_t n = PyTuple_Check(link) ? PyTuple_GET_SIZE(link) : 0;
    if (n != 3 && n != 4) {
        PyErr_SetString(PyExc_TypeError, "link: expected 25 packed bytes or (trace_id, span_id, trace_flags[, attributes])");
        return -1;
    }
    if (open_message(b, 13, &mark) || put_id(b, 1, PyTuple_GET_ITEM(link, 0), 16, "link trace_id") ||
        put_id(b, 2, PyTuple_GET_ITEM(link, 1), 8, "link span_id"))
        return -1;
    Py_ssize_t dropped =
        n == 4 ? put_attributes(b, 4, PyTuple_GET_ITEM(link, 3), limits->link_attributes, limits->other_length) : 0;
    return dropped < 0 || put_dropped(b, 5, dropped) || put_fixed(b, 6, FLAGS_HAS_IS_REMOTE, 4) ||
           close_message(b, mark);
}

/* A span's links: a sequence of links, or bytes of packed links end to end (the last `links` limit
 * of them kept); `*dropped`: how many were left out. */
static int put_links(Buf *b, PyObject *links, const Limits *limits, Py_ssize_t *dropped) {
    if (PyBytes_Check(links)) {
        Py_ssize_t size = PyBytes_GET_SIZE(links), n = size / PACKED_LINK;
        if (size % PACKED_LINK) {
            PyErr_Format(PyExc_ValueError, "links: %zd bytes, not a whole number of %d-byte packed links", size,
                         PACKED_LINK);
            return -1;
        }
        *dropped = (limits->links >= 0 && n > limits->links) ? n - limits->links : 0;
        const char *packed = PyBytes_AS_STRING(links);
        if (reserve(b, (size_t)(n - *dropped) * 35))
            return -1;
        for (Py_ssize_t i = *dropped; i < n; i++)
            if (put_packed_link(b, packed + i * PACKED_LINK))
                return -1;
        return 0;
    }
    if (bounded(links, limits->links, "links", dropped))
        return -1;
    for (Py_ssize_t i = *dropped; i < PySequence_Fast_GET_SIZE(links); i++)
        if (put_link(b, PySequence_Fast_GET_ITEM(links, i), limits))
            return -1;
    return 0;
}

/* A span's message, without its entry's tag and length (begin_entry, entry_bytes). */
static int put_span(Buf *b, PyObject *span, const Limits *limits) {
    if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) != N_FIELDS) {
        PyErr_Format(PyExc_TypeError, "span: expected a SpanData (a %d-tuple)", N_FIELDS);
        return -1;
    }
    PyObject **f = &PyTuple_GET_ITEM(span, 0);
    uint64_t start, end, kind, status;
    if (put_id(b, 1, f[F_TRACE_ID], 16, "trace_id") ||
        put_id(b, 2, f[F_SPAN_ID], 8, "span_id") || put_str_field(b, 3, f[F_TRACE_STATE], "trace_state"))
        return -1;
    if (f[F_PARENT_ID] != Py_None && put_id(b, 4, f[F_PARENT_ID], 8, "parent_id"))
        return -1;
    if (put_str_field(b, 5, f[F_NAME], "name") || u64_of(f[F_KIND], &kind, "kind") ||
        (kind && (put_tag(b, 6, VARINT) || put_varint(b, kind))))
        return -1;
    if (u64_of(f[F_START], &start, "start_ns") || u64_of(f[F_END], &end, "end_ns") ||
        (start && put_fixed(b, 7, start, 8)) || (end && put_fixed(b, 8, end, 8)))
        return -1;
    Py_ssize_t dropped = put_attributes(b, 9, f[F_ATTRIBUTES], limits->attributes, limits->attribute_length);
    if (dropped < 0 || put_dropped(b, 10, dropped))
        return -1;
    Py_ssize_t first;
    if (put_events(b, f[F_EVENTS], limits) || put_links(b, f[F_LINKS], limits, &first))
        return -1;
    size_t status_mark;
    if (put_dropped(b, 14, first) || open_message(b, 15, &status_mark) ||
        put_str_field(b, 2, f[F_STATUS_MESSAGE], "status_message") ||
        u64_of(f[F_STATUS_CODE], &status, "status_code") ||
        (status && (put_tag(b, 3, VARINT) || put_varint(b, status))) || close_message(b, status_mark))
        return -1;
    uint32_t flags = FLAGS_HAS_IS_REMOTE | (f[F_PARENT_ID] != Py_None && PyObject_IsTrue(f[F_PARENT_REMOTE]) == 1
                                                ? FLAGS_IS_REMOTE : 0);
    return put_fixed(b, 16, flags, 4);
}

static int limits_of(PyObject *t, Limits *l) {
    Py_ssize_t *out[] = {&l->attributes, &l->attribute_length, &l->events, &l->links,
                         &l->event_attributes, &l->link_attributes, &l->other_length};
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 7) {
        PyErr_SetString(PyExc_TypeError, "limits: expected a 7-tuple of ints (-1: no limit)");
        return -1;
    }
    for (int i = 0; i < 7; i++) {
        *out[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, i));
        if (*out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* An engine step (`spans.PackedStep`, STEP_FIELDS items) as the llm.engine_step span `step_span`
 * describes for a root its sampler records as given: the same bytes as put_span of that description,
 * without the dict and tuple. Attribute values are the step's own items, in `keys` order (STEP_ORDER,
 * then duration_ms = (end_ts - start_ts) / 1e6 as Python's int / float computes it). */
#define STEP_FIELDS 11
#define STEP_ATTRIBUTES 9
static const int STEP_ORDER[STEP_ATTRIBUTES - 1] = {0, 9, 3, 4, 5, 6, 7, 8}; /* index, seqs, prefill, decode, kv used, kv total, preemptions, queue */

/* The step keys (a tuple of STEP_ATTRIBUTES non-empty str) and their UTF-8, looked up once a call (a
 * lookup per attribute was ~1/6 of a step's instructions); NULL: no UTF-8 form (put_key_value's SKIP). */
typedef struct {
    PyObject *keys;
    const char *utf8[STEP_ATTRIBUTES];
    Py_ssize_t len[STEP_ATTRIBUTES];
} StepKeys;

static void step_keys_of(PyObject *keys, StepKeys *k) {
    k->keys = keys;
    for (int i = 0; i < STEP_ATTRIBUTES; i++)
        if (!(k->utf8[i] = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(keys, i), &k->len[i])))
            PyErr_Clear();
}

/* A step value as put_key_value writes it: an exact int of int64 (every usual one) straight from its
 * key's UTF-8, anything else through put_key_value. */
static int put_step_value(Buf *b, const StepKeys *k, int i, PyObject *value, const Limits *limits) {
    int overflow = 0;
    long long x = PyLong_CheckExact(value) ? PyLong_AsLongLongAndOverflow(value, &overflow) : 0;
    if (!PyLong_CheckExact(value) || overflow || !k->utf8[i] || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return put_key_value(b, 9, PyTuple_GET_ITEM(k->keys, i), value, limits->attribute_length);
    }
    Scalar v = {V_INT, x, 0};
    return put_scalar_utf8(b, 9, k->utf8[i], k->len[i], &v);
}

static int put_step_attributes(Buf *b, PyObject **step, const StepKeys *k, const Limits *limits) {
    int overflow[2] = {0, 0};
    long long start = PyLong_Check(step[1]) ? PyLong_AsLongLongAndOverflow(step[1], &overflow[0]) : 0;
    long long end = PyLong_Check(step[2]) ? PyLong_AsLongLongAndOverflow(step[2], &overflow[1]) : 0, span;
    if (PyErr_Occurred() || overflow[0] || overflow[1] || !PyLong_Check(step[1]) || !PyLong_Check(step[2]) ||
        __builtin_sub_overflow(end, start, &span)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "step: start_ts and end_ts must be int64 with an int64 difference");
        return -1;
    }
    Scalar duration_ms = {V_DOUBLE, 0, (double)span / 1e6};
    Py_ssize_t max = limits->attributes, first = (max >= 0 && max < STEP_ATTRIBUTES) ? STEP_ATTRIBUTES - max : 0;
    int r = 0, last = STEP_ATTRIBUTES - 1;
    for (Py_ssize_t i = first; i < last && !r; i++)
        r = put_step_value(b, k, (int)i, step[STEP_ORDER[i]], limits);
    /* a key with no UTF-8 form: left out, as put_key_value leaves it */
    return r || (first < STEP_ATTRIBUTES && k->utf8[last] && put_scalar_utf8(b, 9, k->utf8[last], k->len[last], &duration_ms)) ||
           put_dropped(b, 10, first);
}

static int int64_of(PyObject *v, long long *out, const char *what) {
    int overflow = 0;
    *out = PyLong_Check(v) ? PyLong_AsLongLongAndOverflow(v, &overflow) : -1;
    if (!PyLong_Check(v) || overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected an int64", what);
        return -1;
    }
    return 0;
}

static int step_args_ok(PyObject *name, PyObject *keys, const char *who) {
    if (!PyUnicode_Check(name) || !PyTuple_Check(keys)) {
        PyErr_Format(PyExc_TypeError, "%s: name must be a str and keys a tuple", who);
        return 0;
    }
    if (PyTuple_GET_SIZE(keys) != STEP_ATTRIBUTES) {
        PyErr_Format(PyExc_TypeError, "keys: expected %d attribute keys", STEP_ATTRIBUTES);
        return 0;
    }
    for (Py_ssize_t i = 0; i < STEP_ATTRIBUTES; i++)
        if (!PyUnicode_Check(PyTuple_GET_ITEM(keys, i)) || PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(keys, i)) == 0) {
            PyErr_SetString(PyExc_TypeError, "keys: expected non-empty str");
            return 0;
        }
    return 1;
}

static int is_packed_step(PyObject *step) {
    if (PyTuple_Check(step) && PyTuple_GET_SIZE(step) == STEP_FIELDS && PyBytes_Check(PyTuple_GET_ITEM(step, STEP_FIELDS - 1)))
        return 1;
    PyErr_Format(PyExc_TypeError, "step: expected a PackedStep (%d items, the last bytes)", STEP_FIELDS);
    return 0;
}

/* One step's entry: ids big-endian, times on the wall clock (ns). */
static PyObject *step_entry(Buf *b, PyObject *step, const uint8_t *trace, const uint8_t *span, uint64_t start,
                            uint64_t end, PyObject *name, const StepKeys *keys, const Limits *limits) {
    PyObject **f = &PyTuple_GET_ITEM(step, 0);
    Py_ssize_t dropped;
    begin_entry(b);
    if (put_bytes(b, 1, trace, 16) || put_bytes(b, 2, span, 8) || put_str_field(b, 5, name, "name") ||
        put_tag(b, 6, VARINT) || put_varint(b, 1 /* INTERNAL */) || (start && put_fixed(b, 7, start, 8)) ||
        (end && put_fixed(b, 8, end, 8)) || put_step_attributes(b, f, keys, limits) ||
        put_links(b, f[STEP_FIELDS - 1], limits, &dropped) || put_dropped(b, 14, dropped) ||
        put(b, LOCAL_SPAN_TAIL, sizeof LOCAL_SPAN_TAIL))
        return NULL;
    return entry_bytes(b);
}

/* METH_FASTCALL: PyArg_ParseTuple was ~1k of its ~8k instructions a step. */
static PyObject *encode_step(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    Limits limits;
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "encode_step: expected 8 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *step = args[0];
    if (limits_of(args[7], &limits) || !step_args_ok(args[5], args[6], "encode_step") || !is_packed_step(step))
        return NULL;
    uint8_t trace[16], span[8];
    uint64_t start, end;
    if (id_of(args[1], 16, trace, "trace_id") || id_of(args[2], 8, span, "span_id") ||
        u64_of(args[3], &start, "start_ns") || u64_of(args[4], &end, "end_ns"))
        return NULL;
    StepKeys keys;
    step_keys_of(args[6], &keys);
    Buf b;
    buf_init(&b);
    PyObject *out = step_entry(&b, step, trace, span, start, end, args[5], &keys, &limits);
    buf_free(&b);
    return out;
}

/* A step's wall time: its monotonic stamp (an int64) + offset_ns, in [0, 2**64). */
static int step_wall_ns(PyObject *mono, long long offset_ns, uint64_t *out, const char *what) {
    int overflow;
    long long ts = PyLong_Check(mono) ? PyLong_AsLongLongAndOverflow(mono, &overflow) : 0;
    __int128 wall = (__int128)ts + offset_ns;
    if (!PyLong_Check(mono) || overflow || (ts == -1 && PyErr_Occurred()) || wall < 0 ||
        wall > (__int128)UINT64_MAX) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s + offset_ns: expected an int64 with a sum in [0, 2**64)", what);
        return -1;
    }
    *out = (uint64_t)wall;
    return 0;
}

/* The drawn ids of `n` steps: random_bits(192 * n) is n getrandbits(192) in a row, the first the
 * lowest bits, each a step's trace id (its low 128 bits) then span id (as step ids are drawn one
 * step at a time); little-endian bytes, 24 a step, in a new buffer (PyMem_Free), NULL on error. */
static uint8_t *draw_step_ids(PyObject *random_bits, Py_ssize_t n) {
    uint8_t *pool = PyMem_Malloc((size_t)n * 24 + 1);
    PyObject *bits = pool ? PyObject_CallFunction(random_bits, "n", n * 192) : NULL;
    int bad = !bits || !PyLong_Check(bits) ||
              _PyLong_AsByteArray((PyLongObject *)bits, pool, (size_t)n * 24, 1, 0) == -1;
    Py_XDECREF(bits);
    if (bad) {
        PyMem_Free(pool);
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "random_bits: expected an int of 192 bits a step");
        }
        return NULL;
    }
    return pool;
}

static int all_zero(const uint8_t *p, int n) {
    for (int i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}

/* A step's ids, big-endian: from its 24 drawn bytes, or (no draw, or a 0 id drawn: p = 2**-64) from
 * `new_ids()` -> (trace_id, span_id), as the id generator makes them. */
static int step_ids(const uint8_t *drawn, PyObject *new_ids, uint8_t *trace, uint8_t *span) {
    if (drawn && !all_zero(drawn, 16) && !all_zero(drawn + 16, 8)) {
        for (int i = 0; i < 16; i++)
            trace[i] = drawn[15 - i];
        for (int i = 0; i < 8; i++)
            span[i] = drawn[23 - i];
        return 0;
    }
    PyObject *ids = PyObject_CallNoArgs(new_ids);
    int r = !ids || !PyTuple_Check(ids) || PyTuple_GET_SIZE(ids) != 2;
    if (!r)
        r = id_of(PyTuple_GET_ITEM(ids, 0), 16, trace, "trace_id") || id_of(PyTuple_GET_ITEM(ids, 1), 8, span, "span_id");
    else if (ids)
        PyErr_SetString(PyExc_TypeError, "new_ids: expected (trace_id, span_id)");
    Py_XDECREF(ids);
    return r ? -1 : 0;
}

static Py_ssize_t sampled_steps(PyObject *seq) {
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *step = PySequence_Fast_GET_ITEM(seq, i);
        if (!is_packed_step(step))
            return -1;
        n += PyBytes_GET_SIZE(PyTuple_GET_ITEM(step, STEP_FIELDS - 1)) > 0;
    }
    return n;
}

/* encode_steps(steps, random_bits, new_ids, offset_ns, name, keys, limits) -> list[bytes]; METH_FASTCALL.
 * The entries encode_step makes, one per step with a sampled member (links), in order: ids drawn
 * (draw_step_ids, or new_ids() per step where random_bits is None), wall = mono + offset_ns. */
static PyObject *encode_steps(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "encode_steps: expected 7 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *random_bits = args[1], *new_ids = args[2], *name = args[4], *keys = args[5];
    Limits limits;
    long long offset_ns;
    if (limits_of(args[6], &limits) || !step_args_ok(name, keys, "encode_steps") ||
        int64_of(args[3], &offset_ns, "offset_ns"))
        return NULL;
    if (!PyCallable_Check(new_ids) || (random_bits != Py_None && !PyCallable_Check(random_bits))) {
        PyErr_SetString(PyExc_TypeError, "encode_steps: random_bits None or a callable, new_ids a callable");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "steps: expected a sequence");
    Py_ssize_t n = seq ? sampled_steps(seq) : -1;
    uint8_t *pool = n > 0 && random_bits != Py_None ? draw_step_ids(random_bits, n) : NULL;
    PyObject *out = n >= 0 && (pool || random_bits == Py_None || !n) ? PyList_New(n) : NULL;
    StepKeys step_keys;
    step_keys_of(keys, &step_keys);
    Buf b;
    buf_init(&b);
    for (Py_ssize_t i = 0, j = 0; out && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *step = PySequence_Fast_GET_ITEM(seq, i), *entry = NULL;
        if (!PyBytes_GET_SIZE(PyTuple_GET_ITEM(step, STEP_FIELDS - 1)))
            continue;
        uint8_t trace[16], span[8];
        uint64_t start, end;
        if (!step_ids(pool ? pool + 24 * j : NULL, new_ids, trace, span) &&
            !step_wall_ns(PyTuple_GET_ITEM(step, 1), offset_ns, &start, "start_ts") &&
            !step_wall_ns(PyTuple_GET_ITEM(step, 2), offset_ns, &end, "end_ts"))
            entry = step_entry(&b, step, trace, span, start, end, name, &step_keys, &limits);
        if (!entry)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, j++, entry);
    }
    buf_free(&b);
    PyMem_Free(pool);
    Py_XDECREF(seq);
    return out;
}

/* ---------- a request's phase spans ---------- */

/* The child spans of a request's trace (`spans.request_spans`: llm.ingress, llm.queue per wait,
 * llm.first_token, llm.first_chunk, llm.delivery, llm.prefill.chunk, llm.prefill, llm.decode), in
 * its order and with its span ids drawn in its order (`new_span_id()`, as `_Tree.leaf` draws them):
 * the same bytes as encode_spans of those descriptions, without a dict or a SpanData per span. The
 * stamps are `spans.phase_stamps` (S_*), names `spans.PHASE_NAMES` (N_*), keys `spans.PHASE_KEYS`
 * (K_*); llm.decode's attributes and events come made (`spans.decode_description`). */
enum { S_RECEIVED, S_INGRESS_END, S_END, S_SCHEDULED, S_PREFILL_END, S_FIRST_TOKEN, S_VISIBLE, S_FIRST_CHUNK,
       S_LAST_TOKEN, S_LOOP_WAIT, S_ENCODE, S_WRITE, S_INITIAL_CHUNKS, PHASE_STAMPS };
enum { N_INGRESS, N_QUEUE, N_FIRST_TOKEN, N_FIRST_CHUNK, N_DELIVERY, N_CHUNK, N_PREFILL, N_DECODE, PHASE_NAMES };
enum { K_WAIT_INDEX, K_LOOP_WAIT, K_ENCODE, K_WRITE, K_CHUNK_INDEX, K_CHUNK_TOKENS, K_CACHED_TOKENS, K_RECOMPUTE,
       K_PREFILL_CHUNKS, PHASE_KEYS };

typedef struct {
    int key; /* K_* */
    Scalar v;
} Attr;

#define POOL_IDS 8 /* span ids drawn per random_bits call: a request's phase spans, usually */

typedef struct {
    PyObject *new_span_id, *random_bits, *trace_state, *names, *keys, *out;
    uint64_t pool[POOL_IDS]; /* random_bits's draw, 64 bits an id, taken from pool[POOL_IDS - pooled] */
    int pooled;
    long long offset_ns; /* wall = mono + offset (the anchor's formula) */
    uint8_t trace[16], root[8]; /* the ids every child span writes, converted once */
    Limits limits;
    Buf b;
} Tree;


static int wall_ns(const Tree *t, long long mono_ns, uint64_t *out) {
    long long wall;
    if (__builtin_add_overflow(mono_ns, t->offset_ns, &wall) || wall < 0) {
        PyErr_SetString(PyExc_ValueError, "phase stamp + offset_ns: outside [0, 2**63)");
        return -1;
    }
    *out = (uint64_t)wall;
    return 0;
}

/* The next span id: `new_span_id()`, or with `random_bits` (`random.getrandbits`, what the SDK's
 * RandomIdGenerator calls) the next 64 bits of one draw of POOL_IDS x 64: getrandbits(64 * n) is
 * n getrandbits(64) in a row, the first the lowest bits, so the ids are the SDK generator's; a 0
 * (INVALID_SPAN_ID) is skipped, as its retry skips it. The pool ends with the call (no ids carried
 * past a fork). */
static PyObject *draw_span_id(Tree *t) {
    if (t->random_bits == Py_None)
        return PyObject_CallNoArgs(t->new_span_id);
    for (;;) {
        if (!t->pooled) {
            uint8_t bytes[POOL_IDS * 8];
            PyObject *bits = PyObject_CallFunction(t->random_bits, "i", POOL_IDS * 64);
            int r = !bits || !PyLong_Check(bits) ||
                    _PyLong_AsByteArray((PyLongObject *)bits, bytes, sizeof bytes, 1, 0) == -1;
            Py_XDECREF(bits);
            if (r) {
                PyErr_Clear();
                PyErr_SetString(PyExc_ValueError, "random_bits: expected an int of 512 bits");
                return NULL;
            }
            for (int i = 0; i < POOL_IDS; i++) {
                uint64_t id = 0;
                for (int k = 7; k >= 0; k--)
                    id = id << 8 | bytes[i * 8 + k];
                t->pool[i] = id;
            }
            t->pooled = POOL_IDS;
        }
        uint64_t id = t->pool[POOL_IDS - t->pooled--];
        if (id)
            return PyLong_FromUnsignedLongLong(id);
    }
}

/* `id or new_span_id()` (a new reference), as `_Tree.leaf` takes a span id. */
static PyObject *span_id_or_drawn(Tree *t, PyObject *id) {
    int truth = id ? PyObject_IsTrue(id) : 0;
    if (truth < 0)
        return NULL;
    if (truth) {
        Py_INCREF(id);
        return id;
    }
    return draw_span_id(t);
}

static int put_scalars(Buf *b, PyObject *keys, const Attr *attrs, Py_ssize_t n, const Limits *limits) {
    Py_ssize_t max = limits->attributes, first = (max >= 0 && n > max) ? n - max : 0;
    for (Py_ssize_t i = first; i < n; i++)
        if (put_scalar_key_value(b, 9, PyTuple_GET_ITEM(keys, attrs[i].key), &attrs[i].v) == -1)
            return -1; /* SKIP (a key with no UTF-8 form): left out, as put_key_value leaves it */
    return put_dropped(b, 10, first);
}

/* One child span, appended to t->out: `span_id or new_span_id()`, parent `parent_id or the root`;
 * attributes `attrs`, or llm.decode's (`decode`: (attributes, events)). */
static int put_child(Tree *t, int name, PyObject *span_id, PyObject *parent_id, long long start_ts, long long end_ts,
                     const Attr *attrs, Py_ssize_t n, PyObject *decode) {
    Buf *b = &t->b;
    uint64_t start, end;
    uint8_t parent[8];
    int parent_set = parent_id ? PyObject_IsTrue(parent_id) : 0;
    PyObject *id = parent_set < 0 ? NULL : span_id_or_drawn(t, span_id);
    if (!id)
        return -1;
    begin_entry(b);
    Py_ssize_t dropped = 0;
    int r = wall_ns(t, start_ts, &start) || wall_ns(t, end_ts, &end) || put_bytes(b, 1, t->trace, 16) ||
            put_id(b, 2, id, 8, "span_id") || put_str_field(b, 3, t->trace_state, "trace_state") ||
            (parent_set && id_of(parent_id, 8, parent, "parent_id")) ||
            put_bytes(b, 4, parent_set ? parent : t->root, 8) ||
            put_str_field(b, 5, PyTuple_GET_ITEM(t->names, name), "name") || put_tag(b, 6, VARINT) ||
            put_varint(b, 1 /* INTERNAL */) || (start && put_fixed(b, 7, start, 8)) || (end && put_fixed(b, 8, end, 8));
    Py_DECREF(id);
    if (!r && decode) {
        dropped = put_attributes(b, 9, PyTuple_GET_ITEM(decode, 0), t->limits.attributes, t->limits.attribute_length);
        r = dropped < 0 || put_dropped(b, 10, dropped) || put_events(b, PyTuple_GET_ITEM(decode, 1), &t->limits);
    } else if (!r)
        r = put_scalars(b, t->keys, attrs, n, &t->limits);
    if (r || put(b, LOCAL_SPAN_TAIL, sizeof LOCAL_SPAN_TAIL))
        return -1;
    PyObject *encoded = entry_bytes(b);
    r = !encoded || PyList_Append(t->out, encoded);
    Py_XDECREF(encoded);
    return r ? -1 : 0;
}

static int put_queue_waits(Tree *t, PyObject *waits) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(waits); i++) {
        PyObject *wait = PySequence_Fast_GET_ITEM(waits, i);
        long long start, end;
        if (!PyTuple_Check(wait) || PyTuple_GET_SIZE(wait) != 2) {
            PyErr_SetString(PyExc_TypeError, "waits: expected (start, end) tuples");
            return -1;
        }
        Attr index = {K_WAIT_INDEX, {V_INT, i, 0}};
        if (int64_of(PyTuple_GET_ITEM(wait, 0), &start, "wait start") ||
            int64_of(PyTuple_GET_ITEM(wait, 1), &end, "wait end") ||
            put_child(t, N_QUEUE, NULL, NULL, start, end, &index, 1, NULL))
            return -1;
    }
    return 0;
}

/* llm.prefill.chunk spans (`_chunk_spans`): initial chunks under llm.prefill when there are more
 * than one, recompute chunks (index >= initial) under llm.decode; none without that parent. */
static int put_chunks(Tree *t, PyObject *chunks, long long initial, PyObject *prefill, PyObject *decode) {
    for (Py_ssize_t index = 0; index < PySequence_Fast_GET_SIZE(chunks) / 4; index++) {
        int recompute = index >= initial;
        PyObject *parent = recompute ? decode : prefill;
        if (!parent || (!recompute && initial < 2))
            continue;
        long long v[4];
        for (int i = 0; i < 4; i++)
            if (int64_of(PySequence_Fast_GET_ITEM(chunks, 4 * index + i), &v[i], "chunk stamp"))
                return -1;
        Attr attrs[4] = {{K_CHUNK_INDEX, {V_INT, index, 0}}, {K_CHUNK_TOKENS, {V_INT, v[2], 0}},
                         {K_CACHED_TOKENS, {V_INT, v[3], 0}}, {K_RECOMPUTE, {V_BOOL, recompute, 0}}};
        if (put_child(t, N_CHUNK, NULL, parent, v[0], v[1], attrs, 4, NULL))
            return -1;
    }
    return 0;
}

/* llm.prefill (`prefill_attributes`): its chunk count, Σ tokens and Σ cached of the initial chunks. */
static int put_prefill(Tree *t, PyObject *prefill, const long long *stamps, PyObject *chunks) {
    long long initial = stamps[S_INITIAL_CHUNKS], sums[2] = {0, 0}; /* chunks[:4 * initial][2::4], [3::4] */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(chunks), end = initial >= n / 4 + 1 ? n : (Py_ssize_t)(4 * initial);
    for (Py_ssize_t p = 2; p < end && p < n; p += p % 4 == 2 ? 1 : 3) {
        long long v;
        if (int64_of(PySequence_Fast_GET_ITEM(chunks, p), &v, "chunk tokens"))
            return -1;
        if (__builtin_add_overflow(sums[p % 4 - 2], v, &sums[p % 4 - 2])) {
            PyErr_SetString(PyExc_ValueError, "chunks: token counts with a sum outside int64");
            return -1;
        }
    }
    Attr attrs[3] = {{K_PREFILL_CHUNKS, {V_INT, initial, 0}}, {K_CHUNK_TOKENS, {V_INT, sums[0], 0}},
                     {K_CACHED_TOKENS, {V_INT, sums[1], 0}}};
    return put_child(t, N_PREFILL, prefill, NULL, stamps[S_SCHEDULED], stamps[S_PREFILL_END], attrs, 3, NULL);
}

static int put_phase_spans(Tree *t, const long long *st, PyObject *waits, PyObject *chunks, PyObject *decode) {
    PyObject *prefill = NULL, *decode_id = NULL;
    int r = put_child(t, N_INGRESS, NULL, NULL, st[S_RECEIVED], st[S_INGRESS_END], NULL, 0, NULL) ||
            put_queue_waits(t, waits) || (st[S_SCHEDULED] && !(prefill = draw_span_id(t)));
    if (!r && st[S_FIRST_TOKEN]) {
        Attr split[3] = {{K_LOOP_WAIT, {V_DOUBLE, 0, (double)st[S_LOOP_WAIT] / 1e6}},
                         {K_ENCODE, {V_DOUBLE, 0, (double)st[S_ENCODE] / 1e6}},
                         {K_WRITE, {V_DOUBLE, 0, (double)st[S_WRITE] / 1e6}}};
        r = put_child(t, N_FIRST_TOKEN, NULL, NULL, st[S_PREFILL_END], st[S_FIRST_TOKEN], NULL, 0, NULL) ||
            (st[S_FIRST_CHUNK] &&
             put_child(t, N_FIRST_CHUNK, NULL, NULL, st[S_VISIBLE], st[S_FIRST_CHUNK], split, 3, NULL)) ||
            !(decode_id = draw_span_id(t)) ||
            put_child(t, N_DELIVERY, NULL, NULL, st[S_LAST_TOKEN], st[S_END], NULL, 0, NULL);
    }
    r = r || put_chunks(t, chunks, st[S_INITIAL_CHUNKS], prefill, decode_id) ||
        (prefill && put_prefill(t, prefill, st, chunks)) ||
        (decode_id && put_child(t, N_DECODE, decode_id, NULL, st[S_FIRST_TOKEN], st[S_LAST_TOKEN], NULL, 0, decode));
    Py_XDECREF(prefill);
    Py_XDECREF(decode_id);
    return r ? -1 : 0;
}

static int str_tuple(PyObject *t, Py_ssize_t n, const char *what) {
    int ok = PyTuple_Check(t) && PyTuple_GET_SIZE(t) == n;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = PyUnicode_Check(PyTuple_GET_ITEM(t, i)) && PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(t, i)) > 0;
    if (!ok)
        PyErr_Format(PyExc_TypeError, "%s: expected a tuple of %zd non-empty str", what, n);
    return ok ? 0 : -1;
}

/* encode_phases(new_span_id, random_bits, root, offset_ns, stamps, waits, chunks, decode, names, keys, limits); METH_FASTCALL. */
static PyObject *encode_phases(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11) {
        PyErr_Format(PyExc_TypeError, "encode_phases: expected 11 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *root = args[2], *stamps = args[4], *decode = args[7];
    Tree t; /* not zeroed as a whole: its buffer is 8 KiB */
    t.new_span_id = args[0], t.random_bits = args[1], t.names = args[8], t.keys = args[9], t.out = NULL;
    t.pooled = 0;
    long long st[PHASE_STAMPS];
    if (limits_of(args[10], &t.limits) || str_tuple(t.names, PHASE_NAMES, "names") ||
        str_tuple(t.keys, PHASE_KEYS, "keys") || int64_of(args[3], &t.offset_ns, "offset_ns"))
        return NULL;
    if (!PyCallable_Check(t.new_span_id) || (t.random_bits != Py_None && !PyCallable_Check(t.random_bits)) || !PyTuple_Check(root) || PyTuple_GET_SIZE(root) != 4 ||
        !PyTuple_Check(stamps) || PyTuple_GET_SIZE(stamps) != PHASE_STAMPS) {
        PyErr_Format(PyExc_TypeError, "encode_phases: expected a callable, None or a callable, a SpanIds and %d stamps", PHASE_STAMPS);
        return NULL;
    }
    for (int i = 0; i < PHASE_STAMPS; i++)
        if (int64_of(PyTuple_GET_ITEM(stamps, i), &st[i], "stamp"))
            return NULL;
    if (st[S_INITIAL_CHUNKS] < 0) {
        PyErr_SetString(PyExc_ValueError, "stamps: initial_chunks must be >= 0");
        return NULL;
    }
    if (st[S_FIRST_TOKEN] && (!PyTuple_Check(decode) || PyTuple_GET_SIZE(decode) != 2)) {
        PyErr_SetString(PyExc_TypeError, "decode: expected (attributes, events) when there is a first token");
        return NULL;
    }
    if (id_of(PyTuple_GET_ITEM(root, 0), 16, t.trace, "trace_id") ||
        id_of(PyTuple_GET_ITEM(root, 1), 8, t.root, "parent_id"))
        return NULL;
    t.trace_state = PyTuple_GET_ITEM(root, 3);
    PyObject *waits = PySequence_Fast(args[5], "waits: expected a sequence of (start, end)");
    PyObject *chunks = waits ? PySequence_Fast(args[6], "chunks: expected a sequence of ints") : NULL;
    t.out = chunks ? PyList_New(0) : NULL;
    buf_init(&t.b);
    if (t.out && put_phase_spans(&t, st, waits, chunks, decode))
        Py_CLEAR(t.out);
    buf_free(&t.b);
    Py_XDECREF(waits);
    Py_XDECREF(chunks);
    return t.out;
}

/* ---------- a request's SERVER span ---------- */

/* The SERVER span `spans.root_span` describes (its attributes `spans.request_attributes`, then
 * phaselens.trace.full and the compact record's summary), computed here from the record and its
 * `Phases`: the same bytes as encode_spans of that description (the same keys, order, presence and
 * limits), without the dict, its ~45 values made one at a time by the interpreter, and the SpanData.
 * Keys are `spans.ROOT_SPAN_KEYS` (R_*), the span's strings T_* (the name and error.type made here). The record's
 * fields are read by position (`records.py`'s order, which the wire format also relies on), the
 * Phases' at their slots. A value the dict path would write as an int or a float is computed as Python
 * computes it: int64 arithmetic (a result past int64 is a ValueError: stamps of 292 years), an int
 * divided by 1e6 or 1e9 as a double, and TPOT's int / int correctly rounded. */
enum { R_PROVIDER, R_METHOD, R_PATH, R_STATUS, R_ADDRESS, R_PORT, R_X_REQUEST_ID, R_ERROR_TYPE, R_INGRESS_MS,
       R_QUEUE_MS, R_PREFILL_MS, R_FIRST_TOKEN_MS, R_DECODE_MS, R_DELIVERY_MS, R_TTFT_MS, R_TPOT_MS, R_PREEMPTIONS,
       R_FINISH_REASON, R_DISCONNECTED, R_RECEIVED_WALL, R_RESPONDED_WALL, R_FINISH_REASONS, R_OUTPUT_TOKENS,
       R_CACHE_READ, R_REASONING, R_LAT_QUEUE, R_LAT_TTFT, R_LAT_E2E, R_LAT_PREFILL, R_LAT_DECODE, R_LAT_INFERENCE,
       R_INFO, /* the 12 keys of `spans._INFO_KEYS` */
       R_INPUT_MESSAGES = R_INFO + 12, R_OUTPUT_MESSAGES, R_FIRST_CHUNK_MS, R_HELD_BACK_MS, R_HELD_BACK_TOKENS,
       R_LOOP_WAIT_MS, R_ENCODE_MS, R_WRITE_MS, R_TTFC_MS, R_LAST_CHUNK_MS, R_SENDS_NS, R_SENDS_BYTES, R_DISPATCH_MS,
       R_INBOUND_MS, R_KERNEL_WAIT_MS, R_TRACE_FULL, ROOT_KEYS };
/* RequestRecord's, RequestOutcome's, HttpFacts' fields (records.py) */
enum { RR_ROOT, RR_PARENT, RR_FINISH_REASON = 14, RR_CHUNKS = 16, RR_SENDS = 19, RR_INFO, RR_OUTCOME, RR_HTTP, RR_FIELDS };
enum { O_OUTPUT_TOKENS, O_FINISH_REASON, O_CACHED, O_REASONING, O_COMPLETION, O_ERROR_TYPE, O_STATUS, O_FIELDS };
enum { H_METHOD, H_PATH, H_ADDRESS, H_PORT, H_STATUS, H_DISCONNECTED, H_EXCEPTION, H_X_REQUEST_ID, H_FIELDS };
enum { T_NAME, T_PROVIDER, T_ERROR_TYPE, T_FULL, T_INPUT_MESSAGES, T_OUTPUT_MESSAGES, TEXTS };
/* `spans.ROOT_SPAN_CONSTANTS`: the provider, error.type's client_disconnected and error, the name of a
 * span without a RequestInfo or method */
enum { C_PROVIDER, C_DISCONNECTED, C_FINISH_ERROR, C_UNNAMED, CONSTANTS };
static PyObject *http_error_min; /* 400 */
/* the Phases fields read: as ints (P_* before PHASE_INTS), then as they are */
static const char *const PHASE_FIELD_NAMES[] = {
    "received_ts", "end_ts", "arrived_ts", "read_ts", "kernel_wait_ns", "dispatch_ns", "first_token_ts", "ingress_ns",
    "queue_ns", "prefill_ns", "first_token_phase_ns", "first_chunk_ts", "last_chunk_ts", "first_chunk_phase_ns",
    "held_back_ns", "loop_wait_ns", "encode_ns", "write_ns", "decode_ns", "delivery_ns", "decode_tokens", "waits",
    "held_back_known", "held_back_tokens"};
enum { P_RECEIVED, P_END, P_ARRIVED, P_READ, P_KERNEL_WAIT, P_DISPATCH, P_FIRST_TOKEN, P_INGRESS, P_QUEUE, P_PREFILL,
       P_FIRST_TOKEN_PHASE, P_FIRST_CHUNK, P_LAST_CHUNK, P_FIRST_CHUNK_PHASE, P_HELD_BACK, P_LOOP_WAIT, P_ENCODE,
       P_WRITE, P_DECODE, P_DELIVERY, P_DECODE_TOKENS, PHASE_INTS, P_WAITS = PHASE_INTS, P_HELD_BACK_KNOWN,
       P_HELD_BACK_TOKENS, PHASE_FIELDS };
static PyObject *phase_names[PHASE_FIELDS];

/* Where a Phases' fields live: a slotted class's instances hold each at an offset its member
 * descriptor gives (`phases.Phases`: read there, ~10 instructions a field where PyObject_GetAttr
 * took ~270); found once for the last type seen (held), -1 for a field read by name (any other object). */
static PyObject *offsets_type;
static Py_ssize_t offsets[PHASE_FIELDS];

static void find_offsets(PyTypeObject *type) {
    Py_XSETREF(offsets_type, Py_NewRef((PyObject *)type));
    for (int i = 0; i < PHASE_FIELDS; i++) {
        PyObject *d = _PyType_Lookup(type, phase_names[i]);
        int slot = type->tp_getattro == PyObject_GenericGetAttr && d && Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                   PyType_IsSubtype(type, PyDescr_TYPE(d)) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        offsets[i] = slot ? ((PyMemberDescrObject *)d)->d_member->offset : -1;
    }
}

/* A field of `phases` (a new reference; NULL with an AttributeError when missing). */
static PyObject *phase_field(PyObject *phases, int i) {
    PyObject *v = offsets[i] >= 0 ? *(PyObject **)((char *)phases + offsets[i]) : NULL;
    return v ? Py_NewRef(v) : PyObject_GetAttr(phases, phase_names[i]); /* unset slot: its AttributeError */
}

typedef struct {
    int key;       /* R_*, or -1: `name` */
    PyObject *name; /* a summary key (borrowed) */
    PyObject *obj; /* a new reference; NULL: the scalar */
    Scalar v;
} RootAttr;

typedef struct {
    RootAttr *a;
    Py_ssize_t n;
} RootAttrs;

static void add_scalar(RootAttrs *r, int key, Scalar v) { r->a[r->n++] = (RootAttr){key, NULL, NULL, v}; }
static void add_ms(RootAttrs *r, int key, long long ns) { add_scalar(r, key, (Scalar){V_DOUBLE, 0, (double)ns / 1e6}); }
static void add_int(RootAttrs *r, int key, long long i) { add_scalar(r, key, (Scalar){V_INT, i, 0}); }

/* `obj` (borrowed) unless None, as `present` leaves None out. */
static void add_obj(RootAttrs *r, int key, PyObject *obj) {
    if (obj != Py_None)
        r->a[r->n++] = (RootAttr){key, NULL, Py_NewRef(obj), {V_INT, 0, 0}};
}

/* A new object (NULL: an error, returned as -1). */
static int add_new(RootAttrs *r, int key, PyObject *obj) {
    if (!obj)
        return -1;
    r->a[r->n++] = (RootAttr){key, NULL, obj, {V_INT, 0, 0}};
    return 0;
}

static int truthy(PyObject *v) { return v != Py_None && PyObject_IsTrue(v) > 0; }

/* `a or b` */
static PyObject *or_else(PyObject *a, PyObject *b) { return truthy(a) ? a : b; }

/* int64 timelines (a buffer of int64s, or a sequence of ints) as a new array of n int64s. */
static long long *int64_array(PyObject *obj, Py_ssize_t *n) {
    Py_buffer view;
    long long *out = NULL;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
            return NULL;
        *n = view.len / 8;
        if ((out = PyMem_Malloc((size_t)*n * 8 + 8)))
            memcpy(out, view.buf, (size_t)*n * 8);
        PyBuffer_Release(&view);
        return out ? out : (long long *)PyErr_NoMemory();
    }
    PyObject *seq = PySequence_Fast(obj, "timeline: expected int64s");
    if (!seq)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    if (!(out = PyMem_Malloc((size_t)*n * 8 + 8)))
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; out && i < *n; i++)
        if (int64_of(PySequence_Fast_GET_ITEM(seq, i), &out[i], "timeline stamp")) {
            PyMem_Free(out);
            out = NULL;
        }
    Py_DECREF(seq);
    return out;
}

/* a / b as Python's int / int (correctly rounded): one double division where both are exact. */
static int true_div(long long a, long long b, double *out) {
    if (a > -(1LL << 53) && a < (1LL << 53) && b > -(1LL << 53) && b < (1LL << 53)) {
        *out = (double)a / (double)b;
        return 0;
    }
    PyObject *x = PyLong_FromLongLong(a), *y = x ? PyLong_FromLongLong(b) : NULL;
    PyObject *q = y ? PyNumber_TrueDivide(x, y) : NULL;
    Py_XDECREF(x);
    Py_XDECREF(y);
    *out = q ? PyFloat_AsDouble(q) : -1;
    Py_XDECREF(q);
    return q ? 0 : -1;
}

static int sum_ok(long long a, long long b, long long *out) {
    if (!__builtin_add_overflow(a, b, out))
        return 0;
    PyErr_SetString(PyExc_ValueError, "root span: a sum of stamps or terms outside int64");
    return -1;
}

static int diff_ok(long long a, long long b, long long *out) {
    if (!__builtin_sub_overflow(a, b, out))
        return 0;
    PyErr_SetString(PyExc_ValueError, "root span: a difference of stamps outside int64");
    return -1;
}

/* `phaselens.first_chunk.sends_*` (`spans.add_first_sends`): each send's stamp - the first's, and
 * the body bytes through it, as two tuples. */
static int add_sends(RootAttrs *r, PyObject *sends) {
    Py_ssize_t n;
    long long *s = int64_array(sends, &n);
    if (!s)
        return -1;
    PyObject *ns = n ? PyTuple_New((n + 1) / 2) : NULL, *bytes = ns ? PyTuple_New(n / 2) : NULL;
    for (Py_ssize_t i = 0; bytes && i < n; i++) {
        long long v = s[i];
        if (i % 2 == 0 && __builtin_sub_overflow(s[i], s[0], &v)) {
            PyErr_SetString(PyExc_ValueError, "sends: a difference outside int64");
            Py_CLEAR(bytes);
            break;
        }
        PyObject *item = PyLong_FromLongLong(v);
        if (!item)
            Py_CLEAR(bytes);
        else
            PyTuple_SET_ITEM(i % 2 ? bytes : ns, i / 2, item);
    }
    PyMem_Free(s);
    if (!bytes) {
        Py_XDECREF(ns);
        return n ? -1 : 0;
    }
    return add_new(r, R_SENDS_NS, ns) || add_new(r, R_SENDS_BYTES, bytes);
}

/* The values of `_ROOT_KEYS`, in its order (`request_attributes`'s first `present`). */
static int add_request_values(RootAttrs *r, PyObject **rec, PyObject **o, PyObject **h, const long long *p,
                              Py_ssize_t waits, PyObject *const *texts, long long offset_ns) {
    PyObject *status = or_else(o[O_STATUS], h[H_STATUS]);
    PyObject *finish = or_else(or_else(o[O_FINISH_REASON], rec[RR_FINISH_REASON]), Py_None);
    long long tokens, cached = 0, prefill_first, inference, received_wall, end_wall, e2e, ttft = 0;
    int first = p[P_FIRST_TOKEN] != 0;
    double tpot = 0;
    if (o[O_OUTPUT_TOKENS] != Py_None ? int64_of(o[O_OUTPUT_TOKENS], &tokens, "output_tokens")
                                      : sum_ok(first, first ? p[P_DECODE_TOKENS] : 0, &tokens))
        return -1;
    int has_tpot = first && tokens > 1; /* spans.tpot_ns */
    if ((has_tpot && true_div(p[P_DECODE], tokens - 1, &tpot)) || (first && diff_ok(p[P_FIRST_TOKEN], p[P_RECEIVED], &ttft)) ||
        sum_ok(p[P_PREFILL], p[P_FIRST_TOKEN_PHASE], &prefill_first) || sum_ok(prefill_first, p[P_DECODE], &inference) ||
        sum_ok(p[P_RECEIVED], offset_ns, &received_wall) || sum_ok(p[P_END], offset_ns, &end_wall) ||
        diff_ok(p[P_END], p[P_RECEIVED], &e2e))
        return -1;
    if (received_wall < 0 || end_wall < 0) {
        PyErr_SetString(PyExc_ValueError, "root span: a wall-clock time before 1970");
        return -1;
    }
    if (!truthy(o[O_CACHED])) {
        Py_ssize_t n;
        long long *chunks = int64_array(rec[RR_CHUNKS], &n);
        if (!chunks)
            return -1;
        for (Py_ssize_t i = 3; i < n && !sum_ok(cached, chunks[i], &cached); i += 4)
            ;
        PyMem_Free(chunks);
        if (PyErr_Occurred())
            return -1;
    }
    add_obj(r, R_PROVIDER, texts[T_PROVIDER]);
    add_obj(r, R_METHOD, or_else(h[H_METHOD], Py_None));
    add_obj(r, R_PATH, or_else(h[H_PATH], Py_None));
    add_obj(r, R_STATUS, status);
    add_obj(r, R_ADDRESS, h[H_ADDRESS]);
    add_obj(r, R_PORT, h[H_PORT]);
    if (truthy(h[H_X_REQUEST_ID]) && add_new(r, R_X_REQUEST_ID, PyTuple_Pack(1, h[H_X_REQUEST_ID])))
        return -1;
    add_obj(r, R_ERROR_TYPE, texts[T_ERROR_TYPE]);
    add_ms(r, R_INGRESS_MS, p[P_INGRESS]);
    add_ms(r, R_QUEUE_MS, p[P_QUEUE]);
    add_ms(r, R_PREFILL_MS, p[P_PREFILL]);
    add_ms(r, R_FIRST_TOKEN_MS, p[P_FIRST_TOKEN_PHASE]);
    add_ms(r, R_DECODE_MS, p[P_DECODE]);
    add_ms(r, R_DELIVERY_MS, p[P_DELIVERY]);
    if (first)
        add_ms(r, R_TTFT_MS, ttft);
    if (has_tpot)
        add_scalar(r, R_TPOT_MS, (Scalar){V_DOUBLE, 0, tpot / 1e6});
    add_int(r, R_PREEMPTIONS, waits > 1 ? waits - 1 : 0);
    add_obj(r, R_FINISH_REASON, finish);
    add_obj(r, R_DISCONNECTED, h[H_DISCONNECTED]);
    add_int(r, R_RECEIVED_WALL, received_wall);
    add_int(r, R_RESPONDED_WALL, end_wall);
    if (finish != Py_None && add_new(r, R_FINISH_REASONS, PyTuple_Pack(1, finish)))
        return -1;
    if (o[O_OUTPUT_TOKENS] != Py_None)
        add_obj(r, R_OUTPUT_TOKENS, o[O_OUTPUT_TOKENS]);
    else
        add_int(r, R_OUTPUT_TOKENS, tokens);
    if (truthy(o[O_CACHED]))
        add_obj(r, R_CACHE_READ, o[O_CACHED]);
    else
        add_int(r, R_CACHE_READ, cached);
    add_obj(r, R_REASONING, o[O_REASONING]);
    add_scalar(r, R_LAT_QUEUE, (Scalar){V_DOUBLE, 0, (double)p[P_QUEUE] / 1e9});
    if (first)
        add_scalar(r, R_LAT_TTFT, (Scalar){V_DOUBLE, 0, (double)ttft / 1e9});
    add_scalar(r, R_LAT_E2E, (Scalar){V_DOUBLE, 0, (double)e2e / 1e9});
    add_scalar(r, R_LAT_PREFILL, (Scalar){V_DOUBLE, 0, (double)prefill_first / 1e9});
    add_scalar(r, R_LAT_DECODE, (Scalar){V_DOUBLE, 0, (double)p[P_DECODE] / 1e9});
    add_scalar(r, R_LAT_INFERENCE, (Scalar){V_DOUBLE, 0, (double)inference / 1e9});
    return 0;
}

/* The rest of `request_attributes` (info, content, first chunk, sends, inbound), then
 * phaselens.trace.full and the summary (a dict or None), in `root_span`'s order. */
static int add_more_values(RootAttrs *r, PyObject **rec, PyObject *phases, const long long *p, PyObject *const *texts,
                           PyObject *summary) {
    PyObject *info = rec[RR_INFO];
    if (info != Py_None) {
        static const int INFO_ORDER[12] = {0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9}; /* RequestInfo's fields */
        if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 10) {
            PyErr_SetString(PyExc_TypeError, "record.info: expected a RequestInfo");
            return -1;
        }
        for (int i = 0; i < 12; i++)
            add_obj(r, R_INFO + i, PyTuple_GET_ITEM(info, INFO_ORDER[i]));
    }
    add_obj(r, R_INPUT_MESSAGES, texts[T_INPUT_MESSAGES]);
    add_obj(r, R_OUTPUT_MESSAGES, texts[T_OUTPUT_MESSAGES]);
    if (p[P_FIRST_CHUNK]) {
        add_ms(r, R_FIRST_CHUNK_MS, p[P_FIRST_CHUNK_PHASE]);
        PyObject *known = phase_field(phases, P_HELD_BACK_KNOWN);
        int is_known = known ? PyObject_IsTrue(known) : -1;
        Py_XDECREF(known);
        if (is_known < 0)
            return -1;
        if (is_known) {
            add_ms(r, R_HELD_BACK_MS, p[P_HELD_BACK]);
            if (add_new(r, R_HELD_BACK_TOKENS, phase_field(phases, P_HELD_BACK_TOKENS)))
                return -1;
        }
        long long ttfc, last_chunk;
        add_ms(r, R_LOOP_WAIT_MS, p[P_LOOP_WAIT]);
        add_ms(r, R_ENCODE_MS, p[P_ENCODE]);
        add_ms(r, R_WRITE_MS, p[P_WRITE]);
        if (diff_ok(p[P_FIRST_CHUNK], p[P_RECEIVED], &ttfc) || diff_ok(p[P_LAST_CHUNK], p[P_RECEIVED], &last_chunk))
            return -1;
        add_ms(r, R_TTFC_MS, ttfc);
        add_ms(r, R_LAST_CHUNK_MS, last_chunk);
    }
    int has_sends = PyObject_IsTrue(rec[RR_SENDS]);
    if (has_sends < 0 || (has_sends && add_sends(r, rec[RR_SENDS])))
        return -1;
    if (p[P_READ]) {
        long long inbound;
        add_ms(r, R_DISPATCH_MS, p[P_DISPATCH]);
        if (p[P_ARRIVED]) {
            if (diff_ok(p[P_RECEIVED], p[P_ARRIVED], &inbound))
                return -1;
            add_ms(r, R_INBOUND_MS, inbound);
            add_ms(r, R_KERNEL_WAIT_MS, p[P_KERNEL_WAIT]);
        }
    }
    if (add_new(r, R_TRACE_FULL, Py_NewRef(texts[T_FULL])))
        return -1;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (summary != Py_None && PyDict_Next(summary, &pos, &key, &value)) {
        if (!PyUnicode_Check(key) || !PyUnicode_GET_LENGTH(key)) {
            PyErr_SetString(PyExc_TypeError, "summary: expected non-empty str keys");
            return -1;
        }
        r->a[r->n++] = (RootAttr){-1, key, Py_NewRef(value), {V_INT, 0, 0}};
    }
    return 0;
}

/* `spans.error_type`: what the app said, else what the transport or engine saw; a new reference. */
static PyObject *error_type_of(PyObject **rec, PyObject **o, PyObject **h, PyObject *const *c) {
    PyObject *status = or_else(o[O_STATUS], h[H_STATUS]);
    if (truthy(o[O_ERROR_TYPE]))
        return Py_NewRef(o[O_ERROR_TYPE]);
    if (truthy(h[H_DISCONNECTED]))
        return Py_NewRef(c[C_DISCONNECTED]);
    if (truthy(h[H_EXCEPTION]))
        return Py_NewRef(h[H_EXCEPTION]);
    int failed = status != Py_None ? PyObject_RichCompareBool(status, http_error_min, Py_GE) : 0;
    if (failed)
        return failed < 0 ? NULL : PyObject_Str(status);
    int errored = PyObject_RichCompareBool(rec[RR_FINISH_REASON], c[C_FINISH_ERROR], Py_EQ);
    return errored < 0 ? NULL : Py_NewRef(errored ? c[C_FINISH_ERROR] : Py_None);
}

/* `spans.root_name`: "{operation} {model}" (as an f-string formats them), else the method or
 * C_UNNAMED; a new reference. */
static PyObject *root_name_of(PyObject **rec, PyObject **h, PyObject *const *c) {
    PyObject *info = rec[RR_INFO];
    if (info == Py_None)
        return Py_NewRef(or_else(h[H_METHOD], c[C_UNNAMED]));
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 10) {
        PyErr_SetString(PyExc_TypeError, "record.info: expected a RequestInfo");
        return NULL;
    }
    PyObject *operation = PyObject_Format(PyTuple_GET_ITEM(info, 0), NULL);
    PyObject *model = operation ? PyObject_Format(PyTuple_GET_ITEM(info, 1), NULL) : NULL;
    PyObject *name = model ? PyUnicode_FromFormat("%U %U", operation, model) : NULL;
    Py_XDECREF(operation);
    Py_XDECREF(model);
    return name;
}

/* The attributes, the last `limits->attributes` of them kept (as put_attributes keeps a dict's). */
static int put_root_attributes(Buf *b, const RootAttrs *r, PyObject *keys, const Limits *limits) {
    Py_ssize_t max = limits->attributes, first = (max >= 0 && r->n > max) ? r->n - max : 0;
    for (Py_ssize_t i = first; i < r->n; i++) {
        const RootAttr *a = &r->a[i];
        PyObject *key = a->key >= 0 ? PyTuple_GET_ITEM(keys, a->key) : a->name;
        int failed = a->obj ? put_key_value(b, 9, key, a->obj, limits->attribute_length)
                            : put_scalar_key_value(b, 9, key, &a->v) == -1;
        if (failed)
            return -1;
    }
    return put_dropped(b, 10, first);
}

/* The span around them, as put_span writes the description (a SERVER span, no events or links). */
static PyObject *root_entry(Buf *b, PyObject **rec, const RootAttrs *r, const long long *p, long long offset_ns,
                            PyObject *const *texts, PyObject *keys, const Limits *limits) {
    PyObject *root = rec[RR_ROOT], *parent = rec[RR_PARENT], *failure = texts[T_ERROR_TYPE];
    if (!PyTuple_Check(root) || PyTuple_GET_SIZE(root) != 4 ||
        (parent != Py_None && (!PyTuple_Check(parent) || PyTuple_GET_SIZE(parent) != 4))) {
        PyErr_SetString(PyExc_TypeError, "record.root and record.parent: expected SpanIds");
        return NULL;
    }
    int failed = truthy(failure);
    uint64_t start = (uint64_t)(p[P_RECEIVED] + offset_ns), end = (uint64_t)(p[P_END] + offset_ns); /* in [0, 2**63): add_request_values */
    size_t status;
    begin_entry(b);
    if (put_id(b, 1, PyTuple_GET_ITEM(root, 0), 16, "trace_id") || put_id(b, 2, PyTuple_GET_ITEM(root, 1), 8, "span_id") ||
        put_str_field(b, 3, PyTuple_GET_ITEM(root, 3), "trace_state") ||
        (parent != Py_None && put_id(b, 4, PyTuple_GET_ITEM(parent, 1), 8, "parent_id")) ||
        put_str_field(b, 5, texts[T_NAME], "name") || put_tag(b, 6, VARINT) || put_varint(b, 2 /* SERVER */) ||
        (start && put_fixed(b, 7, start, 8)) || (end && put_fixed(b, 8, end, 8)) ||
        put_root_attributes(b, r, keys, limits) || open_message(b, 15, &status) ||
        (failed && put_str_field(b, 2, failure, "status_message")) ||
        (failed && (put_tag(b, 3, VARINT) || put_varint(b, 2 /* ERROR */))) || close_message(b, status) ||
        put_fixed(b, 16, FLAGS_HAS_IS_REMOTE | (parent != Py_None ? FLAGS_IS_REMOTE : 0), 4))
        return NULL;
    return entry_bytes(b);
}

static int phase_ints(PyObject *phases, long long *p, Py_ssize_t *waits) {
    if ((PyObject *)Py_TYPE(phases) != offsets_type)
        find_offsets(Py_TYPE(phases));
    for (int i = 0; i < PHASE_INTS; i++) {
        PyObject *v = phase_field(phases, i);
        int r = !v || int64_of(v, &p[i], PHASE_FIELD_NAMES[i]);
        Py_XDECREF(v);
        if (r)
            return -1;
    }
    PyObject *w = phase_field(phases, P_WAITS);
    *waits = w ? PyObject_Length(w) : -1;
    Py_XDECREF(w);
    return *waits < 0 ? -1 : 0;
}

/* encode_root(record, phases, offset_ns, texts, summary, keys, constants, limits) -> bytes; METH_FASTCALL.
 * texts: (phaselens.trace.full, gen_ai.input.messages, gen_ai.output.messages), the messages None
 * unless captured; constants: `spans.ROOT_SPAN_CONSTANTS`. */
static PyObject *encode_root(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "encode_root: expected 8 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *record = args[0], *given = args[3], *summary = args[4], *keys = args[5], *constants = args[6];
    Limits limits;
    long long offset_ns, p[PHASE_INTS];
    Py_ssize_t waits;
    if (limits_of(args[7], &limits) || str_tuple(keys, ROOT_KEYS, "keys") || int64_of(args[2], &offset_ns, "offset_ns"))
        return NULL;
    if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) < RR_FIELDS || !PyTuple_Check(given) ||
        PyTuple_GET_SIZE(given) != 3 || (summary != Py_None && !PyDict_Check(summary)) ||
        str_tuple(constants, CONSTANTS, "constants")) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "encode_root: expected a RequestRecord, 3 texts, a dict or None and %d constants",
                     CONSTANTS);
        return NULL;
    }
    PyObject **rec = &PyTuple_GET_ITEM(record, 0), *outcome = rec[RR_OUTCOME], *http = rec[RR_HTTP];
    if (!PyTuple_Check(outcome) || PyTuple_GET_SIZE(outcome) < O_FIELDS || !PyTuple_Check(http) ||
        PyTuple_GET_SIZE(http) < H_FIELDS) {
        PyErr_SetString(PyExc_TypeError, "record.outcome and record.http: expected a RequestOutcome and HttpFacts");
        return NULL;
    }
    if (phase_ints(args[1], p, &waits))
        return NULL;
    PyObject **o = &PyTuple_GET_ITEM(outcome, 0), **h = &PyTuple_GET_ITEM(http, 0), *const *c = &PyTuple_GET_ITEM(constants, 0);
    PyObject *name = root_name_of(rec, h, c), *failure = name ? error_type_of(rec, o, h, c) : NULL;
    PyObject *t[TEXTS] = {name, c[C_PROVIDER], failure, PyTuple_GET_ITEM(given, 0), PyTuple_GET_ITEM(given, 1),
                          PyTuple_GET_ITEM(given, 2)};
    Py_ssize_t most = ROOT_KEYS + (summary != Py_None ? PyDict_GET_SIZE(summary) : 0);
    RootAttrs r = {failure ? PyMem_New(RootAttr, most) : NULL, 0};
    PyObject *out = NULL;
    if (!r.a && !PyErr_Occurred())
        PyErr_NoMemory();
    if (r.a && !add_request_values(&r, rec, o, h, p, waits, t, offset_ns) && !add_more_values(&r, rec, args[1], p, t, summary)) {
        Buf b;
        buf_init(&b);
        out = root_entry(&b, rec, &r, p, offset_ns, t, keys, &limits);
        buf_free(&b);
    }
    for (Py_ssize_t i = 0; i < r.n; i++)
        Py_XDECREF(r.a[i].obj);
    PyMem_Free(r.a);
    Py_XDECREF(name);
    Py_XDECREF(failure);
    return out;
}

static PyObject *encode_spans(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *spans, *limits_tuple;
    Limits limits;
    if (!PyArg_ParseTuple(args, "OO:encode_spans", &spans, &limits_tuple) || limits_of(limits_tuple, &limits))
        return NULL;
    PyObject *seq = PySequence_Fast(spans, "spans: expected a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    Buf b;
    buf_init(&b);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        begin_entry(&b);
        PyObject *encoded = NULL;
        if (!put_span(&b, PySequence_Fast_GET_ITEM(seq, i), &limits))
            encoded = entry_bytes(&b);
        if (!encoded)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, i, encoded);
    }
    buf_free(&b);
    Py_DECREF(seq);
    return out;
}

/* Written once into the result: the resource and scope messages first, so every length is known
 * before the spans are copied (no buffer growth, no body moved for a longer length prefix). */
static PyObject *encode_request(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *resource, *scope_name, *scope_version, *spans, *out = NULL;
    if (!PyArg_ParseTuple(args, "OUUO:encode_request", &resource, &scope_name, &scope_version, &spans))
        return NULL;
    PyObject *seq = PySequence_Fast(spans, "spans: expected a sequence of bytes");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    size_t spans_len = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "spans: expected bytes from encode_spans");
            Py_DECREF(seq);
            return NULL;
        }
        spans_len += (size_t)PyBytes_GET_SIZE(item);
    }
    Buf parts, head; /* parts: Resource (field 1 of ResourceSpans), then InstrumentationScope */
    buf_init(&parts);
    buf_init(&head);
    size_t res, scope;
    int r = open_message(&parts, 1, &res) || put_attributes(&parts, 1, resource, -1, -1) < 0 ||
            close_message(&parts, res);
    size_t resource_len = parts.len;
    r = r || open_message(&parts, 1, &scope) || put_str_field(&parts, 1, scope_name, "scope name") ||
        put_str_field(&parts, 2, scope_version, "scope version") || close_message(&parts, scope);
    size_t scope_spans = parts.len - resource_len + spans_len;
    size_t resource_spans = resource_len + 1 + varint_len(scope_spans) + scope_spans;
    r = r || put_tag(&head, 1, LEN) || put_varint(&head, resource_spans) || put(&head, parts.data, resource_len) ||
        put_tag(&head, 2, LEN) || put_varint(&head, scope_spans) ||
        put(&head, parts.data + resource_len, parts.len - resource_len);
    if (!r && (out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(head.len + spans_len)))) {
        char *p = PyBytes_AS_STRING(out);
        memcpy(p, head.data, head.len);
        p += head.len;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            memcpy(p, PyBytes_AS_STRING(item), (size_t)PyBytes_GET_SIZE(item));
            p += PyBytes_GET_SIZE(item);
        }
    }
    buf_free(&parts);
    buf_free(&head);
    Py_DECREF(seq);
    return out;
}

static PyObject *present(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "present(keys, values[, into]): 2 or 3 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *values = args[1], *into = nargs == 3 ? args[2] : NULL;
    if (!PyTuple_Check(keys) || !PyTuple_Check(values) || (into && !PyDict_Check(into))) {
        PyErr_SetString(PyExc_TypeError, "present: keys and values tuples, into a dict");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "present: %zd keys, %zd values", n, PyTuple_GET_SIZE(values));
        return NULL;
    }
    PyObject *out = into ? Py_NewRef(into) : PyDict_New();
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *value = PyTuple_GET_ITEM(values, i);
        if (value != Py_None && PyDict_SetItem(out, PyTuple_GET_ITEM(keys, i), value) < 0)
            Py_CLEAR(out);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"encode_spans", encode_spans, METH_VARARGS,
     "encode_spans(spans, limits) -> list[bytes]: one ScopeSpans.spans entry per SpanData."},
    {"encode_step", (PyCFunction)(void (*)(void))encode_step, METH_FASTCALL,
     "encode_step(step, trace_id, span_id, start_ns, end_ns, name, keys, limits) -> bytes: an engine step's span."},
    {"encode_steps", (PyCFunction)(void (*)(void))encode_steps, METH_FASTCALL,
     "encode_steps(steps, random_bits, new_ids, offset_ns, name, keys, limits) -> list[bytes]: engine steps' spans."},
    {"encode_phases", (PyCFunction)(void (*)(void))encode_phases, METH_FASTCALL,
     "encode_phases(new_span_id, random_bits, root, offset_ns, stamps, waits, chunks, decode, names, keys, limits) -> "
     "list[bytes]: "
     "a request's phase spans."},
    {"encode_root", (PyCFunction)(void (*)(void))encode_root, METH_FASTCALL,
     "encode_root(record, phases, offset_ns, texts, summary, keys, constants, limits) -> bytes: a request's SERVER span."},
    {"encode_request", encode_request, METH_VARARGS,
     "encode_request(resource_attributes, scope_name, scope_version, spans) -> ExportTraceServiceRequest bytes."},
    {"present", (PyCFunction)(void (*)(void))present, METH_FASTCALL,
     "present(keys, values[, into]) -> dict: the pairs whose value is not None, in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp_encode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlp_encode(void) {
    for (int i = 0; i < PHASE_FIELDS; i++)
        if (!(phase_names[i] = PyUnicode_InternFromString(PHASE_FIELD_NAMES[i])))
            return NULL;
    if (!(http_error_min = PyLong_FromLong(400)))
        return NULL;
    return PyModule_Create(&module);
}
