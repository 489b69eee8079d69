/* The shipper's frames for a drain's records, all in one bytes (`wire.pack`).
 *
 * Why C: per record, the Python writer built a tuple of the fields, marshalled it, packed a header
 * and joined it to the others (~20k instructions a request frame, ~15k a step's); the shipper runs
 * in the serving process, under its GIL. Here a drain's frames are written into one buffer.
 *
 * pack(records, request_type, step_type) -> (data, ends, unsampled, errors):
 *   data = the frames end to end, each exactly `wire.encode_request(record)` (a `request_type`)
 *   or `wire.encode_step(record)` (a `step_type`): `<u32 length><u8 kind>` and the marshal
 *   (format 2) of the fields, nested records as tuples; ends = each frame's end offset in data,
 *   native uint32s; unsampled = steps not written (no member linked: `not links`);
 *   errors = records not written because their fields do not marshal (e.g. a prompt of a type
 *   marshal refuses) or are not what the record types hold. Values of other types than None,
 *   bools, exact ints of up to 64 bits, ASCII strs, bytes, memoryviews and tuples are written by
 *   marshal itself (PyMarshal_WriteObjectToString: same bytes, same errors).
 *
 * decode_request(fields, types) -> RequestRecord | None: a request frame's record (`wire.decode_request`).
 * split_runs(data, step_type, decode_step) -> (items, used): the span-builder process's reader
 *   (`wire.split_runs`): the whole frames at the start of `data` as `wire.split_frames` reads them
 *   ((kind, fields), marshal's own reader, the same errors), and how many bytes they take, except
 *   that each run of consecutive step frames is one item (KIND_STEP, (steps, undecoded)): each
 *   frame's fields as `decode_step` makes them (a `step_type` made here for the usual 11-tuple, no
 *   call), and how many it refused. A step frame of the usual form (`usual_step`) is read here
 *   straight into its `step_type`, others by marshal. Why C: per step frame (~16 a request in
 *   vLLM) the Python loop, the decode and the handling were ~2/3 of reading it, marshal the rest.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <marshal.h>
#include <stdint.h>
#include <string.h>

#define MARSHAL_VERSION 2 /* wire.MARSHAL_VERSION: no back-references */
#define KIND_REQUEST 2
#define KIND_STEP 3
#define HEADER_BYTES 5 /* wire.HEADER: <u32 length><u8 kind> */
#define STEP_FIELDS 11 /* spans.PackedStep's */

/* The frames are written into one scratch buffer, kept between calls (shipper threads call pack()
 * under the GIL, and nothing in it runs Python code before the frames are copied out), then copied
 * into a bytes of their size: a new block the size of a drain
 * each call was ~0.6 us a record of page faults (glibc maps blocks that large afresh). */
typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Out;

static Out scratch;
#define SCRATCH_KEPT (4 << 20) /* a larger buffer (a backlog's drain) is freed after use */

static int reserve(Out *out, Py_ssize_t more) {
    if (out->len + more <= out->cap)
        return 0;
    Py_ssize_t cap = out->cap ? out->cap : 1 << 16;
    while (cap < out->len + more)
        cap *= 2;
    char *data = PyMem_RawRealloc(out->data, (size_t)cap);
    if (!data) {
        PyErr_NoMemory();
        return -1;
    }
    out->data = data;
    out->cap = cap;
    return 0;
}

static void put_u32(char *at, uint32_t value) { /* little-endian, as marshal's w_long */
    for (int i = 0; i < 4; i++)
        at[i] = (char)(value >> (8 * i));
}

static int w_bytes(Out *out, char type, const char *data, Py_ssize_t n) {
    if (n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "wire: a value over 2 GiB");
        return -1;
    }
    if (reserve(out, 5 + n) < 0)
        return -1;
    out->data[out->len] = type;
    put_u32(out->data + out->len + 1, (uint32_t)n);
    memcpy(out->data + out->len + 5, data, (size_t)n);
    out->len += 5 + n;
    return 0;
}

