/* A request's decode tokens and inter-token gaps from its int64 stamp buffers (`phases`).
 *
 * Why C: numpy's per-call overhead (frombuffer, slicing, a ufunc, sort, tolist) was ~45k
 * instructions a request for ~128 int64s; a list of the gaps ~10k more, most of it its ints (the
 * gaps are read for a few quantiles, so they stay packed).
 *
 * token_gaps(first_token_ts, token_ts, token_n) -> (decode_tokens, gaps):
 *   decode_tokens = sum(token_n) (int64), gaps = [token_ts[0] - first_token_ts] + [token_ts[i] -
 *   token_ts[i-1] for i >= 1], ascending (empty when token_ts is), as bytes of native int64s
 *   (`records.int64s` reads them). Both buffers: native int64 (array('q') / records.int64s).
 *
 * itl_ms(gaps) -> (p50_ms, p99_ms, max_ms, stall_ms): llm.decode's ITL figures from the ascending
 *   gaps, the floats `spans.decode_attributes` wrote with `common.quantile.quantile` and the stall
 *   formula of `phases` (each ns / 1e6; 0.0 each for no gap), with Python's arithmetic on its ints
 *   and floats step by step (an int quantile stays exact, an int compared with a float exactly), so
 *   the values are those floats bit for bit (tests/test_instrumentation_phases.py compares them on
 *   any gaps): ~2k instructions where the Python took ~20k.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX: a __slots__ member */
#include <stdint.h>
#include <string.h>

/* Sorting: an LSD radix sort, 8 bits a pass, of the keys (x ^ sign bit) - min, so that passes stop
 * at the range's top byte (~3 passes for a request's gaps) and a pass whose digit is the same for
 * every key is skipped: no compare to mispredict (the shellsort it replaced was ~19k instructions
 * for a request's ~128 gaps, about a third of `compute_phases`). Below MERGE_MAX values a pass's
 * 256 buckets cost more than the values: runs of RUN insertion-sorted, then merged (~2/5 of the
 * radix sort's instructions for 63 gaps); insertion sort alone below SMALL_SORT. */
#define RADIX_BITS 8
#define RADIX (1 << RADIX_BITS)
#define SMALL_SORT 16
#define MERGE_MAX 256
#define RUN 8
#define STACK_VALUES 512

static void insertion_sort(int64_t *a, Py_ssize_t n) {
    for (Py_ssize_t i = 1; i < n; i++) {
        int64_t v = a[i];
        Py_ssize_t j = i;
        for (; j > 0 && a[j - 1] > v; j--)
            a[j] = a[j - 1];
        a[j] = v;
    }
}

/* Ascending, a into itself through scratch: runs of RUN by insertion, then bottom-up merges. */
static void merge_sort(int64_t *a, int64_t *scratch, Py_ssize_t n) {
    for (Py_ssize_t lo = 0; lo < n; lo += RUN)
        insertion_sort(a + lo, n - lo < RUN ? n - lo : RUN);
    int64_t *src = a, *dst = scratch;
    for (Py_ssize_t width = RUN; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                dst[k++] = src[j] < src[i] ? src[j++] : src[i++];
            while (i < mid)
                dst[k++] = src[i++];
            while (j < hi)
                dst[k++] = src[j++];
        }
        int64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(int64_t));
}

static inline uint64_t radix_key(int64_t v, uint64_t min) { return ((uint64_t)v ^ (UINT64_C(1) << 63)) - min; }

