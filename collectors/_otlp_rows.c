/* ExportTraceServiceRequest bytes -> RowBinary rows of `otel_traces` (schema.INSERT_COLUMNS order),
 * rendered as the OTel Collector's ClickHouse exporter renders them. See collectors/render.py.
 *
 * Why C: a Python decoder spends ~15 us a span building objects that are only serialized again;
 * here a span is read once and written once, and ClickHouse parses RowBinary without a transform.
 *
 * Validation is at least as strict as protobuf's (upb) parser: malformed wire data, a known field
 * with the wrong wire type, invalid UTF-8 in a string field, and invalid ids raise InvalidSpans.
 * Attribute values other than string/bool/int/double/bytes (arrays, maps, merged values) are
 * rendered by a Python callable, `render(payload, any_value)`'s second argument.
 * With a third argument `slots`, rows are split by trace id as a ClickHouse Distributed table
 * sharded by cityHash64(TraceId) splits them: slot = cityHash64(lowercase hex TraceId) mod slots.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { VARINT = 0, I64 = 1, LEN = 2, I32 = 5 };

/* Rows repeat the resource and scope per span: a small request can ask for huge rows (1 MB of
 * resource attributes over 100k tiny spans). Past this a request is refused, not rendered. */
#define MAX_ROWS_BYTES ((size_t)256 << 20)

static PyObject *InvalidSpans;

/* ---------- output buffer ---------- */

typedef struct {
    uint8_t *data;
    size_t len, cap;
} Buf;

static int buf_reserve(Buf *b, size_t extra) {
    if (b->len + extra <= b->cap)
        return 0;
    if (b->len + extra > MAX_ROWS_BYTES) {
        PyErr_Format(InvalidSpans, "its rows would exceed %zu MiB (resource or scope attributes repeated "
                     "over many spans?): send fewer spans per request", MAX_ROWS_BYTES >> 20);
        return -1;
    }
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra)
        cap *= 2;
    uint8_t *data = PyMem_Realloc(b->data, cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int put(Buf *b, const void *p, size_t n) {
    if (n == 0)
        return 0;
    if (buf_reserve(b, n))
        return -1;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

static int put_uleb(Buf *b, uint64_t v) {
    if (buf_reserve(b, 10))
        return -1;
    while (v >= 0x80) {
        b->data[b->len++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    b->data[b->len++] = (uint8_t)v;
    return 0;
}

static int put_u64(Buf *b, uint64_t v) {
    uint8_t le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (uint8_t)(v >> (8 * i));
    return put(b, le, 8);
}

/* RowBinary String: ULEB128 length, then the bytes. */
static int put_str(Buf *b, const void *p, size_t n) {
    return put_uleb(b, n) || put(b, p, n);
}

static int put_cstr(Buf *b, const char *s) { return put_str(b, s, strlen(s)); }

static int put_hex(Buf *b, const uint8_t *p, size_t n) {
    static const char digits[] = "0123456789abcdef";
    if (put_uleb(b, 2 * n) || buf_reserve(b, 2 * n))
        return -1;
    for (size_t i = 0; i < n; i++) {
        b->data[b->len++] = digits[p[i] >> 4];
        b->data[b->len++] = digits[p[i] & 15];
    }
    return 0;
}

/* ---------- wire reading ---------- */

typedef struct {
    const uint8_t *p, *end;
} Slice;

typedef struct {
    uint32_t num;
    int wire;
    uint64_t v;  /* VARINT, I64, I32 */
    Slice s;     /* LEN */
} Field;

static int invalid(const char *message) {
    PyErr_SetString(InvalidSpans, message);
    return -1;
}

static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*p >= end)
            return invalid("truncated varint");
        uint8_t byte = *(*p)++;
        v |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) {
            *out = v;
            return 0;
        }
    }
    return invalid("varint longer than 10 bytes");
}

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Reads the next field of `c`: 1, 0 at its end, -1 with InvalidSpans set. */
static int next_field(Slice *c, Field *f) {
    if (c->p >= c->end)
        return 0;
    uint64_t tag;
    if (read_varint(&c->p, c->end, &tag))
        return -1;
    if (tag > 0xFFFFFFFFu)
        return invalid("field number out of range");
    f->num = (uint32_t)(tag >> 3);
    f->wire = (int)(tag & 7);
    if (f->num == 0)
        return invalid("field number 0");
    switch (f->wire) {
    case VARINT:
        return read_varint(&c->p, c->end, &f->v) ? -1 : 1;
    case I64:
        if (c->end - c->p < 8)
            return invalid("truncated fixed64");
        f->v = le64(c->p);
        c->p += 8;
        return 1;
    case I32:
        if (c->end - c->p < 4)
            return invalid("truncated fixed32");
        f->v = (uint64_t)c->p[0] | (uint64_t)c->p[1] << 8 | (uint64_t)c->p[2] << 16 | (uint64_t)c->p[3] << 24;
        c->p += 4;
        return 1;
    case LEN: {
        uint64_t n;
        if (read_varint(&c->p, c->end, &n))
            return -1;
        if (n > (uint64_t)(c->end - c->p))
            return invalid("length-delimited field runs past its message");
        f->s.p = c->p;
        f->s.end = c->p + n;
        c->p += n;
        return 1;
    }
    default:
        return invalid("unsupported wire type");
    }
}