/* marshal's TYPE_INT for 32-bit values, else TYPE_LONG: a signed count of 15-bit digits, low first */
static int w_int64(Out *out, long long value) {
    if (reserve(out, 5 + 2 * 5) < 0)
        return -1;
    char *at = out->data + out->len;
    if (value >= INT32_MIN && value <= INT32_MAX) {
        at[0] = 'i';
        put_u32(at + 1, (uint32_t)value);
        out->len += 5;
        return 0;
    }
    unsigned long long rest = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    int digits = 0;
    at[0] = 'l';
    for (; rest; rest >>= 15, digits++) {
        at[5 + 2 * digits] = (char)(rest & 0xFF);
        at[6 + 2 * digits] = (char)((rest >> 8) & 0x7F);
    }
    put_u32(at + 1, (uint32_t)(value < 0 ? -digits : digits));
    out->len += 5 + 2 * digits;
    return 0;
}

static int w_marshal(Out *out, PyObject *value) {
    PyObject *bytes = PyMarshal_WriteObjectToString(value, MARSHAL_VERSION);
    if (!bytes)
        return -1;
    int rc = reserve(out, PyBytes_GET_SIZE(bytes));
    if (rc == 0) {
        memcpy(out->data + out->len, PyBytes_AS_STRING(bytes), (size_t)PyBytes_GET_SIZE(bytes));
        out->len += PyBytes_GET_SIZE(bytes);
    }
    Py_DECREF(bytes);
    return rc;
}

static int w_value(Out *out, PyObject *value);

/* marshal's TYPE_TUPLE and its length: the items follow */
static int w_tuple_header(Out *out, Py_ssize_t n) {
    if (reserve(out, 5) < 0)
        return -1;
    out->data[out->len] = '(';
    put_u32(out->data + out->len + 1, (uint32_t)n);
    out->len += 5;
    return 0;
}