/* One stable pass on the digit at `shift`, src -> dst; 0 (nothing moved) when every key has the same digit. */
static int radix_pass(const int64_t *src, int64_t *dst, Py_ssize_t n, uint64_t min, int shift) {
    Py_ssize_t count[RADIX] = {0};
    for (Py_ssize_t i = 0; i < n; i++)
        count[(radix_key(src[i], min) >> shift) & (RADIX - 1)]++;
    if (count[(radix_key(src[0], min) >> shift) & (RADIX - 1)] == n)
        return 0;
    for (Py_ssize_t d = 0, at = 0; d < RADIX; d++) {
        Py_ssize_t c = count[d];
        count[d] = at;
        at += c;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        dst[count[(radix_key(src[i], min) >> shift) & (RADIX - 1)]++] = src[i];
    return 1;
}

/* Ascending, in place; -1 (MemoryError set) when no scratch memory. */
static int sort_ascending(int64_t *a, Py_ssize_t n) {
    if (n <= SMALL_SORT) {
        insertion_sort(a, n);
        return 0;
    }
    int64_t stack[STACK_VALUES], *scratch = n <= STACK_VALUES ? stack : PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (!scratch) {
        PyErr_NoMemory();
        return -1;
    }
    if (n <= MERGE_MAX) {
        merge_sort(a, scratch, n);
        return 0;
    }
    uint64_t min = UINT64_MAX, max = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = radix_key(a[i], 0);
        min = k < min ? k : min;
        max = k > max ? k : max;
    }
    int64_t *src = a, *dst = scratch;
    for (int shift = 0; shift < 64 && ((max - min) >> shift); shift += RADIX_BITS)
        if (radix_pass(src, dst, n, min, shift)) {
            int64_t *t = src;
            src = dst;
            dst = t;
        }
    if (src != a)
        memcpy(a, src, (size_t)n * sizeof(int64_t));
    if (scratch != stack)
        PyMem_Free(scratch);
    return 0;
}

static int int64_view(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % (Py_ssize_t)sizeof(int64_t)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "a buffer of int64s expected");
        return -1;
    }
    return 0;
}

/* The gaps, ascending, as native int64s in a new bytes (no int object per gap). */
static PyObject *gaps_bytes(int64_t first_token_ts, const int64_t *stamps, Py_ssize_t n) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (!out)
        return NULL;
    int64_t *gaps = (int64_t *)PyBytes_AS_STRING(out); /* aligned: the bytes object's data is */
    for (Py_ssize_t i = 0; i < n; i++)
        gaps[i] = stamps[i] - (i ? stamps[i - 1] : first_token_ts);
    if (sort_ascending(gaps, n) < 0)
        Py_CLEAR(out);
    return out;
}

static PyObject *token_gaps(PyObject *self, PyObject *args) {
    (void)self;
    long long first_token_ts;
    PyObject *token_ts, *token_n;
    if (!PyArg_ParseTuple(args, "LOO:token_gaps", &first_token_ts, &token_ts, &token_n))
        return NULL;
    Py_buffer ts, tn;
    if (int64_view(token_ts, &ts) < 0)
        return NULL;
    if (int64_view(token_n, &tn) < 0) {
        PyBuffer_Release(&ts);
        return NULL;
    }
    int64_t tokens = 0;
    const int64_t *counts = tn.buf;
    for (Py_ssize_t i = 0; i < tn.len / (Py_ssize_t)sizeof(int64_t); i++)
        tokens += counts[i];
    PyObject *gaps = gaps_bytes(first_token_ts, ts.buf, ts.len / (Py_ssize_t)sizeof(int64_t));
    PyBuffer_Release(&ts);
    PyBuffer_Release(&tn);
    if (!gaps)
        return NULL;
    return Py_BuildValue("(LN)", (long long)tokens, gaps);
}

/* phase_terms(timeline) -> the fields of `phases.Phases` in its order (`itl_sorted_ns` an int64 view
 * of token_gaps's bytes, empty where none were computed). The whole of
 * `phases.compute_phases`'s arithmetic (its module docstring), read from the timeline's attributes
 * (a RequestRecord or a RequestTimeline): in Python the same steps were ~54k instructions a request
 * at vLLM's shape, nearly all of it the interpreter's (a max of 8 stamps ~5k, 3 overlaps ~6k). */
typedef struct {
    int64_t received, enqueued, first_token, responded, finished, output_ready, first_chunk, first_chunk_sent;
    int64_t last_chunk, arrived, read, visible_tokens;
} Stamps;

