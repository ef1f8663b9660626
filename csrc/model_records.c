/* The model core's reports (model_parts.h): each effect or input the core reports becomes a
 * record for the sink (make_record), a count for the summary (count_report, the Tally) or,
 * writing a trace, the record's fields in column batches (column_report, write_batch); emit
 * does what the core was built for. Also the Python objects these are made of (configured, set
 * by configure()) and the errors the core raises.
 */

#include "model_parts.h"

/* --- the Python objects the records are made of (configure()) --------------------------------- */

const char *const configured_names[NUM_CONFIGURED] = {
    "StepStarted", "RequestArrived", "HashesExtended", "ComputedBlocksFound",
    "SlotsAllocated", "BlocksCached", "RequestFinished", "RequestPreempted",
    "BlocksReleased", "BlockAllocated", "BlockStored", "BlockRemoved", "BlockTouched",
    "BlockFreed", "BoundaryStateOffloaded", "CheckpointRecorded", "CheckpointSuppressed",
    "StaleKeyLeft",
    "CheckpointFacts", "KvtraceError", "SnapshotError",
    "FULL", "PARTIAL", "CHECKPOINT", "LRU_REUSE", "STALE_CHECKPOINT", "REKEY", "TRANSIENT",
    "PROMPT_END", "JUNCTION", "FINISHED", "ABORTED", "STRIP", "KEEP_LOCAL",
};
PyObject *configured[NUM_CONFIGURED];
long configured_value[NUM_CONFIGURED];  /* the enum members' int values */

/* --- records ---------------------------------------------------------------------------------- */

PyObject *i64_list(const i64 *values, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromLongLong(values[i]);
        if (!value) { Py_DECREF(list); return NULL; }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* The ids of the blocks that are not the null block. */
static PyObject *blocks_list(const int32_t *blocks, Py_ssize_t n) {
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (blocks[i] == NULL_BLOCK) continue;
        PyObject *id = PyLong_FromLong(blocks[i]);
        if (!id || PyList_Append(list, id)) { Py_XDECREF(id); Py_DECREF(list); return NULL; }
        Py_DECREF(id);
    }
    return list;
}

/* A report's fields, by spec letter: q = i64, d = int, b = truth (int), e = enum member (its
   configured index, int), o = borrowed object, L = ids (const i64 *, Py_ssize_t), B = block ids
   without the null block (const int32_t *, Py_ssize_t), r = a request id (i64, as str). */
static int make_record(ModelCore *c, int type, const char *spec, va_list ap) {
    PyObject *args[12];
    int n = 0, failed = 0;
    for (const char *p = spec; *p; p++) {
        PyObject *arg = NULL;
        switch (*p) {
        case 'q': arg = PyLong_FromLongLong(va_arg(ap, i64)); break;
        case 'd': arg = PyLong_FromLong(va_arg(ap, int)); break;
        case 'b': arg = va_arg(ap, int) ? Py_True : Py_False; Py_INCREF(arg); break;
        case 'e': arg = configured[va_arg(ap, int)]; Py_INCREF(arg); break;
        case 'o': arg = va_arg(ap, PyObject *); Py_XINCREF(arg); break;
        case 'L': {
            const i64 *values = va_arg(ap, const i64 *);
            arg = i64_list(values, va_arg(ap, Py_ssize_t));
            break;
        }
        case 'B': {
            const int32_t *blocks = va_arg(ap, const int32_t *);
            arg = blocks_list(blocks, va_arg(ap, Py_ssize_t));
            break;
        }
        case 'r': arg = PyUnicode_FromFormat("%lld", va_arg(ap, i64)); break;
        }
        if (!arg) failed = 1;
        args[n++] = arg;
    }
    PyObject *record = failed ? NULL : PyObject_Vectorcall(configured[type], args, n, NULL);
    for (int i = 0; i < n; i++) Py_XDECREF(args[i]);
    if (!record) return -1;
    int rc = PyList_Append(c->records, record);
    Py_DECREF(record);
    return rc;
}