static int w_items(Out *out, PyObject *tuple, Py_ssize_t n) {
    if (w_tuple_header(out, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (w_value(out, PyTuple_GET_ITEM(tuple, i)) < 0)
            return -1;
    return 0;
}

static int w_value(Out *out, PyObject *value) {
    if (value == Py_None || value == Py_True || value == Py_False) {
        if (reserve(out, 1) < 0)
            return -1;
        out->data[out->len++] = value == Py_None ? 'N' : value == Py_True ? 'T' : 'F';
        return 0;
    }
    if (PyLong_CheckExact(value)) {
        int overflow;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (!overflow && !(number == -1 && PyErr_Occurred()))
            return w_int64(out, number);
        return w_marshal(out, value); /* past 64 bits: a trace id */
    }
    if (PyUnicode_CheckExact(value) && PyUnicode_IS_ASCII(value)) /* its UTF-8 is its data */
        return w_bytes(out, 'u', (const char *)PyUnicode_DATA(value), PyUnicode_GET_LENGTH(value));
    if (PyBytes_CheckExact(value))
        return w_bytes(out, 's', PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
    if (PyTuple_CheckExact(value))
        return w_items(out, value, PyTuple_GET_SIZE(value));
    if (PyMemoryView_Check(value)) { /* a timeline (records.int64s): marshal writes its bytes */
        Py_buffer view;
        if (PyObject_GetBuffer(value, &view, PyBUF_SIMPLE) < 0)
            return -1;
        int rc = w_bytes(out, 's', view.buf, view.len);
        PyBuffer_Release(&view);
        return rc;
    }
    return w_marshal(out, value);
}

/* The header's length, once the payload after it is written. */
static void close_frame(Out *out, Py_ssize_t start, char kind) {
    put_u32(out->data + start, (uint32_t)(out->len - start - HEADER_BYTES));
    out->data[start + 4] = kind;
}

/* wire.encode_request: the record's fields, a nested record (a tuple subclass) as a tuple */
static int w_request(Out *out, PyObject *record) {
    Py_ssize_t n = PyTuple_GET_SIZE(record);
    if (w_tuple_header(out, n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyTuple_GET_ITEM(record, i);
        int rc = PyTuple_Check(field) ? w_items(out, field, PyTuple_GET_SIZE(field)) : w_value(out, field);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* wire.encode_step: the record's fields (its links one bytes, packed by the loop); 0 when it links
 * no member (not written) */
static int w_step(Out *out, PyObject *step) {
    Py_ssize_t n = PyTuple_GET_SIZE(step);
    PyObject *links = n ? PyTuple_GET_ITEM(step, n - 1) : NULL;
    if (!links || !PyBytes_CheckExact(links)) {
        PyErr_SetString(PyExc_TypeError, "wire: a step's links: bytes expected");
        return -1;
    }
    if (!PyBytes_GET_SIZE(links))
        return 0;
    return w_items(out, step, n) < 0 ? -1 : 1;
}

/* One record's frame: 1 written, 0 skipped (an unsampled step), -1 an error (nothing written). */
static int w_record(Out *out, PyObject *record, PyObject *request_type, PyObject *step_type) {
    Py_ssize_t start = out->len;
    if (reserve(out, HEADER_BYTES) < 0)
        return -1;
    out->len += HEADER_BYTES;
    int rc;
    char kind;
    if ((PyObject *)Py_TYPE(record) == request_type) {
        kind = KIND_REQUEST;
        rc = w_request(out, record) < 0 ? -1 : 1;
    } else if ((PyObject *)Py_TYPE(record) == step_type) {
        kind = KIND_STEP;
        rc = w_step(out, record);
    } else {
        PyErr_SetString(PyExc_TypeError, "wire: a RequestRecord or a StepRecord expected");
        rc = -1;
    }
    if (rc == 1 && out->len - start - HEADER_BYTES > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "wire: a frame over 4 GiB");
        rc = -1;
    }
    if (rc == 1)
        close_frame(out, start, kind);
    else
        out->len = start;
    return rc;
}

static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "pack(records: list, request_type, step_type)");
        return NULL;
    }
    PyObject *records = args[0], *result = NULL;
    Py_ssize_t count = PyList_GET_SIZE(records), written = 0, unsampled = 0, errors = 0;
    PyObject *ends = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)sizeof(uint32_t) * count);
    if (!ends)
        return NULL;
    scratch.len = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int rc = w_record(&scratch, PyList_GET_ITEM(records, i), args[1], args[2]);
        if (rc == 1) {
            if (scratch.len > UINT32_MAX) { /* the ends are uint32s: the shipper drains far more often */
                PyErr_SetString(PyExc_ValueError, "wire: a drain's frames over 4 GiB");
                goto done;
            }
            ((uint32_t *)PyBytes_AS_STRING(ends))[written++] = (uint32_t)scratch.len;
        } else if (rc == 0) {
            unsampled++;
        } else if (PyErr_ExceptionMatches(PyExc_Exception)) { /* counted; the others still go */
            PyErr_Clear();
            errors++;
        } else {
            goto done;
        }
    }
    /* the frames copied out before any allocation that may run a collection, hence Python code and
     * another shipper thread's pack() over the scratch buffer */
    PyObject *data = PyBytes_FromStringAndSize(scratch.data ? scratch.data : "", scratch.len);
    if (data && _PyBytes_Resize(&ends, written * (Py_ssize_t)sizeof(uint32_t)) == 0)
        result = Py_BuildValue("(NOnn)", data, ends, unsampled, errors);
    else
        Py_XDECREF(data);
done:
    Py_XDECREF(ends);
    if (scratch.cap > SCRATCH_KEPT) {
        PyMem_RawFree(scratch.data);
        scratch = (Out){NULL, 0, 0};
    }
    return result;
}

/* ---------- the reader's side ---------- */