static int expect(const Field *f, int wire, const char *what) {
    if (f->wire == wire)
        return 0;
    PyErr_Format(InvalidSpans, "%s: wrong wire type %d", what, f->wire);
    return -1;
}

/* Strict UTF-8 as protobuf requires of string fields: no overlongs, surrogates, or > U+10FFFF. */
static int utf8_ok(Slice s) {
    const uint8_t *p = s.p;
    while (p < s.end) {
        uint8_t c = *p;
        if (c < 0x80) {
            p++;
            continue;
        }
        size_t left = (size_t)(s.end - p);
        if (c >= 0xC2 && c <= 0xDF && left >= 2 && (p[1] & 0xC0) == 0x80) {
            p += 2;
        } else if (c >= 0xE0 && c <= 0xEF && left >= 3 && (p[1] & 0xC0) == 0x80 && (p[2] & 0xC0) == 0x80 &&
                   !(c == 0xE0 && p[1] < 0xA0) && !(c == 0xED && p[1] >= 0xA0)) {
            p += 3;
        } else if (c >= 0xF0 && c <= 0xF4 && left >= 4 && (p[1] & 0xC0) == 0x80 && (p[2] & 0xC0) == 0x80 &&
                   (p[3] & 0xC0) == 0x80 && !(c == 0xF0 && p[1] < 0x90) && !(c == 0xF4 && p[1] >= 0x90)) {
            p += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static int text(const Field *f, const char *what, Slice *out) {
    if (expect(f, LEN, what))
        return -1;
    if (!utf8_ok(f->s)) {
        PyErr_Format(InvalidSpans, "%s: invalid UTF-8", what);
        return -1;
    }
    *out = f->s;
    return 0;
}

/* A message whose fields 1..`strings` are strings: checked, not kept (EntityRef). */
static int check_strings_message(Slice s, uint32_t strings, const char *what) {
    Field f;
    Slice ignored;
    int r;
    while ((r = next_field(&s, &f)) > 0)
        if (f.num <= strings && text(&f, what, &ignored))
            return -1;
    return r;
}

/* ---------- growable arrays of slices ---------- */

typedef struct {
    Slice *items;
    size_t len, cap;
} Slices;

static int slices_add(Slices *a, Slice s) {
    if (a->len == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 16;
        Slice *items = PyMem_Realloc(a->items, cap * sizeof(Slice));
        if (!items) {
            PyErr_NoMemory();
            return -1;
        }
        a->items = items;
        a->cap = cap;
    }
    a->items[a->len++] = s;
    return 0;
}

/* ---------- attribute values ---------- */

typedef struct {
    PyObject *any_value; /* Python callable: AnyValue bytes -> str */
    Buf scratch;         /* rendered values of the map being built */
    Slices kvs;          /* attributes of the resource, then of each span */
    Slices events, links; /* of the span being read */
    Slices spans;        /* of the scope being read */
    Slices nested_kvs;   /* attributes of one scope, event or link */
    Buf resource;        /* the current resource's attributes, rendered once */
    Slice service;       /* within `resource` */
    size_t slots;        /* 0: one output; else rows go to out[slot of their trace id] */
} Ctx;

/* The shortest digits that read back as |x| (Python's repr, as Go's strconv chooses them), without
 * leading or trailing zeros: |x| = 0.d1d2..dn * 10^decimal. */
static int shortest_digits(double x, char digits[32], int *n, int *decimal) {
    char *repr = PyOS_double_to_string(fabs(x), 'r', 0, 0, NULL);
    if (!repr)
        return -1;
    int count = 0, point = -1, exp10 = 0;
    const char *p = repr;
    for (; *p && *p != 'e'; p++) {
        if (*p == '.')
            point = count;
        else if (count < 31)
            digits[count++] = *p;
    }
    if (*p == 'e')
        exp10 = atoi(p + 1);
    PyMem_Free(repr);
    int lead = 0;
    while (lead < count - 1 && digits[lead] == '0')
        lead++;
    *decimal = (point < 0 ? count : point) + exp10 - lead;
    memmove(digits, digits + lead, (size_t)(count - lead));
    count -= lead;
    while (count > 1 && digits[count - 1] == '0')
        count--;
    if (count == 1 && digits[0] == '0')
        *decimal = 1;
    *n = count;
    return 0;
}

/* Go's strconv 'f'/'e' choice as encoding/json writes a float64 (ES6): shortest round-trip digits,
 * exponent form when |x| < 1e-6 or |x| >= 1e21, exponent without leading zeros ("1e-7", "1e+21"). */
static int put_go_float(Buf *out, double x) {
    if (isnan(x))
        return put(out, "json: unsupported value: NaN", 28);
    if (isinf(x))
        return put(out, x > 0 ? "json: unsupported value: +Inf" : "json: unsupported value: -Inf", 29);
    char digits[32], text[64];
    int n, decimal, t = 0;
    if (shortest_digits(x, digits, &n, &decimal))
        return -1;
    if (signbit(x))
        text[t++] = '-';
    double magnitude = fabs(x);
    if (magnitude != 0 && (magnitude < 1e-6 || magnitude >= 1e21)) {
        text[t++] = digits[0];
        if (n > 1) {
            text[t++] = '.';
            memcpy(text + t, digits + 1, (size_t)(n - 1));
            t += n - 1;
        }
        t += snprintf(text + t, sizeof text - (size_t)t, "e%+d", decimal - 1);
    } else if (decimal <= 0) {
        memcpy(text + t, "0.00000", (size_t)(2 - decimal)); /* decimal >= -5 here */
        t += 2 - decimal;
        memcpy(text + t, digits, (size_t)n);
        t += n;
    } else {
        for (int i = 0; i < decimal; i++)
            text[t++] = i < n ? digits[i] : '0';
        if (n > decimal) {
            text[t++] = '.';
            memcpy(text + t, digits + decimal, (size_t)(n - decimal));
            t += n - decimal;
        }
    }
    return put(out, text, (size_t)t);
}

static int put_base64(Buf *out, Slice s) {
    static const char table[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t n = (size_t)(s.end - s.p);
    if (buf_reserve(out, (n + 2) / 3 * 4))
        return -1;
    uint8_t *o = out->data + out->len;
    const uint8_t *p = s.p;
    for (; n >= 3; n -= 3, p += 3) {
        uint32_t v = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2];
        *o++ = table[v >> 18], *o++ = table[(v >> 12) & 63], *o++ = table[(v >> 6) & 63], *o++ = table[v & 63];
    }
    if (n) {
        uint32_t v = (uint32_t)p[0] << 16 | (n == 2 ? (uint32_t)p[1] << 8 : 0);
        *o++ = table[v >> 18], *o++ = table[(v >> 12) & 63];
        *o++ = n == 2 ? table[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    out->len = (size_t)(o - out->data);
    return 0;
}

/* An AnyValue of exactly one string/bool/int/double/bytes field, rendered here: 1 done, 0 not
 * that shape (the caller asks Python), -1 error. */
static int put_scalar_value(Buf *out, Slice raw) {
    Slice c = raw;
    Field f;
    int r = next_field(&c, &f);
    if (r <= 0 || c.p != c.end)
        return r < 0 ? -1 : 0;
    char number[24];
    switch (f.num << 3 | (uint32_t)f.wire) {
    case 1 << 3 | LEN: {
        Slice s;
        return text(&f, "AnyValue.string_value", &s) || put(out, s.p, (size_t)(s.end - s.p)) ? -1 : 1;
    }
    case 2 << 3 | VARINT:
        return put(out, f.v ? "true" : "false", f.v ? 4 : 5) ? -1 : 1;
    case 3 << 3 | VARINT:
        return put(out, number, (size_t)snprintf(number, sizeof number, "%lld", (long long)(int64_t)f.v)) ? -1 : 1;
    case 4 << 3 | I64: {
        double d;
        memcpy(&d, &f.v, 8);
        return put_go_float(out, d) ? -1 : 1;
    }
    case 7 << 3 | LEN:
        return put_base64(out, f.s) ? -1 : 1;
    }
    return 0;
}

static int put_python_value(Ctx *ctx, Buf *out, const uint8_t *raw, size_t n) {
    PyObject *text = PyObject_CallFunction(ctx->any_value, "y#", (const char *)raw, (Py_ssize_t)n);
    if (!text)
        return -1;
    Py_ssize_t size;
    const char *utf8 = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &size) : NULL;
    int r = utf8 ? put(out, utf8, (size_t)size) : -1;
    if (!utf8 && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "any_value must return str");
    Py_DECREF(text);
    return r;
}

typedef struct {
    Slice key;
    size_t value_at, value_len; /* in ctx->scratch */
} Entry;

/* Key and value of one KeyValue. Several `value` occurrences are merged, as protobuf does: their
 * concatenation, collected in `merged`, is the merged AnyValue. */
static int read_key_value(Slice raw, Slice *key, Slice *value, Buf *merged) {
    Field f;
    int r, values = 0;
    *key = *value = (Slice){raw.p, raw.p};
    while ((r = next_field(&raw, &f)) > 0) {
        if (f.num == 1 && text(&f, "KeyValue.key", key))
            return -1;
        if (f.num == 3 && expect(&f, VARINT, "KeyValue.key_strindex"))
            return -1;
        if (f.num != 2)
            continue;
        if (expect(&f, LEN, "KeyValue.value"))
            return -1;
        if (++values == 2 && put(merged, value->p, (size_t)(value->end - value->p)))
            return -1;
        if (values >= 2 && put(merged, f.s.p, (size_t)(f.s.end - f.s.p)))
            return -1;
        *value = f.s;
    }
    return r;
}

/* One KeyValue: key checked, value rendered onto ctx->scratch (by Python if merged or not a scalar). */
static int render_key_value(Ctx *ctx, Slice raw, Entry *entry) {
    Slice value;
    Buf merged = {0};
    int r = read_key_value(raw, &entry->key, &value, &merged);
    entry->value_at = ctx->scratch.len;
    if (r == 0 && merged.len)
        r = put_python_value(ctx, &ctx->scratch, merged.data, merged.len);
    else if (r == 0 && value.p != value.end && (r = put_scalar_value(&ctx->scratch, value)) == 0)
        r = put_python_value(ctx, &ctx->scratch, value.p, (size_t)(value.end - value.p));
    PyMem_Free(merged.data);
    entry->value_len = ctx->scratch.len - entry->value_at;
    return r < 0 ? -1 : 0;
}

/* Where a key already is among a map's entries. Linear for small maps; a hash index above
 * SMALL_MAP entries, so that a span with a million attributes is not a trillion comparisons. */
#define SMALL_MAP 64

typedef struct {
    uint32_t *slots; /* entry index + 1; 0 = empty */
    size_t mask;
} KeyIndex;

static int same_key(const Entry *e, Slice key) {
    size_t n = (size_t)(key.end - key.p);
    return (size_t)(e->key.end - e->key.p) == n && memcmp(e->key.p, key.p, n) == 0;
}

/* The entry holding `key`, or `count` (and, with an index, its slot taken) when it is new. */
static size_t find_key(const Entry *entries, size_t count, Slice key, KeyIndex *index) {
    if (!index->slots) {
        size_t k = 0;
        while (k < count && !same_key(&entries[k], key))
            k++;
        return k;
    }
    uint64_t h = 1469598103934665603u; /* FNV-1a */
    for (const uint8_t *p = key.p; p < key.end; p++)
        h = (h ^ *p) * 1099511628211u;
    for (size_t i = h & index->mask;; i = (i + 1) & index->mask) {
        uint32_t slot = index->slots[i];
        if (slot == 0) {
            index->slots[i] = (uint32_t)count + 1;
            return count;
        }
        if (same_key(&entries[slot - 1], key))
            return slot - 1;
    }
}

/* A Map(String, String) from KeyValue slices: a repeated key keeps its first place, last value.
 * `service`, when given, receives where in `out` the value of `service.name` lies (start, end). */
static int put_map(Ctx *ctx, Buf *out, const Slice *kvs, size_t n, size_t service[2]) {
    Entry stack[SMALL_MAP], *entries = n <= SMALL_MAP ? stack : PyMem_Malloc(n * sizeof(Entry));
    KeyIndex index = {NULL, 0};
    if (n > SMALL_MAP) {
        size_t slots = 2 * SMALL_MAP;
        while (slots < 2 * n)
            slots *= 2;
        index.slots = PyMem_Calloc(slots, sizeof(uint32_t));
        index.mask = slots - 1;
    }
    size_t count = 0;
    int r = entries && (n <= SMALL_MAP || index.slots) ? 0 : (PyErr_NoMemory(), -1);
    ctx->scratch.len = 0;
    for (size_t i = 0; i < n && r == 0; i++) {
        Entry e;
        if ((r = render_key_value(ctx, kvs[i], &e)))
            break;
        size_t k = find_key(entries, count, e.key, &index);
        entries[k] = e;
        count += k == count;
    }
    if (r == 0)
        r = put_uleb(out, count);
    for (size_t k = 0; k < count && r == 0; k++) {
        r = put_str(out, entries[k].key.p, (size_t)(entries[k].key.end - entries[k].key.p)) ||
            put_str(out, ctx->scratch.data + entries[k].value_at, entries[k].value_len);
        if (service && same_key(&entries[k], (Slice){(const uint8_t *)"service.name", (const uint8_t *)"service.name" + 12})) {
            service[0] = out->len - entries[k].value_len;
            service[1] = out->len;
        }
    }
    if (entries != stack)
        PyMem_Free(entries);
    PyMem_Free(index.slots);
    return r;
}

/* ---------- spans ---------- */

static const char *const SPAN_KINDS[] = {"Unspecified", "Internal", "Server", "Client", "Producer", "Consumer"};
static const char *const STATUS_CODES[] = {"Unset", "Ok", "Error"};

static int check_id(Slice id, size_t size, const char *what, int allow_empty) {
    size_t n = (size_t)(id.end - id.p);
    if (allow_empty && n == 0)
        return 0;
    int nonzero = 0;
    for (size_t i = 0; i < n; i++)
        nonzero |= id.p[i];
    if (n == size && nonzero)
        return 0;
    PyErr_Format(InvalidSpans, "%s must be %zu bytes, not all zero", what, size);
    return -1;
}

typedef struct {
    Slice trace_id, span_id, parent, state, name, status_message;
    int has_trace_id, has_span_id;
    uint64_t kind, start, end, status_code;
} Span;

static int read_status(Slice s, Span *span) {
    Field f;
    int r;
    while ((r = next_field(&s, &f)) > 0) {
        if (f.num == 2 && text(&f, "status.message", &span->status_message))
            return -1;
        if (f.num == 3) {
            if (expect(&f, VARINT, "status.code"))
                return -1;
            span->status_code = f.v;
        }
    }
    return r;
}

/* Span fields 1..16 by number: the wire type each must have (higher numbers are unknown: skipped). */
static const int SPAN_WIRE[17] = {-1, LEN, LEN, LEN, LEN, LEN, VARINT, I64, I64, LEN, VARINT, LEN, VARINT, LEN, VARINT, LEN, I32};

static int read_span(Ctx *ctx, Slice s, Span *span) {
    Field f;
    int r;
    memset(span, 0, sizeof *span);
    ctx->kvs.len = ctx->events.len = ctx->links.len = 0;
    while ((r = next_field(&s, &f)) > 0) {
        if (f.num > 16)
            continue;
        if (f.wire != SPAN_WIRE[f.num]) {
            PyErr_Format(InvalidSpans, "span field %u: wrong wire type %d", f.num, f.wire);
            return -1;
        }
        switch (f.num) {
        case 1: span->trace_id = f.s, span->has_trace_id = 1; break;
        case 2: span->span_id = f.s, span->has_span_id = 1; break;
        case 3: if (text(&f, "span trace_state", &span->state)) return -1; break;
        case 4: span->parent = f.s; break;
        case 5: if (text(&f, "span name", &span->name)) return -1; break;
        case 6: span->kind = f.v; break;
        case 7: span->start = f.v; break;
        case 8: span->end = f.v; break;
        case 9: if (slices_add(&ctx->kvs, f.s)) return -1; break;
        case 11: if (slices_add(&ctx->events, f.s)) return -1; break;
        case 13: if (slices_add(&ctx->links, f.s)) return -1; break;
        case 15: if (read_status(f.s, span)) return -1; break;
        }
    }
    if (r < 0)
        return -1;
    if (!span->has_trace_id)
        return invalid("trace_id is missing");
    if (!span->has_span_id)
        return invalid("span_id is missing");
    return check_id(span->trace_id, 16, "trace_id", 0) || check_id(span->span_id, 8, "span_id", 0) ||
           check_id(span->parent, 8, "parent_span_id", 1);
}

/* Event `raw`: its time, name and attributes (into ctx->nested_kvs). */
static int read_event(Ctx *ctx, Slice raw, uint64_t *time_ns, Slice *name) {
    Field f;
    int r;
    *time_ns = 0;
    *name = (Slice){raw.p, raw.p};
    ctx->nested_kvs.len = 0;
    while ((r = next_field(&raw, &f)) > 0) {
        if (f.num == 1 && (expect(&f, I64, "event time") || (*time_ns = f.v, 0)))
            return -1;
        if (f.num == 2 && text(&f, "event name", name))
            return -1;
        if (f.num == 3 && (expect(&f, LEN, "event attributes") || slices_add(&ctx->nested_kvs, f.s)))
            return -1;
        if (f.num == 4 && expect(&f, VARINT, "event dropped_attributes_count"))
            return -1;
    }
    return r;
}

static int put_events(Ctx *ctx, Buf *out) {
    size_t n = ctx->events.len;
    uint64_t time_ns;
    Slice name;
    if (put_uleb(out, n))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (read_event(ctx, ctx->events.items[i], &time_ns, &name) || put_u64(out, time_ns))
            return -1;
    if (put_uleb(out, n))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (read_event(ctx, ctx->events.items[i], &time_ns, &name) || put_str(out, name.p, (size_t)(name.end - name.p)))
            return -1;
    if (put_uleb(out, n))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (read_event(ctx, ctx->events.items[i], &time_ns, &name) ||
            put_map(ctx, out, ctx->nested_kvs.items, ctx->nested_kvs.len, NULL))
            return -1;
    return 0;
}

/* Link `raw`: column `which` (1 trace id, 2 span id, 3 trace state, 4 attributes) onto `out`. */
static int put_link_column(Ctx *ctx, Buf *out, Slice raw, int which) {
    Field f;
    int r;
    Slice trace_id = {0}, span_id = {0}, state = {raw.p, raw.p};
    int has_trace = 0, has_span = 0;
    ctx->nested_kvs.len = 0;
    while ((r = next_field(&raw, &f)) > 0) {
        if (f.num >= 1 && f.num <= 4 && expect(&f, LEN, "link field"))
            return -1;
        if (f.num == 1 && (check_id(f.s, 16, "link trace_id", 0) || (trace_id = f.s, has_trace = 1, 0)))
            return -1;
        if (f.num == 2 && (check_id(f.s, 8, "link span_id", 0) || (span_id = f.s, has_span = 1, 0)))
            return -1;
        if (f.num == 3 && text(&f, "link trace_state", &state))
            return -1;
        if (f.num == 4 && slices_add(&ctx->nested_kvs, f.s))
            return -1;
        if ((f.num == 5 && expect(&f, VARINT, "link dropped_attributes_count")) || (f.num == 6 && expect(&f, I32, "link flags")))
            return -1;
    }
    if (r < 0)
        return -1;
    if (!has_trace || !has_span)
        return invalid("a link needs a trace_id and a span_id");
    switch (which) {
    case 1: return put_hex(out, trace_id.p, 16);
    case 2: return put_hex(out, span_id.p, 8);
    case 3: return put_str(out, state.p, (size_t)(state.end - state.p));
    default: return put_map(ctx, out, ctx->nested_kvs.items, ctx->nested_kvs.len, NULL);
    }
}

static int put_links(Ctx *ctx, Buf *out) {
    for (int which = 1; which <= 4; which++) {
        if (put_uleb(out, ctx->links.len))
            return -1;
        for (size_t i = 0; i < ctx->links.len; i++)
            if (put_link_column(ctx, out, ctx->links.items[i], which))
                return -1;
    }
    return 0;
}

/* ---------- shard slots: ClickHouse's cityHash64 (CityHash v1.0.2) of a 32-byte string ---------- */

static uint64_t rotate64(uint64_t v, int shift) { return (v >> shift) | (v << (64 - shift)); }

static uint64_t hash_len16(uint64_t u, uint64_t v) {
    const uint64_t mul = 0x9ddfea08eb382d69ULL;
    uint64_t a = (u ^ v) * mul;
    a ^= a >> 47;
    uint64_t b = (v ^ a) * mul;
    b ^= b >> 47;
    return b * mul;
}

/* CityHash64 v1.0.2 for 17..32 bytes (HashLen17to32); a hex trace id is always 32. */
static uint64_t city_hash64_17to32(const uint8_t *s, size_t len) {
    const uint64_t k0 = 0xc3a5c85c97cb3127ULL, k1 = 0xb492b66fbe98f273ULL, k2 = 0x9ae16a3b2f90404fULL,
                   k3 = 0xc949d7c7509e6557ULL;
    uint64_t a = le64(s) * k1, b = le64(s + 8), c = le64(s + len - 8) * k2, d = le64(s + len - 16) * k0;
    return hash_len16(rotate64(a - b, 43) + rotate64(c, 30) + d, a + rotate64(b ^ k3, 20) - c + len);
}

static size_t trace_slot(const Ctx *ctx, Slice trace_id) {
    static const char digits[] = "0123456789abcdef";
    uint8_t hex[32];
    for (size_t i = 0; i < 16; i++)
        hex[2 * i] = (uint8_t)digits[trace_id.p[i] >> 4], hex[2 * i + 1] = (uint8_t)digits[trace_id.p[i] & 15];
    return (size_t)(city_hash64_17to32(hex, sizeof hex) % ctx->slots);
}

static int put_span(Ctx *ctx, Buf *out, Slice raw, Slice scope_name, Slice scope_version) {
    Span s;
    if (read_span(ctx, raw, &s))
        return -1;
    if (ctx->slots)
        out += trace_slot(ctx, s.trace_id);
    /* enums are int32: protobuf keeps the low 32 bits of a longer varint */
    uint32_t kind_number = (uint32_t)s.kind, status_number = (uint32_t)s.status_code;
    const char *kind = kind_number < 6 ? SPAN_KINDS[kind_number] : "";
    const char *status = status_number < 3 ? STATUS_CODES[status_number] : "";
    int r = put_u64(out, s.start) || put_hex(out, s.trace_id.p, 16) || put_hex(out, s.span_id.p, 8) ||
            put_hex(out, s.parent.p, (size_t)(s.parent.end - s.parent.p)) ||
            put_str(out, s.state.p, (size_t)(s.state.end - s.state.p)) ||
            put_str(out, s.name.p, (size_t)(s.name.end - s.name.p)) || put_cstr(out, kind) ||
            put_str(out, ctx->service.p, (size_t)(ctx->service.end - ctx->service.p)) ||
            put(out, ctx->resource.data, ctx->resource.len) ||
            put_str(out, scope_name.p, (size_t)(scope_name.end - scope_name.p)) ||
            put_str(out, scope_version.p, (size_t)(scope_version.end - scope_version.p)) ||
            put_map(ctx, out, ctx->kvs.items, ctx->kvs.len, NULL) ||
            put_u64(out, s.end > s.start ? s.end - s.start : 0) || put_cstr(out, status) ||
            put_str(out, s.status_message.p, (size_t)(s.status_message.end - s.status_message.p));
    return r || put_events(ctx, out) || put_links(ctx, out) ? -1 : 0;
}

/* ---------- scopes and resources ---------- */

/* Name and version over those of an earlier occurrence (protobuf merges repeated messages). */
static int read_scope(Ctx *ctx, Slice s, Slice *name, Slice *version) {
    Field f;
    int r;
    ctx->nested_kvs.len = 0;
    while ((r = next_field(&s, &f)) > 0) {
        if ((f.num == 1 && text(&f, "scope name", name)) || (f.num == 2 && text(&f, "scope version", version)))
            return -1;
        if (f.num == 3 && (expect(&f, LEN, "scope attributes") || slices_add(&ctx->nested_kvs, f.s)))
            return -1;
        if (f.num == 4 && expect(&f, VARINT, "scope dropped_attributes_count"))
            return -1;
    }
    if (r < 0)
        return -1;
    Buf checked = {0}; /* scope attributes are not stored, but protobuf would refuse bad ones */
    r = put_map(ctx, &checked, ctx->nested_kvs.items, ctx->nested_kvs.len, NULL);
    PyMem_Free(checked.data);
    return r;
}

/* The scope may follow its spans on the wire: spans are written once it is known. */
static int put_scope_spans(Ctx *ctx, Buf *out, Slice s, size_t *count) {
    Field f;
    int r;
    Slice name = {s.p, s.p}, version = {s.p, s.p}, url;
    ctx->spans.len = 0;
    while ((r = next_field(&s, &f)) > 0) {
        if (f.num == 1 && (expect(&f, LEN, "scope") || read_scope(ctx, f.s, &name, &version)))
            return -1;
        if (f.num == 2 && (expect(&f, LEN, "span") || slices_add(&ctx->spans, f.s)))
            return -1;
        if (f.num == 3 && text(&f, "scope_spans schema_url", &url))
            return -1;
    }
    if (r < 0)
        return -1;
    for (size_t i = 0; i < ctx->spans.len; i++)
        if (put_span(ctx, out, ctx->spans.items[i], name, version))
            return -1;
    *count += ctx->spans.len;
    return 0;
}

static int read_resource(Ctx *ctx, Slice s) {
    Field f;
    int r;
    while ((r = next_field(&s, &f)) > 0) {
        if (f.num == 1 && (expect(&f, LEN, "resource attributes") || slices_add(&ctx->kvs, f.s)))
            return -1;
        if (f.num == 2 && expect(&f, VARINT, "resource dropped_attributes_count"))
            return -1;
        if (f.num == 3 && (expect(&f, LEN, "resource entity_refs") || check_strings_message(f.s, 4, "entity_ref")))
            return -1;
    }
    return r;
}

static int put_resource_spans(Ctx *ctx, Buf *out, Slice s, size_t *count) {
    Field f;
    int r;
    Slice url, body = s;
    ctx->kvs.len = 0; /* a repeated resource is merged: its attributes are concatenated */
    while ((r = next_field(&s, &f)) > 0) {
        if (f.num == 1 && (expect(&f, LEN, "resource") || read_resource(ctx, f.s)))
            return -1;
        if (f.num == 2 && expect(&f, LEN, "scope_spans"))
            return -1;
        if (f.num == 3 && text(&f, "resource_spans schema_url", &url))
            return -1;
    }
    if (r < 0)
        return -1;
    size_t service[2] = {0, 0};
    ctx->resource.len = 0;
    if (put_map(ctx, &ctx->resource, ctx->kvs.items, ctx->kvs.len, service))
        return -1;
    ctx->service = (Slice){ctx->resource.data + service[0], ctx->resource.data + service[1]};
    s = body;
    while ((r = next_field(&s, &f)) > 0)
        if (f.num == 2 && put_scope_spans(ctx, out, f.s, count))
            return -1;
    return r;
}

static void ctx_free(Ctx *ctx) {
    PyMem_Free(ctx->scratch.data);
    PyMem_Free(ctx->resource.data);
    PyMem_Free(ctx->kvs.items);
    PyMem_Free(ctx->events.items);
    PyMem_Free(ctx->links.items);
    PyMem_Free(ctx->spans.items);
    PyMem_Free(ctx->nested_kvs.items);
}

static PyObject *rows_result(Buf *outs, size_t slots, size_t count) {
    if (!slots)
        return Py_BuildValue("(y#n)", outs[0].data ? (const char *)outs[0].data : "", (Py_ssize_t)outs[0].len,
                             (Py_ssize_t)count);
    PyObject *rows = PyList_New((Py_ssize_t)slots);
    for (size_t i = 0; rows && i < slots; i++) {
        PyObject *b = PyBytes_FromStringAndSize(outs[i].data ? (const char *)outs[i].data : "", (Py_ssize_t)outs[i].len);
        if (!b)
            Py_CLEAR(rows);
        else
            PyList_SET_ITEM(rows, (Py_ssize_t)i, b);
    }
    return rows ? Py_BuildValue("(Nn)", rows, (Py_ssize_t)count) : NULL;
}

static PyObject *render(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer payload;
    PyObject *any_value;
    Py_ssize_t slots = 0;
    if (!PyArg_ParseTuple(args, "y*O|n:render", &payload, &any_value, &slots))
        return NULL;
    if (slots < 0 || slots > 4096) {
        PyBuffer_Release(&payload);
        PyErr_SetString(PyExc_ValueError, "slots must be 0..4096");
        return NULL;
    }
    Ctx ctx = {.any_value = any_value, .slots = (size_t)slots};
    Buf *outs = PyMem_Calloc(slots ? (size_t)slots : 1, sizeof(Buf));
    if (!outs) {
        PyBuffer_Release(&payload);
        return PyErr_NoMemory();
    }
    Slice s = {payload.buf, (const uint8_t *)payload.buf + payload.len};
    Field f;
    size_t count = 0;
    int r;
    while ((r = next_field(&s, &f)) > 0)
        if (f.num == 1 && (expect(&f, LEN, "resource_spans") || put_resource_spans(&ctx, outs, f.s, &count))) {
            r = -1;
            break;
        }
    ctx_free(&ctx);
    PyBuffer_Release(&payload);
    PyObject *result = r < 0 ? NULL : rows_result(outs, (size_t)slots, count);
    for (size_t i = 0; i < (slots ? (size_t)slots : 1); i++)
        PyMem_Free(outs[i].data);
    PyMem_Free(outs);
    return result;
}

static PyMethodDef methods[] = {
    {"render", render, METH_VARARGS,
     "render(payload, any_value[, slots]) -> (rows, span_count): RowBinary rows of otel_traces, INSERT_COLUMNS order.\n"
     "any_value(bytes) -> str renders an AnyValue this module does not (arrays, maps, merged values).\n"
     "With slots: rows is a list of `slots` byte strings, a row in slot cityHash64(hex TraceId) % slots."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__otlp_rows(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    InvalidSpans = PyErr_NewExceptionWithDoc("phaselens.collectors._otlp_rows.InvalidSpans",
                                             "Malformed protobuf, or a span the exporter could not store (bad ids).",
                                             PyExc_ValueError, NULL);
    if (!InvalidSpans || PyModule_AddObjectRef(m, "InvalidSpans", InvalidSpans) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