/* A request's first arrival in the Tally: its prompt length counts once. */
int tally_arrival(Tally *t, i64 req, i64 prompt_len) {
    return map_find(&t->arrived, req) >= 0 ? 0 : map_set(&t->arrived, req, prompt_len);
}

/* Count a report as ReplaySummary counts its record (reports.Tally does the same). */
static int count_report(ModelCore *c, int type, const char *spec, va_list ap) {
    i64 v[12];
    int n = 0;
    for (const char *p = spec; *p; p++) {
        switch (*p) {
        case 'q': case 'r': v[n++] = va_arg(ap, i64); break;
        case 'd': case 'b': v[n++] = va_arg(ap, int); break;
        case 'e': v[n++] = configured_value[va_arg(ap, int)]; break;
        case 'o': (void)va_arg(ap, PyObject *); v[n++] = 0; break;
        case 'L': (void)va_arg(ap, const i64 *); v[n++] = va_arg(ap, Py_ssize_t); break;
        case 'B': (void)va_arg(ap, const int32_t *); v[n++] = va_arg(ap, Py_ssize_t); break;
        }
    }
    Tally *t = &c->tally;
    i64 value;
    switch (type) {
    case T_BLOCK_STORED:  /* block, hash, group, num_tokens, kind, req */
        t->block_group[v[0]] = (int32_t)v[2];
        if (0 <= v[4] && v[4] < NUM_STORE_KINDS) t->stored[v[2] * NUM_STORE_KINDS + v[4]]++;
        return 0;
    case T_BLOCK_REMOVED:  /* block, hash, group, num_tokens, reason */
        if (0 <= v[4] && v[4] < NUM_REMOVE_REASONS) t->removed[v[4]]++;
        if (v[4] == configured_value[E_LRU_REUSE]) t->evicted[v[2]]++;
        return 0;
    case T_BLOCK_TOUCHED:  /* block, req */
        if (t->block_group[v[0]] >= 0) t->hit_blocks[t->block_group[v[0]]]++;
        return 0;
    case T_COMPUTED_BLOCKS_FOUND:  /* req, hit, junction */
        return map_set(&t->lookups, v[0], v[1]);
    case T_SLOTS_ALLOCATED:  /* req, ..., success (8th) */
        if (!v[7] || !map_get(&t->lookups, v[0], &value)) return 0;
        map_del(&t->lookups, v[0]);
        if (map_find(&t->admitted, v[0]) >= 0) {
            t->resumed_hit_tokens += value;
            return 0;
        }
        t->hit_tokens += value;
        return map_set(&t->admitted, v[0], 1);
    case T_REQUEST_ARRIVED:  /* req, prompt_len, ... */
        return tally_arrival(t, v[0], v[1]);
    case T_REQUEST_PREEMPTED: t->preemptions++; return 0;
    case T_CHECKPOINT_SUPPRESSED: t->suppressed++; return 0;
    case T_STALE_KEY_LEFT: t->stale++; return 0;
    }
    return 0;
}

/* --- the column batches ------------------------------------------------------------------- */

static int kinds_push(Columns *w, uint8_t kind) {
    if (w->num_kinds == w->cap_kinds) {
        Py_ssize_t size = w->cap_kinds ? w->cap_kinds * 2 : 1 << 14;
        uint8_t *kinds = PyMem_Realloc(w->kinds, (size_t)size);
        if (!kinds) { PyErr_NoMemory(); return -1; }
        w->kinds = kinds;
        w->cap_kinds = size;
    }
    w->kinds[w->num_kinds++] = kind;
    return 0;
}