/* A step frame's fields as a `step_type` (decode_step's check: 11 items, the last bytes, then
 * tuple.__new__(step_type, fields)), the fields made without a call; else `decode_step(fields)`. */
static PyObject *step_of(PyObject *fields, PyTypeObject *step_type, PyObject *decode_step) {
    if (!PyTuple_CheckExact(fields) || PyTuple_GET_SIZE(fields) != STEP_FIELDS ||
        !PyBytes_Check(PyTuple_GET_ITEM(fields, STEP_FIELDS - 1)))
        return PyObject_CallOneArg(decode_step, fields);
    PyObject *step = step_type->tp_alloc(step_type, STEP_FIELDS);
    for (Py_ssize_t i = 0; step && i < STEP_FIELDS; i++)
        PyTuple_SET_ITEM(step, i, Py_NewRef(PyTuple_GET_ITEM(fields, i)));
    return step;
}

/* marshal (format 2) as marshal.c reads it, for a step frame's usual payload only: the 11-tuple
 * of ints (TYPE_INT, or TYPE_LONG of up to 4 15-bit digits: |value| < 2**60, a monotonic stamp in
 * ns up to 36 years) and the links' bytes last, each object written once (no references in 2). */
#define MARSHAL_LONG_DIGITS 4

static int32_t le32(const unsigned char *p) { return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24); }

/* An int item at *p (advanced past it) as a new int; NULL without an error: not the usual form. */
static PyObject *usual_int(const unsigned char **p, const unsigned char *end) {
    const unsigned char *q = *p;
    if (end - q >= 5 && q[0] == 'i') {
        *p = q + 5;
        return PyLong_FromLong(le32(q + 1));
    }
    if (end - q < 5 || q[0] != 'l')
        return NULL;
    int32_t n = le32(q + 1), size = n < 0 ? -n : n;
    if (size < 1 || size > MARSHAL_LONG_DIGITS || end - q < 5 + 2 * size)
        return NULL;
    uint64_t value = 0;
    for (int32_t i = size - 1; i >= 0; i--) {
        unsigned digit = (unsigned)q[5 + 2 * i] | (unsigned)q[6 + 2 * i] << 8;
        if (digit > 0x7fff || (i == size - 1 && digit == 0)) /* marshal refuses these: its error, not ours */
            return NULL;
        value = value << 15 | digit;
    }
    *p = q + 5 + 2 * size;
    return PyLong_FromLongLong(n < 0 ? -(long long)value : (long long)value);
}

/* A step frame's payload as a `step_type` when it has the usual form (else NULL, no error: read it
 * with marshal); NULL with an error when out of memory. No fields tuple is made. */
static PyObject *usual_step(const unsigned char *p, Py_ssize_t length, PyTypeObject *step_type) {
    const unsigned char *end = p + length;
    if (length < 5 || p[0] != '(' || le32(p + 1) != STEP_FIELDS)
        return NULL;
    p += 5;
    PyObject *step = step_type->tp_alloc(step_type, STEP_FIELDS);
    for (Py_ssize_t i = 0; step && i < STEP_FIELDS - 1; i++) {
        PyObject *value = usual_int(&p, end);
        if (!value) {
            Py_DECREF(step);
            return NULL;
        }
        PyTuple_SET_ITEM(step, i, value);
    }
    int32_t size = end - p >= 5 && p[0] == 's' ? le32(p + 1) : -1;
    PyObject *links = size >= 0 && end - p - 5 >= size ? PyBytes_FromStringAndSize((const char *)p + 5, size) : NULL;
    if (!links) {
        Py_XDECREF(step);
        return NULL;
    }
    if (!step) {
        Py_DECREF(links);
        return NULL;
    }
    PyTuple_SET_ITEM(step, STEP_FIELDS - 1, links);
    return step;
}