static const char *const STAMP_NAMES[] = {"received_ts", "enqueued_ts", "first_token_ts", "responded_ts",
                                          "finished_ts", "output_ready_ts", "first_chunk_ts", "first_chunk_sent_ts",
                                          "last_chunk_ts", "arrived_ts", "read_ts", "visible_tokens"};
#define N_STAMPS 12
static const char *const BUFFER_NAMES[] = {"waits", "chunks", "token_ts", "token_n"};
#define N_BUFFERS 4
#define CHUNK_FIELDS 4 /* timeline.CHUNK_FIELDS: start, end, tokens, cached */

static PyObject *interned[N_STAMPS + N_BUFFERS];

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Σ of the (start, end) waits' lengths inside [start_ts, end_ts] (phases.overlap_ns). */
static int64_t overlap(const int64_t *pairs, Py_ssize_t n_pairs, int64_t start_ts, int64_t end_ts) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n_pairs; i++) {
        int64_t a = pairs[2 * i], b = pairs[2 * i + 1];
        int64_t inside = (b < end_ts ? b : end_ts) - (a > start_ts ? a : start_ts);
        if (inside > 0)
            total += inside;
    }
    return total;
}

static int read_stamps(PyObject *timeline, Stamps *s) {
    int64_t *out = (int64_t *)s;
    for (int i = 0; i < N_STAMPS; i++) {
        PyObject *v = PyObject_GetAttr(timeline, interned[i]);
        if (!v)
            return -1;
        int overflow; /* AsLongLong takes a stamp's 2-3 digits through _PyLong_AsByteArray: ~5x the instructions */
        out[i] = PyLong_AsLongLongAndOverflow(v, &overflow);
        Py_DECREF(v);
        if (overflow)
            PyErr_SetString(PyExc_OverflowError, "int too big to convert");
        if (overflow || (out[i] == -1 && PyErr_Occurred()))
            return -1;
    }
    return 0;
}

/* The waits as a list of (start, end) tuples, an open wait ended at end_ts; NULL on error. */
static PyObject *wait_pairs(const int64_t *pairs, Py_ssize_t n_pairs) {
    PyObject *list = PyList_New(n_pairs);
    for (Py_ssize_t i = 0; list && i < n_pairs; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)pairs[2 * i], (long long)pairs[2 * i + 1]);
        if (!pair)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, i, pair);
    }
    return list;
}

/* Phases' fields, in its order (the enum below), as int64s; the waits and gaps made apart. */
enum { RECEIVED, END, ARRIVED, READ, KERNEL_WAIT, DISPATCH, ENQUEUED, SCHEDULED, PREFILL_END, FIRST_TOKEN,
       LAST_TOKEN, INGRESS, QUEUE, PREFILL, FIRST_TOKEN_PHASE, FIRST_CHUNK, LAST_CHUNK, FIRST_CHUNK_PHASE,
       VISIBLE, HELD_BACK, HELD_BACK_TOKENS, HELD_BACK_KNOWN, LOOP_WAIT, ENCODE, WRITE, DECODE, DELIVERY,
       WAITS, INITIAL_CHUNKS, DECODE_TOKENS, DECODE_STEPS, GAPS, N_FIELDS };

/* phases._first_chunk and _visible: the first_chunk term and its split, when a content chunk was sent. */
static void first_chunk_terms(const Stamps *s, int64_t *f, const int64_t *ts, const int64_t *tn, Py_ssize_t n) {
    int64_t ft = f[FIRST_TOKEN], ready = s->output_ready, first = s->first_chunk, sent = s->first_chunk_sent;
    if (!(ft <= ready && ready <= first && first <= sent))
        return;
    f[FIRST_CHUNK] = first;
    f[LAST_CHUNK] = s->last_chunk;
    int64_t visible = ft, held_back_tokens = 0, count = 1;
    if (s->visible_tokens > 1)
        for (Py_ssize_t i = 0; i < n; i++) {
            count += tn[i];
            if (count >= s->visible_tokens && ts[i] <= ready) {
                visible = ts[i];
                held_back_tokens = s->visible_tokens - 1;
                break;
            }
        }
    f[HELD_BACK_TOKENS] = held_back_tokens;
    f[HELD_BACK_KNOWN] = s->visible_tokens > 0;
    f[VISIBLE] = visible;
    f[HELD_BACK] = visible - ft;
    f[LOOP_WAIT] = ready - visible;
    f[ENCODE] = first - ready;
    f[WRITE] = sent - first;
    f[FIRST_CHUNK_PHASE] = first - visible;
}