/* A report's fields into its type's columns (the spec letters of make_record). */
static int column_report(ModelCore *c, int type, const char *spec, va_list ap) {
    Columns *w = c->columns;
    TypeColumns *t = &w->types[type];
    if (!t->spec) {
        t->spec = spec;
        t->num_fields = (int)strlen(spec);
        t->values = PyMem_Calloc((size_t)t->num_fields, sizeof(LVec));
        t->elements = PyMem_Calloc((size_t)t->num_fields, sizeof(LVec));
        if (!t->values || !t->elements) { PyErr_NoMemory(); return -1; }
    } else if (t->spec != spec && strcmp(t->spec, spec)) {
        PyErr_Format(PyExc_SystemError, "model core: %s reported two ways", configured_names[type]);
        return -1;
    }
    int f = 0;
    for (const char *p = spec; *p; p++, f++) {
        i64 value = 0;
        switch (*p) {
        case 'q': case 'r': value = va_arg(ap, i64); break;
        case 'd': case 'b': value = va_arg(ap, int); break;
        case 'e': value = configured_value[va_arg(ap, int)]; break;
        case 'o':
            value = PyLong_AsLongLong(va_arg(ap, PyObject *));
            if (value == -1 && PyErr_Occurred()) return -1;
            break;
        case 'L': {
            const i64 *values = va_arg(ap, const i64 *);
            value = va_arg(ap, Py_ssize_t);
            for (Py_ssize_t i = 0; i < value; i++)
                if (lvec_push(&t->elements[f], values[i])) return -1;
            break;
        }
        case 'B': {  /* without the null block */
            const int32_t *blocks = va_arg(ap, const int32_t *);
            Py_ssize_t n = va_arg(ap, Py_ssize_t);
            for (Py_ssize_t i = 0; i < n; i++)
                if (blocks[i] != NULL_BLOCK && (++value, lvec_push(&t->elements[f], blocks[i])))
                    return -1;
            break;
        }
        }
        if (lvec_push(&t->values[f], value)) return -1;
    }
    return kinds_push(w, (uint8_t)type);
}

static int out_reserve(Columns *w, size_t more) {
    if (w->out_len + more <= w->out_cap) return 0;
    size_t size = w->out_cap ? w->out_cap : 1 << 16;
    while (size < w->out_len + more) size *= 2;
    char *out = PyMem_Realloc(w->out, size);
    if (!out) { PyErr_NoMemory(); return -1; }
    w->out = out;
    w->out_cap = size;
    return 0;
}
static int out_bytes(Columns *w, const void *data, size_t n) {
    if (out_reserve(w, n)) return -1;
    memcpy(w->out + w->out_len, data, n);
    w->out_len += n;
    return 0;
}
/* msgpack headers as msgspec writes them: fix forms first, then 8/16/32-bit lengths */
static int out_header(Columns *w, size_t n, uint8_t fix, size_t fix_max, int has8, uint8_t first) {
    uint8_t head[5];
    size_t len;
    if (fix && n <= fix_max) { head[0] = (uint8_t)(fix | n); len = 1; }  /* bin has no fix form */
    else if (has8 && n < 256) { head[0] = first; head[1] = (uint8_t)n; len = 2; }
    else if (n < 65536) { head[0] = (uint8_t)(first + has8); head[1] = (uint8_t)(n >> 8);
                          head[2] = (uint8_t)n; len = 3; }
    else { head[0] = (uint8_t)(first + has8 + 1); head[1] = (uint8_t)(n >> 24);
           head[2] = (uint8_t)(n >> 16); head[3] = (uint8_t)(n >> 8); head[4] = (uint8_t)n;
           len = 5; }
    return out_bytes(w, head, len);
}
static int out_array(Columns *w, size_t n) { return out_header(w, n, 0x90, 15, 0, 0xdc); }
static int out_bin(Columns *w, size_t n) { return out_header(w, n, 0, 0, 1, 0xc4); }
static int out_str(Columns *w, const char *text, size_t n) {
    return out_header(w, n, 0xa0, 31, 1, 0xd9) || out_bytes(w, text, n);
}