/* (KIND_STEP, (steps, undecoded)) appended to `items`; the run's list is handed over. */
static int end_run(PyObject *items, PyObject **run, Py_ssize_t *undecoded) {
    PyObject *item = *run ? Py_BuildValue("(i(Nn))", KIND_STEP, *run, *undecoded) : NULL;
    *run = NULL;
    *undecoded = 0;
    int r = !item || PyList_Append(items, item);
    Py_XDECREF(item);
    return r ? -1 : 0;
}

/* split_runs(data, step_type, decode_step) -> (items, used); METH_FASTCALL. */
static PyObject *split_runs(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0]) || !PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type) || !PyCallable_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "split_runs(data: bytes, step_type: a tuple type, decode_step)");
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t end = PyBytes_GET_SIZE(args[0]), offset = 0, undecoded = 0;
    PyObject *items = PyList_New(0), *run = NULL;
    while (items && offset + HEADER_BYTES <= end) {
        uint32_t length = 0;
        for (int i = 3; i >= 0; i--)
            length = length << 8 | data[offset + i];
        int kind = data[offset + 4];
        if ((Py_ssize_t)length > end - offset - HEADER_BYTES)
            break; /* cut at the read's end: the next read brings the rest */
        const unsigned char *payload = data + offset + HEADER_BYTES;
        PyObject *step = kind == KIND_STEP ? usual_step(payload, length, (PyTypeObject *)args[1]) : NULL;
        if (!step && PyErr_Occurred())
            goto error;
        PyObject *fields = step ? NULL : PyMarshal_ReadObjectFromString((const char *)payload, length);
        if (!step && !fields)
            goto error;
        offset += HEADER_BYTES + (Py_ssize_t)length;
        if (kind == KIND_STEP) {
            if (!run && !(run = PyList_New(0))) {
                Py_XDECREF(step);
                Py_XDECREF(fields);
                goto error;
            }
            if (!step) {
                step = step_of(fields, (PyTypeObject *)args[1], args[2]);
                Py_DECREF(fields);
            }
            if (step) {
                int r = PyList_Append(run, step);
                Py_DECREF(step);
                if (r)
                    goto error;
            } else if (PyErr_ExceptionMatches(PyExc_Exception)) { /* as decode_step's caller: counted, the run goes on */
                PyErr_Clear();
                undecoded++;
            } else {
                goto error;
            }
            continue;
        }
        if (run && end_run(items, &run, &undecoded)) {
            Py_DECREF(fields);
            goto error;
        }
        PyObject *item = Py_BuildValue("(iN)", kind, fields);
        if (!item || PyList_Append(items, item)) {
            Py_XDECREF(item);
            goto error;
        }
        Py_DECREF(item);
    }
    if (items && run && end_run(items, &run, &undecoded))
        goto error;
    return items ? Py_BuildValue("(Nn)", items, offset) : NULL;
error:
    Py_XDECREF(run);
    Py_XDECREF(items);
    return NULL;
}

/* ---------- a request frame's record ---------- */

/* RequestRecord's fields (records.py; wire.encode_request writes them in this order) */
enum { RQ_ROOT, RQ_PARENT, RQ_WAITS = 15, RQ_INFO = 20, RQ_OUTCOME, RQ_HTTP, RQ_KV, RQ_FIELDS };
enum { TY_RECORD, TY_IDS, TY_INFO, TY_OUTCOME, TY_HTTP, TY_KV, TYPES };
static PyObject *s_cast, *s_int64, *empty_int64s; /* "cast", "q", records.int64s(b"") */

/* tuple.__new__(type, items) for an exact tuple (no call); NULL without an error: not one. */
static PyObject *tuple_as(PyObject *type, PyObject *items) {
    if (!PyTuple_CheckExact(items))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *out = ((PyTypeObject *)type)->tp_alloc((PyTypeObject *)type, n);
    for (Py_ssize_t i = 0; out && i < n; i++)
        PyTuple_SET_ITEM(out, i, Py_NewRef(PyTuple_GET_ITEM(items, i)));
    return out;
}