/* compute_phases's terms into f (zeroed), the waits as pairs (an open one ended); the gaps when decoded. */
static PyObject *terms(const Stamps *s, int64_t *f, int64_t *pairs, Py_ssize_t n_w, Py_buffer *b) {
    const int64_t *chunks = b[1].buf, *ts = b[2].buf, *tn = b[3].buf;
    Py_ssize_t n_c = b[1].len / 8, n_t = b[2].len / 8, n_n = b[3].len / 8, n_pairs = (n_w + 1) / 2;
    int64_t end = max64(max64(max64(s->responded, s->received), max64(s->enqueued, s->first_token)), s->finished);
    end = max64(end, n_w ? pairs[n_w - 1] : 0);
    end = max64(end, n_t ? ts[n_t - 1] : 0);
    end = max64(end, n_c ? chunks[n_c - CHUNK_FIELDS + 1] : 0);
    if (n_w % 2)
        pairs[n_w] = end;
    f[RECEIVED] = s->received, f[END] = end, f[ENQUEUED] = s->enqueued;
    if (0 < s->read && s->read <= s->received) { /* phases._inbound */
        f[READ] = s->read, f[DISPATCH] = s->received - s->read;
        if (0 < s->arrived && s->arrived <= s->read)
            f[ARRIVED] = s->arrived, f[KERNEL_WAIT] = s->read - s->arrived;
    }
    if (!s->enqueued)
        return PyBytes_FromStringAndSize(NULL, 0);
    int64_t ft = f[FIRST_TOKEN] = s->first_token, horizon = ft ? ft : end;
    f[INGRESS] = s->enqueued - s->received;
    f[QUEUE] = overlap(pairs, n_pairs, s->enqueued, horizon);
    if (n_w < 2)
        return PyBytes_FromStringAndSize(NULL, 0);
    int64_t scheduled = f[SCHEDULED] = pairs[1], prefill_end = scheduled;
    for (Py_ssize_t i = 1; i < n_c; i += CHUNK_FIELDS)
        if (chunks[i] <= horizon) {
            f[INITIAL_CHUNKS]++;
            prefill_end = max64(prefill_end, chunks[i]);
        }
    f[PREFILL_END] = prefill_end;
    f[PREFILL] = prefill_end - scheduled - overlap(pairs, n_pairs, scheduled, prefill_end);
    if (!ft)
        return PyBytes_FromStringAndSize(NULL, 0);
    f[FIRST_TOKEN_PHASE] = ft - prefill_end - overlap(pairs, n_pairs, prefill_end, ft);
    int64_t last = f[LAST_TOKEN] = n_t ? ts[n_t - 1] : ft;
    f[DECODE] = last - ft;
    f[DELIVERY] = max64(0, end - last);
    for (Py_ssize_t i = 0; i < n_n; i++)
        f[DECODE_TOKENS] += tn[i];
    f[DECODE_STEPS] = n_t;
    first_chunk_terms(s, f, ts, tn, n_t < n_n ? n_t : n_n);
    return gaps_bytes(ft, ts, n_t);
}

/* records.int64s(raw): a read-only int64 view of the bytes (steals raw; NULL passes through). */
static PyObject *int64_memoryview(PyObject *raw) {
    if (!raw)
        return NULL;
    PyObject *view = PyMemoryView_FromObject(raw);
    Py_DECREF(raw);
    if (!view)
        return NULL;
    PyObject *cast = PyObject_CallMethod(view, "cast", "s", "q");
    Py_DECREF(view);
    return cast;
}