/* traceio.batches._int_column: ("i", code, raw) at the narrowest little-endian width that holds them */
static int out_int_column(Columns *w, const i64 *values, Py_ssize_t n) {
    i64 low = 0, high = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (values[i] < low) low = values[i];
        if (values[i] > high) high = values[i];
    }
    int width = (low >= -128 && high <= 127) ? 1 : (low >= -32768 && high <= 32767) ? 2
              : (low >= INT32_MIN && high <= INT32_MAX) ? 4 : 8;
    const char *code = width == 1 ? "b" : width == 2 ? "h" : width == 4 ? "i" : "q";
    if (out_array(w, 3) || out_str(w, "i", 1) || out_str(w, code, 1)
        || out_bin(w, (size_t)(n * width)) || out_reserve(w, (size_t)(n * width)))
        return -1;
    unsigned char *out = (unsigned char *)w->out + w->out_len;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)values[i];
        for (int b = 0; b < width; b++) *out++ = (unsigned char)(v >> (8 * b));
    }
    w->out_len += (size_t)(n * width);
    return 0;
}

/* The first `count` records as one batch payload handed to the sink, then dropped. */
int write_batch(ModelCore *c, Py_ssize_t count) {
    Columns *w = c->columns;
    int order[NUM_RECORD_TYPES], index_of[NUM_RECORD_TYPES];
    Py_ssize_t rows[NUM_RECORD_TYPES] = {0};
    int num_types = 0;
    for (int t = 0; t < NUM_RECORD_TYPES; t++) index_of[t] = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        int t = w->kinds[i];
        if (index_of[t] < 0) { index_of[t] = num_types; order[num_types++] = t; }
        rows[t]++;
    }
    w->out_len = 0;
    PyObject *counts = PyDict_New();
    int rc = counts ? 0 : -1;
    rc = rc || out_array(w, 3) || out_array(w, (size_t)num_types);
    for (int k = 0; k < num_types && !rc; k++) {
        Py_ssize_t size;
        const char *tag = PyUnicode_AsUTF8AndSize(w->tags[order[k]], &size);
        PyObject *n = PyLong_FromSsize_t(rows[order[k]]);
        rc = !tag || !n || out_str(w, tag, (size_t)size)
             || PyDict_SetItem(counts, w->tags[order[k]], n);
        Py_XDECREF(n);
    }
    rc = rc || out_bin(w, (size_t)count) || out_reserve(w, (size_t)count);
    if (!rc) {
        for (Py_ssize_t i = 0; i < count; i++) w->out[w->out_len++] = (char)index_of[w->kinds[i]];
    }
    rc = rc || out_array(w, (size_t)num_types);
    for (int k = 0; k < num_types && !rc; k++) {
        TypeColumns *t = &w->types[order[k]];
        Py_ssize_t n = rows[order[k]];
        rc = out_array(w, (size_t)t->num_fields);
        for (int f = 0; f < t->num_fields && !rc; f++) {
            LVec *values = &t->values[f], *elements = &t->elements[f];
            char letter = t->spec[f];
            if (letter == 'L' || letter == 'B') {
                i64 total = 0;
                for (Py_ssize_t i = 0; i < n; i++) total += values->v[i];
                rc = out_array(w, 3) || out_str(w, "l", 1) || out_int_column(w, values->v, n)
                     || out_int_column(w, elements->v, total);
                if (!rc) {  /* drop them */
                    memmove(elements->v, elements->v + total,
                            (size_t)(elements->n - total) * sizeof(i64));
                    elements->n -= total;
                }
            } else if (letter == 'r') {  /* the request id: the request's number, as a string */
                size_t start;
                rc = out_array(w, 2) || out_str(w, "o", 1);
                if (rc) break;
                /* the bin's length comes first: encode the strings after a placeholder */
                char digits[32];
                size_t total = n < 16 ? 1 : n < 65536 ? 3 : 5;
                for (Py_ssize_t i = 0; i < n; i++) {
                    int len = snprintf(digits, sizeof(digits), "%lld", values->v[i]);
                    total += (size_t)len + (len <= 31 ? 1 : 2);
                }
                rc = out_bin(w, total);
                start = w->out_len;
                rc = rc || out_array(w, (size_t)n);
                for (Py_ssize_t i = 0; i < n && !rc; i++) {
                    int len = snprintf(digits, sizeof(digits), "%lld", values->v[i]);
                    rc = out_str(w, digits, (size_t)len);
                }
                if (!rc && w->out_len - start != total) {
                    PyErr_SetString(PyExc_SystemError, "model core: a request id column");
                    rc = -1;
                }
            } else {
                rc = out_int_column(w, values->v, n);
            }
            if (!rc) {
                memmove(values->v, values->v + n, (size_t)(values->n - n) * sizeof(i64));
                values->n -= n;
            }
        }
    }
    if (!rc) {
        memmove(w->kinds, w->kinds + count, (size_t)(w->num_kinds - count));
        w->num_kinds -= count;
        PyObject *payload = PyBytes_FromStringAndSize(w->out, (Py_ssize_t)w->out_len);
        PyObject *result = payload ? PyObject_CallFunctionObjArgs(w->sink, payload, counts, NULL)
                                   : NULL;
        rc = result ? 0 : -1;
        Py_XDECREF(result);
        Py_XDECREF(payload);
    }
    Py_XDECREF(counts);
    return rc;
}