/* The record's field `i` from the frame's: a nested record as its type, a timeline (bytes) as
 * records.int64s makes it; NULL without an error when it has another form. */
static PyObject *record_field(PyObject *field, Py_ssize_t i, PyObject *const *types) {
    if (i == RQ_ROOT || (i == RQ_PARENT && field != Py_None))
        return tuple_as(types[TY_IDS], field);
    if (i >= RQ_WAITS && i < RQ_INFO) {
        if (PyBytes_CheckExact(field) && !PyBytes_GET_SIZE(field)) /* read-only and empty: one serves all */
            return Py_NewRef(empty_int64s);
        PyObject *view = PyBytes_CheckExact(field) ? PyMemoryView_FromObject(field) : NULL;
        PyObject *cast = view ? PyObject_CallMethodOneArg(view, s_cast, s_int64) : NULL;
        Py_XDECREF(view);
        return cast;
    }
    if (i >= RQ_INFO && (field != Py_None || i == RQ_OUTCOME || i == RQ_HTTP))
        return tuple_as(types[TY_INFO + (i - RQ_INFO)], field);
    return Py_NewRef(field);
}

/* decode_request(fields, types) -> the record `wire.decode_request` makes from a request frame's
 * fields of the usual form (24 items, nested records as tuples, timelines as bytes), or None for
 * another form (the caller decodes it in Python: its record or its error). types: (RequestRecord,
 * SpanIds, RequestInfo, RequestOutcome, HttpFacts, KvStamps). Why C: five int64 views and five tuple
 * subclasses a request made in Python were ~20k instructions. */
static PyObject *decode_request(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != TYPES) {
        PyErr_SetString(PyExc_TypeError, "decode_request(fields, types: a tuple of 6 record types)");
        return NULL;
    }
    PyObject *fields = args[0], *const *types = &PyTuple_GET_ITEM(args[1], 0);
    for (int i = 0; i < TYPES; i++)
        if (!PyType_Check(types[i]) || !PyType_IsSubtype((PyTypeObject *)types[i], &PyTuple_Type)) {
            PyErr_SetString(PyExc_TypeError, "decode_request: types must be tuple types");
            return NULL;
        }
    if (!PyTuple_CheckExact(fields) || PyTuple_GET_SIZE(fields) != RQ_FIELDS)
        Py_RETURN_NONE;
    PyObject *record = ((PyTypeObject *)types[TY_RECORD])->tp_alloc((PyTypeObject *)types[TY_RECORD], RQ_FIELDS);
    for (Py_ssize_t i = 0; record && i < RQ_FIELDS; i++) {
        PyObject *value = record_field(PyTuple_GET_ITEM(fields, i), i, types);
        if (!value) {
            Py_CLEAR(record);
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL; /* out of memory */
            PyErr_Clear(); /* another form (a timeline not a multiple of 8 bytes included): decoded in Python */
            Py_RETURN_NONE;
        }
        PyTuple_SET_ITEM(record, i, value);
    }
    return record;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "A drain's records as frames: (data, ends, unsampled, errors)."},
    {"decode_request", (PyCFunction)(void (*)(void))decode_request, METH_FASTCALL,
     "A request frame's record, or None where its fields have another form."},
    {"split_runs", (PyCFunction)(void (*)(void))split_runs, METH_FASTCALL,
     "The whole frames at the start of data: (items, bytes used), step frames in runs."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire_pack(void) {
    if (!(s_cast = PyUnicode_InternFromString("cast")) || !(s_int64 = PyUnicode_InternFromString("q")))
        return NULL;
    PyObject *bytes = PyBytes_FromStringAndSize("", 0), *view = bytes ? PyMemoryView_FromObject(bytes) : NULL;
    empty_int64s = view ? PyObject_CallMethodOneArg(view, s_cast, s_int64) : NULL;
    Py_XDECREF(bytes);
    Py_XDECREF(view);
    if (!empty_int64s)
        return NULL;
    return PyModule_Create(&module);
}