static PyObject *fields_tuple(const int64_t *f, PyObject *waits, PyObject *gaps) {
    PyObject *out = PyTuple_New(N_FIELDS);
    if (!out)
        return NULL;
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *v = i == WAITS ? Py_NewRef(waits) : i == GAPS ? Py_NewRef(gaps)
                      : i == HELD_BACK_KNOWN ? PyBool_FromLong((long)f[i]) : PyLong_FromLongLong(f[i]);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* The fields as an instance of `type` (`phases.Phases`): a slotted class whose __slots__ are the
 * fields in the tuple's order and whose __init__ only assigns them; each set at its slot's offset,
 * no __init__ called (it was ~4k instructions a request, with the tuple it takes apart). Offsets
 * found once for the last type seen (held). */
static PyObject *slots_type;
static Py_ssize_t slot_offsets[N_FIELDS];

static int find_slots(PyTypeObject *type) {
    PyObject *names = PyObject_GetAttrString((PyObject *)type, "__slots__");
    int ok = names && PyTuple_Check(names) && PyTuple_GET_SIZE(names) == N_FIELDS && type->tp_itemsize == 0;
    for (int i = 0; ok && i < N_FIELDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        PyObject *d = PyUnicode_Check(name) ? _PyType_Lookup(type, name) : NULL;
        ok = d && Py_IS_TYPE(d, &PyMemberDescr_Type) && PyDescr_TYPE(d) == type &&
             ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
        slot_offsets[i] = ok ? ((PyMemberDescrObject *)d)->d_member->offset : 0;
    }
    Py_XDECREF(names);
    PyErr_Clear();
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "phase_terms: a slotted class of the %d fields expected", N_FIELDS);
        return -1;
    }
    Py_XSETREF(slots_type, Py_NewRef((PyObject *)type));
    return 0;
}

/* `fields` (a tuple, consumed) as an instance of `type`. */
static PyObject *as_instance(PyObject *fields, PyTypeObject *type) {
    PyObject *out = NULL;
    if ((PyObject *)type == slots_type || !find_slots(type))
        out = type->tp_alloc(type, 0);
    for (int i = 0; out && i < N_FIELDS; i++)
        *(PyObject **)((char *)out + slot_offsets[i]) = Py_NewRef(PyTuple_GET_ITEM(fields, i));
    Py_DECREF(fields);
    return out;
}

/* phase_terms(timeline[, type]): the fields as a tuple, or as a `type` (as_instance). */
static PyObject *phase_terms(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2 || (nargs == 2 && !PyType_Check(args[1]))) {
        PyErr_SetString(PyExc_TypeError, "phase_terms(timeline[, type])");
        return NULL;
    }
    PyObject *timeline = args[0];
    Stamps s;
    Py_buffer b[N_BUFFERS];
    int got = 0;
    PyObject *out = NULL, *waits = NULL, *gaps = NULL;
    if (read_stamps(timeline, &s) < 0)
        return NULL;
    for (; got < N_BUFFERS; got++) {
        PyObject *obj = PyObject_GetAttr(timeline, interned[N_STAMPS + got]);
        int failed = !obj || int64_view(obj, &b[got]) < 0;
        Py_XDECREF(obj);
        if (failed)
            goto done;
    }
    Py_ssize_t n_w = b[0].len / 8;
    int64_t *pairs = PyMem_Malloc((size_t)(n_w + 1) * sizeof(int64_t)), f[N_FIELDS] = {0};
    if (!pairs) {
        PyErr_NoMemory();
        goto done;
    }
    if (n_w)
        memcpy(pairs, b[0].buf, (size_t)b[0].len);
    gaps = int64_memoryview(terms(&s, f, pairs, n_w, b));
    waits = gaps ? wait_pairs(pairs, (n_w + 1) / 2) : NULL;
    PyMem_Free(pairs);
    if (waits)
        out = fields_tuple(f, waits, gaps);