/* Report an effect or input: a record for the sink, or a count (and, writing columns, the
   record's fields into them). */
int emit(ModelCore *c, int type, const char *spec, ...) {
    va_list ap;
    va_start(ap, spec);
    int rc;
    if (c->columns) {
        va_list copy;
        va_copy(copy, ap);
        rc = count_report(c, type, spec, ap) || column_report(c, type, spec, copy);
        va_end(copy);
    } else {
        rc = c->counting ? count_report(c, type, spec, ap) : make_record(c, type, spec, ap);
    }
    va_end(ap);
    return rc;
}

/* Hand the records made so far to the sink, in order (they are dropped either way); writing
   columns, every whole batch of them. */
int flush(ModelCore *c) {
    if (c->columns) {
        while (c->columns->num_kinds >= c->columns->batch_size)
            if (write_batch(c, c->columns->batch_size)) return -1;
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(c->records);
    if (!n) return 0;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && !rc; i++) {
        PyObject *result = PyObject_CallOneArg(c->sink, PyList_GET_ITEM(c->records, i));
        if (!result) rc = -1;
        Py_XDECREF(result);
    }
    if (PyList_SetSlice(c->records, 0, PyList_GET_SIZE(c->records), NULL)) rc = -1;
    return rc;
}

/* --- errors and arguments --------------------------------------------------------------------- */

/* Raise the configured KvtraceError class ``type`` (T_KVTRACE_ERROR, T_SNAPSHOT_ERROR) with
   a message and a hint (NULL: the class's own). Returns -1. */
int set_error_v(int type, const char *hint, const char *format, va_list ap) {
    PyObject *message = PyUnicode_FromFormatV(format, ap);
    if (!message) return -1;
    PyObject *error = PyObject_CallFunction(configured[type], "Oz", message, hint);
    Py_DECREF(message);
    if (error) {
        PyErr_SetObject((PyObject *)Py_TYPE(error), error);
        Py_DECREF(error);
    }
    return -1;
}

/* A sequence of block ids appended to ``out``. */
int block_ids_of(PyObject *ids, IVec *out) {
    Py_ssize_t n = PySequence_Length(ids);
    if (n < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(ids, i);
        long block = item ? PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (PyErr_Occurred() || ivec_push(out, (int32_t)block)) return -1;
    }
    return 0;
}