done:
    Py_XDECREF(waits);
    Py_XDECREF(gaps);
    while (got-- > 0)
        PyBuffer_Release(&b[got]);
    return out && nargs == 2 ? as_instance(out, (PyTypeObject *)args[1]) : out;
}

/* A quantile as common.quantile computes it, then `or 0`: exact (an int, in *exact) when it returns a
 * stamp (a == b, or h == lo); else the float a + (b - a) * (h - lo), with -0.0 and 0.0 as the int 0. */
typedef struct {
    int is_exact;
    int64_t exact;
    double value;
} Quantile;

static Quantile quantile_of(const int64_t *x, Py_ssize_t n, double q) {
    double h = q * (double)(n - 1);
    Py_ssize_t lo = (Py_ssize_t)h, hi = lo + 1 < n ? lo + 1 : n - 1;
    int64_t a = x[lo], b = x[hi];
    if (a == b || h == (double)lo)
        return (Quantile){1, a, 0.0};
    double value = (double)a + (double)((__int128)b - a) * (h - (double)lo);
    return value == 0.0 ? (Quantile){1, 0, 0.0} : (Quantile){0, 0, value};
}

static double quantile_ms(Quantile v) { return (v.is_exact ? (double)v.exact : v.value) / 1e6; }

/* g > t for an int64 g and a float t, exactly (Python compares an int and a float without rounding). */
static int int_above(int64_t g, double t) {
    if (t != t)
        return 0;
    if (t >= 9223372036854775808.0)
        return 0;
    if (t < -9223372036854775808.0)
        return 1;
    int64_t whole = (int64_t)t; /* toward 0; t - whole exact */
    return g != whole ? g > whole : t - (double)whole < 0.0;
}

/* phases' stall: Σ (g − p50) over g > 2·p50 = Σ tail − p50·len(tail), the tail of the ascending gaps. */
static double stall_ms(const int64_t *x, Py_ssize_t n, Quantile median) {
    Py_ssize_t first = n;
    while (first > 0 && (median.is_exact ? (__int128)x[first - 1] > 2 * (__int128)median.exact
                                          : int_above(x[first - 1], 2.0 * median.value)))
        first--;
    __int128 sum = 0;
    for (Py_ssize_t i = first; i < n; i++)
        sum += x[i];
    Py_ssize_t count = n - first;
    if (median.is_exact)
        return (double)(sum - (__int128)median.exact * count) / 1e6;
    return ((double)sum - median.value * (double)count) / 1e6;
}

static PyObject *itl_ms(PyObject *self, PyObject *gaps) {
    (void)self;
    Py_buffer view;
    if (int64_view(gaps, &view) < 0)
        return NULL;
    const int64_t *x = view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(int64_t);
    double p50 = 0.0, p99 = 0.0, max = 0.0, stall = 0.0;
    if (n) {
        Quantile median = quantile_of(x, n, 0.5);
        p50 = quantile_ms(median);
        p99 = quantile_ms(quantile_of(x, n, 0.99));
        max = (double)x[n - 1] / 1e6;
        stall = stall_ms(x, n, median);
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(dddd)", p50, p99, max, stall);
}

static PyMethodDef methods[] = {
    {"token_gaps", token_gaps, METH_VARARGS, "(decode_tokens, ascending gaps) of a request's token stamps."},
    {"itl_ms", itl_ms, METH_O, "(p50_ms, p99_ms, max_ms, stall_ms) of ascending gaps."},
    {"phase_terms", (PyCFunction)(void (*)(void))phase_terms, METH_FASTCALL,
     "phases.Phases's fields of a timeline: a tuple, or an instance of the type given."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_token_gaps", NULL, -1, methods};

PyMODINIT_FUNC PyInit__token_gaps(void) {
    for (int i = 0; i < N_STAMPS + N_BUFFERS; i++)
        if (!(interned[i] = PyUnicode_InternFromString(i < N_STAMPS ? STAMP_NAMES[i] : BUFFER_NAMES[i - N_STAMPS])))
            return NULL;
    return PyModule_Create(&module);
}
