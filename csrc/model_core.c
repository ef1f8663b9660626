/* kvtrace._model_core: the native twin of the model replay backend (kvtrace/replay/model/).
 *
 * The pure-Python model (pool.py, managers.py, backend.py) is the reference; this file does the
 * same, function for function (names follow the Python twin), on C arrays: the block pool (ref
 * counts, primary and secondary keys, the free queue, one hash map per KV-cache group), the
 * full-attention and Mamba "align" managers, and the coordinator's hit search, allocation and
 * caching. It makes the same records (the kvtrace.events types handed to configure()) in the
 * same order; or, built without a sink (a summary-only replay), it makes none and counts what
 * kvtrace.replay.run.ReplaySummary would count over them (the Tally; reports.Tally in Python).
 * The checkpoint decision is the shared Python table: Variant.checkpoint_action is
 * called back with a CheckpointFacts. Built only where a C compiler is found (setup.py, optional);
 * kvtrace.replay.model uses it unless KVTRACE_NATIVE=0. tests/test_model_backend.py holds both
 * twins to vLLM record for record. A start snapshot is restored by model_restore.c, included
 * below (tests/test_native_snapshot.py).
 *
 * Python's floor division is spelled out (floordiv) where an operand can be negative.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "containers.h"

/* --- the Python objects the records are made of (configure()) -------------------------------- */

enum {
    T_STEP_STARTED, T_REQUEST_ARRIVED, T_HASHES_EXTENDED, T_COMPUTED_BLOCKS_FOUND,
    T_SLOTS_ALLOCATED, T_BLOCKS_CACHED, T_REQUEST_FINISHED, T_REQUEST_PREEMPTED,
    T_BLOCKS_RELEASED, T_BLOCK_ALLOCATED, T_BLOCK_STORED, T_BLOCK_REMOVED, T_BLOCK_TOUCHED,
    T_BLOCK_FREED, T_BOUNDARY_STATE_OFFLOADED, T_CHECKPOINT_RECORDED, T_CHECKPOINT_SUPPRESSED,
    T_STALE_KEY_LEFT,
    T_CHECKPOINT_FACTS, T_KVTRACE_ERROR, T_SNAPSHOT_ERROR,
    /* enum members */
    E_FULL, E_PARTIAL, E_CHECKPOINT, E_LRU_REUSE, E_STALE_CHECKPOINT, E_REKEY, E_TRANSIENT,
    E_PROMPT_END, E_JUNCTION, E_FINISHED, E_ABORTED, E_STRIP, E_KEEP_LOCAL,
    NUM_CONFIGURED
};
static const char *configured_names[NUM_CONFIGURED] = {
    "StepStarted", "RequestArrived", "HashesExtended", "ComputedBlocksFound",
    "SlotsAllocated", "BlocksCached", "RequestFinished", "RequestPreempted",
    "BlocksReleased", "BlockAllocated", "BlockStored", "BlockRemoved", "BlockTouched",
    "BlockFreed", "BoundaryStateOffloaded", "CheckpointRecorded", "CheckpointSuppressed",
    "StaleKeyLeft",
    "CheckpointFacts", "KvtraceError", "SnapshotError",
    "FULL", "PARTIAL", "CHECKPOINT", "LRU_REUSE", "STALE_CHECKPOINT", "REKEY", "TRANSIENT",
    "PROMPT_END", "JUNCTION", "FINISHED", "ABORTED", "STRIP", "KEEP_LOCAL",
};
static PyObject *configured[NUM_CONFIGURED];
static long configured_value[NUM_CONFIGURED];  /* the enum members' int values */

static inline i64 floordiv(i64 a, i64 b) {
    i64 q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline i64 cdiv(i64 a, i64 b) { return -floordiv(-a, b); }

/* --- the core --------------------------------------------------------------------------------- */

#define NULL_BLOCK 0

typedef struct {  /* one request's state in one manager */
    IVec table;
    int32_t num_cached; char has_num_cached;
    char has_partial; int32_t partial_index, partial_source;
    char has_last_state; int32_t last_state;
    int32_t num_retired;
    char allocated;
    char has_checkpoint; i64 checkpoint_position; int32_t checkpoint_index;
    char has_tail; int32_t tail_block; i64 tail_boundary;
} GroupState;

typedef struct {
    i64 req, prompt_len, max_tokens, num_hashes, num_tokens, num_computed, junction;
    i64 num_in_flight;  /* async scheduling: its tokens in steps still in flight */
    i64 num_reported;  /* -1: not yet reported */
    LVec hash_ids;
    GroupState *groups;
    char has_pending, pending_none;  /* pending hit: ((hits or None), num_hit) */
    i64 pending_num_hit;
    IVec *pending;  /* per group */
} Request;

typedef struct { i64 *hash; int32_t *group; int n, cap; } Extra;

typedef struct {
    int is_mamba, block_size, group, has_checkpoint_blocks;
    i64 checkpoint_alignment;  /* -1: None */
    IVec cow;  /* (source, copy) pairs */
    LVec cached_this_step;
} Manager;

typedef struct { int is_mamba, block_size, num_groups; int groups[64]; } SpecGroup;

#define NUM_STORE_KINDS 3     /* events.StoreKind */
#define NUM_REMOVE_REASONS 6  /* events.RemoveReason */

/* ReplaySummary's figures, counted from the reports (reports.Tally, field for field). */
typedef struct {
    int32_t *block_group;  /* per block: the group of its last stored key, -1 before any */
    i64 *hit_blocks, *evicted, *stored;  /* per group; stored: group x StoreKind */
    i64 removed[NUM_REMOVE_REASONS];
    i64 hit_tokens, resumed_hit_tokens, suppressed, stale, preemptions;
    Map arrived;  /* req -> the prompt length of its first arrival */
    Map lookups;  /* req -> the hit of its last lookup, until an allocation succeeds */
    Map admitted;  /* req -> 1 once admitted */
} Tally;

/* The records as a trace's column batches (traceio.encode_batch, byte for byte): per record
   type its fields' values in order (a list field: its lengths, and its values apart). */
#define NUM_RECORD_TYPES (T_STALE_KEY_LEFT + 1)
typedef struct {
    const char *spec;  /* the emit spec of its records (each type has one) */
    int num_fields;
    LVec *values, *elements;  /* per field */
} TypeColumns;

typedef struct {
    PyObject *sink;  /* sink(payload, counts): one batch frame's payload and its records per tag */
    Py_ssize_t batch_size;
    uint8_t *kinds; Py_ssize_t num_kinds, cap_kinds;  /* the T_* of each record, in order */
    TypeColumns types[NUM_RECORD_TYPES];
    PyObject *tags[NUM_RECORD_TYPES];
    char *out; size_t out_len, out_cap;  /* the payload being encoded */
} Columns;

typedef struct {
    PyObject_HEAD
    PyObject *sink, *records, *variant, *checkpoint_action;
    /* engine */
    int num_blocks, hash_block_size, num_groups, num_specs, enable_caching, hybrid;
    int partial_hits, simple_hybrid, reserve_every_chunk, alignment;
    i64 scheduler_block_size, max_model_len, retention;  /* retention -1: None */
    Manager *managers;
    SpecGroup *specs;
    /* pool */
    int32_t *ref, *next_free, *prev_free, *key_group;
    i64 *key_hash, *key_tokens;
    char *has_key;
    Extra **extra;
    Map *cached;
    IVec *multi; Py_ssize_t num_multi, cap_multi; IVec free_multi;
    int head, tail;
    i64 num_free;
    Map depth;
    /* requests */
    Map request_slots;
    Request **requests; Py_ssize_t num_requests, cap_requests; IVec free_requests;
    i64 next_made_up;
    IVec scratch, scratch2;
    IVec *hits;  /* per group: the last lookup's result */
    int counting;  /* no sink: count into tally, make no record */
    Tally tally;
    Columns *columns;  /* counting, and writing the records as column batches */
} Core;

/* --- records ---------------------------------------------------------------------------------- */

static PyObject *i64_list(const i64 *values, Py_ssize_t n) {
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
static int make_record(Core *c, int type, const char *spec, va_list ap) {
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
static int tally_arrival(Tally *t, i64 req, i64 prompt_len) {
    return map_find(&t->arrived, req) >= 0 ? 0 : map_set(&t->arrived, req, prompt_len);
}

/* Count a report as ReplaySummary counts its record (reports.Tally does the same). */
static int count_report(Core *c, int type, const char *spec, va_list ap) {
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
static int column_report(Core *c, int type, const char *spec, va_list ap) {
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

/* traceio._int_column: ("i", code, raw) at the narrowest little-endian width that holds them */
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
static int write_batch(Core *c, Py_ssize_t count) {
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
static int emit(Core *c, int type, const char *spec, ...) {
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
static int flush(Core *c) {
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

static i64 depth_get(Core *c, i64 hash_id, i64 fallback) {
    i64 value;
    return map_get(&c->depth, hash_id, &value) ? value : fallback;
}

/* --- the pool (pool.py) ----------------------------------------------------------------------- */

static int32_t holder_first(Core *c, i64 holder) {
    return holder >= 0 ? (int32_t)holder : c->multi[-holder - 1].v[0];
}
static int32_t cached_block(Core *c, i64 hash_id, int group) {
    i64 holder;
    if (!map_get(&c->cached[group], hash_id, &holder)) return -1;
    return holder_first(c, holder);
}
static int holds(Core *c, i64 hash_id, int group, int32_t block) {
    i64 holder;
    if (!map_get(&c->cached[group], hash_id, &holder)) return 0;
    if (holder >= 0) return holder == block;
    IVec *list = &c->multi[-holder - 1];
    for (Py_ssize_t i = 0; i < list->n; i++)
        if (list->v[i] == block) return 1;
    return 0;
}
static int unmap(Core *c, i64 hash_id, int group, int32_t block) {
    Map *table = &c->cached[group];
    Py_ssize_t slot = map_find(table, hash_id);
    if (slot < 0) return 0;
    i64 holder = table->slots[slot].val;
    if (holder >= 0) {
        if (holder != block) return 0;
        map_del_at(table, (size_t)slot);
        return 1;
    }
    IVec *list = &c->multi[-holder - 1];
    for (Py_ssize_t i = 0; i < list->n; i++) {
        if (list->v[i] != block) continue;
        memmove(list->v + i, list->v + i + 1, (size_t)(list->n - i - 1) * sizeof(int32_t));
        list->n--;
        if (!list->n) {
            ivec_push(&c->free_multi, (int32_t)(-holder - 1));
            map_del_at(table, (size_t)slot);
        }
        return 1;
    }
    return 0;
}
static int map_block(Core *c, i64 hash_id, int group, int32_t block) {
    Map *table = &c->cached[group];
    Py_ssize_t slot = map_find(table, hash_id);
    if (slot < 0) return map_set(table, hash_id, block);
    i64 holder = table->slots[slot].val;
    if (holder < 0) return ivec_push(&c->multi[-holder - 1], block);
    Py_ssize_t index;
    if (c->free_multi.n) {
        index = c->free_multi.v[--c->free_multi.n];
    } else {
        if (c->num_multi == c->cap_multi) {
            Py_ssize_t size = c->cap_multi ? c->cap_multi * 2 : 16;
            IVec *multi = PyMem_Realloc(c->multi, (size_t)size * sizeof(IVec));
            if (!multi) { PyErr_NoMemory(); return -1; }
            memset(multi + c->cap_multi, 0, (size_t)(size - c->cap_multi) * sizeof(IVec));
            c->multi = multi;
            c->cap_multi = size;
        }
        index = c->num_multi++;
    }
    IVec *list = &c->multi[index];
    list->n = 0;
    if (ivec_push(list, (int32_t)holder) || ivec_push(list, block)) return -1;
    table->slots[slot].val = -(i64)index - 1;
    return 0;
}

/* A secondary key on ``block`` (one beside its primary). */
static int add_extra_key(Core *c, int32_t block, i64 hash_id, int group) {
    Extra *extra = c->extra[block];
    if (!extra) {
        extra = c->extra[block] = PyMem_Calloc(1, sizeof(Extra));
        if (!extra) { PyErr_NoMemory(); return -1; }
    }
    if (extra->n == extra->cap) {
        int size = extra->cap ? extra->cap * 2 : 2;
        i64 *hashes = PyMem_Realloc(extra->hash, (size_t)size * sizeof(i64));
        if (!hashes) { PyErr_NoMemory(); return -1; }
        extra->hash = hashes;
        int32_t *groups = PyMem_Realloc(extra->group, (size_t)size * sizeof(int32_t));
        if (!groups) { PyErr_NoMemory(); return -1; }
        extra->group = groups;
        extra->cap = size;
    }
    extra->hash[extra->n] = hash_id;
    extra->group[extra->n++] = group;
    return 0;
}

static int insert_key(Core *c, i64 hash_id, int group, int32_t block, i64 num_tokens,
                      int kind, i64 req) {
    if (c->has_key[block] && c->key_hash[block] == hash_id && c->key_group[block] == group)
        return 0;
    if (holds(c, hash_id, group, block)) return 0;
    if (!c->has_key[block]) {
        c->has_key[block] = 1;
        c->key_hash[block] = hash_id;
        c->key_group[block] = group;
        c->key_tokens[block] = num_tokens;
    } else if (add_extra_key(c, block, hash_id, group)) {
        return -1;
    }
    if (map_block(c, hash_id, group, block)) return -1;
    return emit(c, T_BLOCK_STORED, "dqdqeq", block, hash_id, group,
                depth_get(c, hash_id, num_tokens), kind, req);
}

/* Take every key off ``block`` and report the removed ones; their keys go to ``removed`` (hash,
   group pairs) when given. Returns the count, or -1 on error. */
static int strip_keys(Core *c, int32_t block, int reason, LVec *removed) {
    if (!c->has_key[block]) return 0;
    i64 first_hash = c->key_hash[block];
    int first_group = c->key_group[block];
    Extra *extra = c->extra[block];
    c->extra[block] = NULL;
    c->has_key[block] = 0;
    c->key_tokens[block] = -1;
    int count = 0, rc = 0;
    int total = 1 + (extra ? extra->n : 0);
    for (int k = 0; k < total && !rc; k++) {
        i64 hash_id = k ? extra->hash[k - 1] : first_hash;
        int group = k ? extra->group[k - 1] : first_group;
        if (!unmap(c, hash_id, group, block)) continue;
        rc = emit(c, T_BLOCK_REMOVED, "dqdqe", block, hash_id, group, depth_get(c, hash_id, 0),
                  reason);
        if (!rc && removed) rc = lvec_push(removed, hash_id) || lvec_push(removed, group);
        count++;
    }
    if (extra) { PyMem_Free(extra->hash); PyMem_Free(extra->group); PyMem_Free(extra); }
    return rc ? -1 : count;
}

static int move_keys(Core *c, int32_t source, int32_t target, i64 req) {
    i64 num_tokens = c->key_tokens[source];
    LVec removed = {0};
    int rc = strip_keys(c, source, E_REKEY, &removed) < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i + 1 < removed.n && !rc; i += 2)
        rc = insert_key(c, removed.v[i], (int)removed.v[i + 1], target, num_tokens, E_PARTIAL,
                        req);
    lvec_free(&removed);
    return rc;
}

static int get_new_blocks(Core *c, i64 count, i64 req, IVec *out) {
    if (count > c->num_free) {
        PyErr_Format(PyExc_ValueError, "Cannot get %lld free blocks from the pool", count);
        return -1;
    }
    out->n = 0;
    if (count <= 0) return 0;
    if (ivec_reserve(out, count)) return -1;
    int32_t block = c->next_free[c->head];
    for (i64 i = 0; i < count; i++) {
        out->v[out->n++] = block;
        int32_t following = c->next_free[block];
        c->next_free[block] = c->prev_free[block] = -1;
        block = following;
    }
    c->next_free[c->head] = block;
    c->prev_free[block] = c->head;
    c->num_free -= count;
    if (c->enable_caching)
        for (Py_ssize_t i = 0; i < out->n; i++)
            if (c->has_key[out->v[i]] && strip_keys(c, out->v[i], E_LRU_REUSE, NULL) < 0)
                return -1;
    for (Py_ssize_t i = 0; i < out->n; i++) {
        c->ref[out->v[i]] = 1;
        if (emit(c, T_BLOCK_ALLOCATED, "dq", out->v[i], req)) return -1;
    }
    return 0;
}

static int touch(Core *c, const int32_t *blocks, Py_ssize_t n, i64 req) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t block = blocks[i];
        if (block == NULL_BLOCK) continue;
        if (c->ref[block] == 0) {
            int32_t before = c->prev_free[block], after = c->next_free[block];
            c->next_free[before] = after;
            c->prev_free[after] = before;
            c->next_free[block] = c->prev_free[block] = -1;
            c->num_free--;
        }
        c->ref[block]++;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (blocks[i] != NULL_BLOCK && emit(c, T_BLOCK_TOUCHED, "dq", blocks[i], req))
            return -1;
    return 0;
}

static int free_blocks(Core *c, const int32_t *blocks, Py_ssize_t n, int released) {
    if (released && emit(c, T_BLOCKS_RELEASED, "B", blocks, n)) return -1;
    /* Unkeyed blocks go to the head in the given order, keyed ones to the tail. */
    int32_t previous = c->head, old_first = c->next_free[c->head];
    IVec *keyed = &c->scratch2;
    keyed->n = 0;
    i64 num_first = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t block = blocks[i];
        if (block == NULL_BLOCK) continue;
        if (--c->ref[block] != 0) continue;
        if (!c->has_key[block] || !c->enable_caching) {
            c->prev_free[block] = previous;
            c->next_free[previous] = block;
            previous = block;
            num_first++;
        } else if (ivec_push(keyed, block)) {
            return -1;
        }
    }
    if (num_first) {
        c->next_free[previous] = old_first;
        c->prev_free[old_first] = previous;
    }
    previous = c->prev_free[c->tail];
    for (Py_ssize_t i = 0; i < keyed->n; i++) {
        int32_t block = keyed->v[i];
        c->prev_free[block] = previous;
        c->next_free[previous] = block;
        previous = block;
    }
    if (keyed->n) {
        c->next_free[previous] = c->tail;
        c->prev_free[c->tail] = previous;
    }
    c->num_free += num_first + keyed->n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t block = blocks[i];
        if (block != NULL_BLOCK &&
            emit(c, T_BLOCK_FREED, "ddb", block, c->ref[block], (int)c->has_key[block]))
            return -1;
    }
    return 0;
}

static int cache_full_blocks(Core *c, Request *r, IVec *table, i64 num_cached, i64 num_full,
                             int block_size, int group, const char *mask) {
    i64 scale = block_size / c->hash_block_size;
    i64 stop = num_full < table->n ? num_full : table->n;
    for (i64 index = num_cached; index < stop; index++) {
        int32_t block = table->v[index];
        if (block == NULL_BLOCK || (mask && !mask[index - num_cached])) continue;
        i64 num_tokens = (index + 1) * block_size;
        if (c->has_key[block]) {
            if (c->key_tokens[block] >= num_tokens) {
                PyErr_Format(PyExc_AssertionError, "block %d is keyed past %lld tokens", block,
                             num_tokens);
                return -1;
            }
            if (strip_keys(c, block, E_REKEY, NULL) < 0) return -1;
        }
        if (insert_key(c, r->hash_ids.v[(index + 1) * scale - 1], group, block, num_tokens,
                       E_FULL, r->req))
            return -1;
    }
    return 0;
}

/* 1 and *key: keyed; 0: the null block (None); -1: error. */
static int cache_partial_block(Core *c, Request *r, int32_t block, i64 num_tokens, int group,
                               int replace, int kind, i64 *key) {
    if (block == NULL_BLOCK) return 0;
    i64 unit = c->hash_block_size, num_units = num_tokens / unit;
    if (num_tokens % unit || !(0 < num_units && num_units <= r->num_hashes)) {
        PyErr_Format(PyExc_AssertionError, "no hash unit ends at %lld tokens", num_tokens);
        return -1;
    }
    i64 hash_id = r->hash_ids.v[num_units - 1];
    if (replace) {
        if (strip_keys(c, block, E_REKEY, NULL) < 0) return -1;
    } else if (c->has_key[block]
               && !(c->key_hash[block] == hash_id && c->key_group[block] == group)
               && !holds(c, hash_id, group, block)
               && c->key_tokens[block] < num_units * unit) {
        if (strip_keys(c, block, E_REKEY, NULL) < 0) return -1;
    }
    if (insert_key(c, hash_id, group, block, num_units * unit, kind, r->req)) return -1;
    *key = hash_id;
    return 1;
}

/* --- the managers (managers.py) --------------------------------------------------------------- */

static i64 checkpoint_position(i64 num_tokens, i64 unit) {
    i64 position = floordiv(num_tokens - 1, unit) * unit;
    return position > 0 ? position : 0;
}

static int num_evictable(Core *c, IVec *hit) {
    int count = 0;
    for (Py_ssize_t i = 0; i < hit->n; i++)
        if (hit->v[i] != NULL_BLOCK && c->ref[hit->v[i]] == 0) count++;
    return count;
}

static int checkpoint_valid(Manager *m, int unit, i64 start, i64 end, i64 position) {
    if (m->checkpoint_alignment < 0) return 0;
    i64 block = m->block_size;
    return floordiv(start, unit) * unit == start
        && cdiv(end, block) - 2 > floordiv(start - 1, block)
        && start + unit <= position && start < position && position < end
        && (position - start) % m->checkpoint_alignment == 0;
}

static int blocks_to_allocate(Core *c, Manager *m, Request *r, i64 num_tokens, IVec *hit,
                              i64 total, i64 num_local, i64 num_main, int admission,
                              i64 prefill_end, i64 *need) {
    GroupState *s = &r->groups[m->group];
    i64 block_size = m->block_size;
    if (!m->is_mamba) {
        i64 num_new = cdiv(num_tokens, block_size) - s->table.n;
        if (s->has_num_cached || !hit->n) { *need = num_new > 0 ? num_new : 0; return 0; }
        num_new -= hit->n;
        if (num_new < 0) num_new = 0;
        if (num_local % block_size) num_new++;
        *need = num_new + num_evictable(c, hit);
        return 0;
    }
    if (hit->n && c->has_key[hit->v[hit->n - 1]]) {
        i64 key = c->key_hash[hit->v[hit->n - 1]];
        for (Py_ssize_t i = 0; i < m->cached_this_step.n; i++)
            if (m->cached_this_step.v[i] == key) { *need = c->num_blocks + 1; return 0; }
    }
    i64 required = cdiv(num_main, block_size);
    i64 num_new = required - hit->n - s->table.n;
    int has_partial_hit = (hit->n ? num_local % block_size != 0 : 0) || s->has_partial;
    if (has_partial_hit) num_new = (num_new > 0 ? num_new : 0) + 1;
    if (c->reserve_every_chunk) prefill_end = 0;
    i64 position = 0;
    if (m->has_checkpoint_blocks && num_main >= prefill_end) {
        position = checkpoint_position(num_main, c->alignment);
        i64 index = cdiv(num_main, block_size) - 2;
        if (!(total < position && checkpoint_valid(m, c->hash_block_size, total, num_main,
                                                   position)
              && index >= 0 && (index >= s->table.n || s->table.v[index] == NULL_BLOCK)))
            position = 0;
    }
    if (!admission) {
        if (position > 0) {
            s->has_checkpoint = 1;
            s->checkpoint_position = position;
            s->checkpoint_index = (int32_t)(required - 2);
            int kind = position == r->junction ? E_JUNCTION
                : num_main < r->prompt_len ? E_TRANSIENT : E_PROMPT_END;
            if (emit(c, T_CHECKPOINT_RECORDED, "qdqde", r->req, m->group, position,
                     (int)(required - 2), kind))
                return -1;
        } else {
            s->has_checkpoint = 0;
        }
    }
    if (num_new > 0) {
        i64 cap = 1 + has_partial_hit + (position > 0);
        if (num_new > cap) num_new = cap;
    }
    *need = hit->n ? num_new + num_evictable(c, hit) : num_new;
    return 0;
}

static int apply_cow(Core *c, Manager *m, Request *r, int32_t index, int32_t source,
                     int32_t copy) {
    IVec *table = &r->groups[m->group].table;
    if (!(index < table->n && table->v[index] == source && source != NULL_BLOCK
          && c->ref[source] > 0)) {
        PyErr_Format(PyExc_AssertionError, "request %lld: no shared block %d at %d", r->req,
                     source, index);
        return -1;
    }
    table->v[index] = copy;
    if (ivec_push(&m->cow, source) || ivec_push(&m->cow, copy)) return -1;
    c->ref[copy]++;
    return 0;
}

static int add_hit(Core *c, Manager *m, Request *r, IVec *hit, i64 num_local, i64 total) {
    GroupState *s = &r->groups[m->group];
    if (s->table.n) {
        PyErr_Format(PyExc_AssertionError, "request %lld already holds blocks", r->req);
        return -1;
    }
    i64 skipped = m->is_mamba ? floordiv(total - 1, m->block_size) : 0;
    const int32_t *blocks = hit->v;
    Py_ssize_t n = hit->n;
    if (skipped > 0) {
        Py_ssize_t drop = skipped < n ? (Py_ssize_t)skipped : n;
        blocks += drop;
        n -= drop;
    }
    if (c->enable_caching && touch(c, blocks, n, r->req)) return -1;
    for (i64 i = 0; i < skipped; i++)
        if (ivec_push(&s->table, NULL_BLOCK)) return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (ivec_push(&s->table, blocks[i])) return -1;
    s->has_num_cached = 1;
    s->num_cached = (int32_t)s->table.n;
    if (n && num_local % m->block_size) {
        s->has_partial = 1;
        s->partial_index = (int32_t)(num_local / m->block_size);
        s->partial_source = blocks[n - 1];
        s->num_cached = s->partial_index;
    }
    return 0;
}

static int allocate_blocks(Core *c, Manager *m, Request *r, i64 num_tokens, i64 num_main) {
    GroupState *s = &r->groups[m->group];
    IVec *table = &s->table, *fresh = &c->scratch;
    i64 block_size = m->block_size;
    if (!m->is_mamba) {
        if (s->has_partial) {
            s->has_partial = 0;
            if (get_new_blocks(c, 1, r->req, fresh)
                || apply_cow(c, m, r, s->partial_index, s->partial_source, fresh->v[0]))
                return -1;
        }
        i64 num_new = cdiv(num_tokens, block_size) - table->n;
        if (num_new > 0) {
            if (get_new_blocks(c, num_new, r->req, fresh)) return -1;
            for (Py_ssize_t i = 0; i < fresh->n; i++)
                if (ivec_push(table, fresh->v[i])) return -1;
        }
        return 0;
    }
    i64 required = cdiv(num_main, block_size);
    int has_checkpoint = s->has_checkpoint, has_partial = s->has_partial;
    if (required <= table->n && !has_partial && !has_checkpoint) {
        s->allocated = 1;
        return 0;
    }
    Py_ssize_t num_held = table->n;
    int was_allocated = s->allocated;
    if (was_allocated || num_held > 0) {
        s->has_last_state = 1;
        s->last_state = (int32_t)(num_held - 1);
    }
    i64 null_end = required - 1 - has_checkpoint;
    for (i64 i = num_held; i < null_end; i++)
        if (ivec_push(table, NULL_BLOCK)) return -1;
    i64 num_new = required - table->n;
    if (num_new < 0) num_new = 0;
    num_new += has_partial;
    if (num_new > 1 + has_partial + has_checkpoint) {
        PyErr_Format(PyExc_AssertionError, "request %lld: %lld new Mamba blocks", r->req,
                     num_new);
        return -1;
    }
    if (get_new_blocks(c, num_new, r->req, fresh)) return -1;
    Py_ssize_t first_new = 0;
    if (has_partial) {
        int32_t index = s->partial_index, source = s->partial_source, copy = fresh->v[0];
        first_new = 1;
        if (was_allocated) {
            if (table->v[index] != source) {
                PyErr_Format(PyExc_AssertionError, "request %lld: block %d left slot %d",
                             r->req, source, index);
                return -1;
            }
            if (move_keys(c, source, copy, r->req)) return -1;
            if (ivec_push(&m->cow, source) || ivec_push(&m->cow, copy)) return -1;
            c->ref[source]++;
            if (s->has_tail) {
                s->has_tail = 0;
                if (emit(c, T_BOUNDARY_STATE_OFFLOADED, "qddq", r->req, m->group, copy,
                         s->tail_boundary))
                    return -1;
            }
            if (c->has_key[copy] && lvec_push(&m->cached_this_step, c->key_hash[copy]))
                return -1;
        } else if (apply_cow(c, m, r, index, source, copy)) {
            return -1;
        }
    }
    for (Py_ssize_t i = first_new; i < fresh->n; i++)
        if (ivec_push(table, fresh->v[i])) return -1;
    s->allocated = 1;
    s->has_partial = 0;
    return 0;
}

static int retire(Core *c, Manager *m, Request *r, i64 num_processed) {
    GroupState *s = &r->groups[m->group];
    IVec *table = &s->table;
    i64 block_size = m->block_size;
    if (num_processed - 1 > 0 && table->n) {
        i64 last = floordiv(num_processed - 1, block_size);
        if (last > table->n) last = table->n;
        i64 first = s->num_retired;
        if (first < last) {
            IVec *freed = &c->scratch;
            freed->n = 0;
            for (i64 index = last - 1; index >= first; index--) {
                if (table->v[index] == NULL_BLOCK) continue;
                if (ivec_push(freed, table->v[index])) return -1;
                table->v[index] = NULL_BLOCK;
            }
            if (freed->n && free_blocks(c, freed->v, freed->n, 0)) return -1;
            s->num_retired = (int32_t)last;
        }
    }
    if (s->has_last_state && s->last_state < cdiv(num_processed, block_size) - 1) {
        Py_ssize_t index = s->last_state < 0 ? table->n + s->last_state : s->last_state;
        int32_t block = table->v[index];
        if (block != NULL_BLOCK) {
            if (free_blocks(c, &block, 1, 0)) return -1;
            table->v[index] = NULL_BLOCK;
        }
    }
    return 0;
}

/* reachable_block_mask into ``mask`` (end - start entries); returns 0 for None (dense). */
static int block_mask(Core *c, Manager *m, i64 start, i64 end, const i64 *boundaries,
                      int num_boundaries, char *mask) {
    if (!m->is_mamba || c->retention == -1) return 0;
    i64 block_size = m->block_size;
    memset(mask, 0, (size_t)(end - start));
    if (c->retention) {
        i64 per_segment = c->retention / block_size;
        if (per_segment <= 1) return 0;
        i64 first = (start + per_segment) / per_segment * per_segment - 1;
        for (i64 index = first - start; index < end - start; index += per_segment)
            mask[index] = 1;
    }
    for (int i = 0; i < num_boundaries; i++) {
        i64 index = floordiv(floordiv(boundaries[i], c->alignment) * c->alignment,
                             block_size) - 1;
        if (start <= index && index < end) mask[index - start] = 1;
    }
    return 1;
}

static int cache_full(Core *c, Manager *m, Request *r, i64 num_cached, i64 num_full) {
    GroupState *s = &r->groups[m->group];
    i64 boundaries[2] = {r->prompt_len - 1, r->junction};
    char small[256], *mask = NULL, *heap = NULL;
    if (m->is_mamba && c->retention != -1) {
        mask = num_full - num_cached <= 256 ? small
            : (heap = PyMem_Malloc((size_t)(num_full - num_cached)));
        if (!mask) { PyErr_NoMemory(); return -1; }
        if (!block_mask(c, m, num_cached, num_full, boundaries, r->junction ? 2 : 1, mask))
            mask = NULL;
    }
    int rc = cache_full_blocks(c, r, &s->table, num_cached, num_full, m->block_size, m->group,
                               mask);
    PyMem_Free(heap);
    if (rc) return -1;
    s->has_num_cached = 1;
    s->num_cached = (int32_t)num_full;
    return 0;
}

static int is_retained(Core *c, Manager *m, i64 position) {
    if (position % m->block_size) return 0;
    i64 index = position / m->block_size - 1;
    char keep;
    return !block_mask(c, m, index, index + 1, NULL, 0, &keep) || keep;
}

/* Decision 2, by the shared Python table; *keyed: a key was published (*key). */
static int decide_checkpoint(Core *c, Manager *m, Request *r, i64 num_tokens, int *keyed,
                             i64 *key, int *stripped) {
    GroupState *s = &r->groups[m->group];
    i64 position = s->checkpoint_position;
    int32_t index = s->checkpoint_index;
    *keyed = 0;
    *stripped = 0;
    if (!(0 <= index && index < s->table.n)) {
        PyErr_Format(PyExc_AssertionError, "request %lld: no checkpoint slot %d", r->req, index);
        return -1;
    }
    int32_t slot = s->table.v[index];
    PyObject *retention = c->retention == -1 ? Py_None : PyLong_FromLongLong(c->retention);
    if (c->retention == -1) Py_INCREF(Py_None);
    PyObject *args[7] = {
        retention, PyLong_FromLongLong(num_tokens), PyLong_FromLongLong(r->prompt_len),
        PyLong_FromLongLong(position), PyLong_FromLongLong(r->junction),
        PyBool_FromLong(position == checkpoint_position(r->prompt_len, c->alignment)),
        PyBool_FromLong(is_retained(c, m, position))};
    PyObject *facts = NULL, *action = NULL;
    int ok = 1;
    for (int i = 0; i < 7; i++) ok &= args[i] != NULL;
    if (ok) facts = PyObject_Vectorcall(configured[T_CHECKPOINT_FACTS], args, 7, NULL);
    for (int i = 0; i < 7; i++) Py_XDECREF(args[i]);
    if (facts) action = PyObject_CallOneArg(c->checkpoint_action, facts);
    Py_XDECREF(facts);
    if (!action) return -1;
    int rc = 0;
    if (action == configured[E_STRIP]) {
        rc = strip_keys(c, slot, E_STALE_CHECKPOINT, NULL);
        if (rc >= 0) { *stripped = rc; rc = 0; }
    } else if (action != configured[E_KEEP_LOCAL] && c->key_tokens[slot] != position) {
        rc = cache_partial_block(c, r, slot, position, m->group, 1, E_CHECKPOINT, key);
        if (rc > 0) { *keyed = 1; rc = 0; }
    }
    Py_DECREF(action);
    return rc;
}

static int cache_prompt_tail(Core *c, Manager *m, Request *r, i64 num_tokens, int *keyed,
                             i64 *key) {
    GroupState *s = &r->groups[m->group];
    *keyed = 0;
    if (num_tokens != checkpoint_position(r->prompt_len, c->hash_block_size)) return 0;
    i64 index = cdiv(num_tokens, m->block_size) - 1;
    if (index >= s->table.n) return 0;
    int32_t source = s->table.v[index];
    if (source == NULL_BLOCK || c->key_tokens[source] == num_tokens) return 0;
    int done = cache_partial_block(c, r, source, num_tokens, m->group, 0, E_PARTIAL, key);
    if (done < 0) return -1;
    *keyed = done;
    if (done && num_tokens % m->block_size) {
        s->has_partial = 1;
        s->partial_index = (int32_t)index;
        s->partial_source = source;
        s->has_num_cached = 1;
        s->num_cached = (int32_t)index;
        s->has_tail = 1;
        s->tail_block = source;
        s->tail_boundary = num_tokens;
    }
    return 0;
}

static int report_decision(Core *c, Manager *m, Request *r, i64 position, int32_t index,
                           int stripped) {
    int32_t slot = r->groups[m->group].table.v[index];
    if (slot == NULL_BLOCK || !c->has_key[slot]) {
        if (slot == NULL_BLOCK) return 0;
        return emit(c, T_CHECKPOINT_SUPPRESSED, "qdqdd", r->req, m->group, position, slot,
                    stripped);
    }
    Extra *extra = c->extra[slot];
    int total = 1 + (extra ? extra->n : 0), at_position = 0;
    for (int k = 0; k < total; k++) {
        i64 depth;
        if (map_get(&c->depth, k ? extra->hash[k - 1] : c->key_hash[slot], &depth)
            && depth == position)
            at_position = 1;
    }
    if (!at_position && emit(c, T_CHECKPOINT_SUPPRESSED, "qdqdd", r->req, m->group, position,
                             slot, stripped))
        return -1;
    for (int k = 0; k < total; k++) {
        i64 hash_id = k ? extra->hash[k - 1] : c->key_hash[slot];
        i64 depth = depth_get(c, hash_id, 0);
        if (depth != position && emit(c, T_STALE_KEY_LEFT, "qddqqq", r->req, m->group, slot,
                                      hash_id, depth, position))
            return -1;
    }
    return 0;
}

static int cache_group(Core *c, Manager *m, Request *r, i64 num_tokens) {
    GroupState *s = &r->groups[m->group];
    i64 limit = r->num_hashes * c->hash_block_size;
    i64 num_full = (num_tokens < limit ? num_tokens : limit) / m->block_size;
    i64 before = s->has_num_cached ? s->num_cached : 0;
    if (!m->is_mamba) {
        if (num_full > before && cache_full(c, m, r, before, num_full)) return -1;
        i64 unit = c->hash_block_size;
        if (m->block_size == unit) return 0;
        i64 units = (r->prompt_len - 1) / unit;
        i64 boundary = (units < r->num_hashes ? units : r->num_hashes) * unit;
        if (boundary == 0 || boundary > num_tokens || boundary % m->block_size == 0) return 0;
        i64 index = boundary / m->block_size;
        if (index >= s->table.n) return 0;
        i64 key;
        return cache_partial_block(c, r, s->table.v[index], boundary, m->group, 0, E_PARTIAL,
                                   &key) < 0 ? -1 : 0;
    }
    int has_checkpoint = s->has_checkpoint;
    i64 position = s->checkpoint_position;
    int32_t checkpoint_index = s->checkpoint_index;
    i64 after = before;
    if (num_full > before) {
        if (cache_full(c, m, r, before, num_full)) return -1;
        after = num_full;
    }
    i64 key = 0;
    int keyed = 0, stripped = 0;
    if (has_checkpoint) {
        if (decide_checkpoint(c, m, r, num_tokens, &keyed, &key, &stripped)) return -1;
    } else if (num_tokens > 0 && num_tokens % c->hash_block_size == 0) {
        if (cache_prompt_tail(c, m, r, num_tokens, &keyed, &key)) return -1;
    }
    if (keyed && lvec_push(&m->cached_this_step, key)) return -1;
    IVec *offloads = &c->scratch2;
    offloads->n = 0;
    for (i64 index = before; index < after; index++) {
        int32_t block = s->table.v[index];
        if (block == NULL_BLOCK || !c->has_key[block]) continue;
        if (lvec_push(&m->cached_this_step, c->key_hash[block])) return -1;
        if (ivec_push(offloads, block)) return -1;
    }
    if (has_checkpoint && report_decision(c, m, r, position, checkpoint_index, stripped))
        return -1;
    for (Py_ssize_t i = 0; i < offloads->n; i++) {
        int32_t block = offloads->v[i];
        if (emit(c, T_BOUNDARY_STATE_OFFLOADED, "qddq", r->req, m->group, block,
                 c->key_tokens[block]))
            return -1;
    }
    return 0;
}

static void release_group(Core *c, Manager *m, Request *r, int *error) {
    GroupState *s = &r->groups[m->group];
    IVec table = s->table;
    memset(s, 0, sizeof(*s));
    Py_ssize_t start = 0;
    while (start < table.n && table.v[start] == NULL_BLOCK) start++;
    IVec *reversed = &c->scratch;
    reversed->n = 0;
    if (!*error && ivec_reserve(reversed, table.n - start)) *error = 1;
    if (!*error) {
        for (Py_ssize_t i = table.n - 1; i >= start; i--) reversed->v[reversed->n++] = table.v[i];
        if (free_blocks(c, reversed->v, reversed->n, 0)) *error = 1;
    }
    ivec_free(&table);
}

/* --- requests --------------------------------------------------------------------------------- */

static Request *find_request(Core *c, i64 req) {
    i64 index;
    if (!map_get(&c->request_slots, req, &index)) {
        PyObject *key = PyLong_FromLongLong(req);
        if (key) { PyErr_SetObject(PyExc_KeyError, key); Py_DECREF(key); }
        return NULL;
    }
    return c->requests[index];
}

static void drop_request(Core *c, Request *r) {
    i64 index;
    if (map_get(&c->request_slots, r->req, &index)) {
        map_del(&c->request_slots, r->req);
        c->requests[index] = NULL;
        ivec_push(&c->free_requests, (int32_t)index);
    }
    for (int g = 0; g < c->num_groups; g++) {
        ivec_free(&r->groups[g].table);
        ivec_free(&r->pending[g]);
    }
    lvec_free(&r->hash_ids);
    PyMem_Free(r->groups);
    PyMem_Free(r->pending);
    PyMem_Free(r);
}

/* The prefix lengths the records report hash units ``start..stop`` of ``r`` at. */
static int set_depths(Core *c, Request *r, i64 start, i64 stop) {
    for (i64 i = start; i < stop; i++)
        if (map_set(&c->depth, r->hash_ids.v[i], (i + 1) * c->hash_block_size)) return -1;
    return 0;
}

static int report_request(Core *c, Request *r) {
    i64 unit = c->hash_block_size;
    if (r->num_reported < 0) {
        i64 units = r->prompt_len / unit;
        if (units > r->num_hashes) units = r->num_hashes;
        if (emit(c, T_REQUEST_ARRIVED, "qqLqddr", r->req, r->prompt_len, r->hash_ids.v,
                 (Py_ssize_t)units, r->max_tokens, 0, 0, r->req))
            return -1;
        if (set_depths(c, r, 0, units)) return -1;
        r->num_reported = units;
    }
    if (r->num_hashes > r->num_reported) {
        i64 start = r->num_reported, stop = r->num_hashes;
        if (emit(c, T_HASHES_EXTENDED, "qL", r->req, r->hash_ids.v + start,
                 (Py_ssize_t)(stop - start)))
            return -1;
        if (set_depths(c, r, start, stop)) return -1;
        r->num_reported = stop;
    }
    return 0;
}

static int append_tokens(Core *c, Request *r, i64 count) {
    r->num_tokens += count;
    i64 stop = r->num_tokens / c->hash_block_size;
    while (r->hash_ids.n < stop)
        if (lvec_push(&r->hash_ids, c->next_made_up++)) return -1;
    if (stop > r->num_hashes) r->num_hashes = stop;
    return 0;
}

/* --- the coordinator (backend.py) ------------------------------------------------------------- */

static int lookup(Core *c, const SpecGroup *spec, i64 hash_id, int32_t *found) {
    for (int k = 0; k < spec->num_groups; k++) {
        found[k] = cached_block(c, hash_id, spec->groups[k]);
        if (found[k] < 0) return 0;
    }
    return 1;
}

/* One spec group's hit into c->hits[its groups]; returns the hit length (-1 on error). */
static i64 group_hit(Core *c, const SpecGroup *spec, Request *r, i64 max_length, i64 alignment) {
    i64 block_size = spec->block_size, unit = c->hash_block_size;
    i64 scale = block_size / unit, num_hashes = r->num_hashes;
    const i64 *hashes = r->hash_ids.v;
    int fine = alignment < block_size && block_size % alignment == 0;
    int32_t found[64];
    for (int k = 0; k < spec->num_groups; k++) c->hits[spec->groups[k]].n = 0;
    if (spec->is_mamba) {
        i64 index = -1, length = 0;
        if (fine) {
            i64 per_block = block_size / alignment, stop = max_length / alignment;
            if (stop > num_hashes) stop = num_hashes;
            for (i64 i = stop - 1; i >= 0; i--)
                if (lookup(c, spec, hashes[i], found)) {
                    index = i / per_block;
                    length = (i + 1) * alignment;
                    break;
                }
        } else {
            for (i64 i = max_length / block_size - 1; i >= 0; i--) {
                if (!lookup(c, spec, hashes[(i + 1) * scale - 1], found)) continue;
                if (block_size != alignment && (i + 1) * block_size % alignment) continue;
                index = i;
                length = (i + 1) * block_size;
                break;
            }
        }
        if (index < 0) return 0;
        for (int k = 0; k < spec->num_groups; k++) {
            IVec *hit = &c->hits[spec->groups[k]];
            for (i64 i = 0; i < index; i++)
                if (ivec_push(hit, NULL_BLOCK)) return -1;
            if (ivec_push(hit, found[k])) return -1;
        }
        return length;
    }
    i64 stop = max_length / block_size, num_full = 0;
    if (stop > num_hashes / scale) stop = num_hashes / scale;
    for (i64 i = 0; i < stop; i++) {
        if (!lookup(c, spec, hashes[(i + 1) * scale - 1], found)) break;
        for (int k = 0; k < spec->num_groups; k++)
            if (ivec_push(&c->hits[spec->groups[k]], found[k])) return -1;
        num_full++;
    }
    i64 length = num_full * block_size;
    if (fine) {
        i64 per_block = block_size / alignment, first = num_full * per_block;
        i64 end = first + per_block - 1;
        if (end > max_length / alignment) end = max_length / alignment;
        if (end > num_hashes) end = num_hashes;
        for (i64 i = end - 1; i >= first; i--)
            if (lookup(c, spec, hashes[i], found)) {
                for (int k = 0; k < spec->num_groups; k++)
                    if (ivec_push(&c->hits[spec->groups[k]], found[k])) return -1;
                length = (i + 1) * alignment;
                break;
            }
    }
    length -= length % alignment;
    i64 num_blocks = cdiv(length, block_size);
    for (int k = 0; k < spec->num_groups; k++) {
        IVec *hit = &c->hits[spec->groups[k]];
        if (hit->n > num_blocks) hit->n = num_blocks;
    }
    return length;
}

static int find_longest_cache_hit(Core *c, Request *r, i64 max_length, i64 *hit_length,
                                  i64 *uncached) {
    if (!c->hybrid) {
        SpecGroup *spec = &c->specs[0];
        i64 length = group_hit(c, spec, r, max_length, spec->block_size);
        if (length < 0) return -1;
        *hit_length = length;
        *uncached = 0;
        return 0;
    }
    char looked_up[64] = {0};
    i64 lengths[64] = {0};
    i64 hit = max_length, longest = 0, current;
    for (int g = 0; g < c->num_groups; g++) c->hits[g].n = 0;
    for (;;) {
        current = hit;
        for (int s = 0; s < c->num_specs; s++) {
            SpecGroup *spec = &c->specs[s];
            int first = spec->groups[0];
            if (!spec->is_mamba && looked_up[first]) {
                if (lengths[first] < current) current = lengths[first];
                continue;
            }
            current = group_hit(c, spec, r, current, c->alignment);
            if (current < 0) return -1;
            for (int k = 0; k < spec->num_groups; k++) {
                looked_up[spec->groups[k]] = 1;
                lengths[spec->groups[k]] = current;
            }
            if (current > longest) longest = current;
        }
        if (current >= hit) break;
        hit = current;
        if (c->simple_hybrid) break;
    }
    for (int s = 0; s < c->num_specs; s++) {
        SpecGroup *spec = &c->specs[s];
        if (spec->is_mamba) continue;
        i64 num_blocks = cdiv(hit, spec->block_size);
        for (int k = 0; k < spec->num_groups; k++) {
            IVec *blocks = &c->hits[spec->groups[k]];
            if (looked_up[spec->groups[k]] && blocks->n > num_blocks) blocks->n = num_blocks;
        }
    }
    *hit_length = hit;
    *uncached = longest - hit;
    return 0;
}

/* KVCacheCoordinator.cache_blocks: without partial hits a hybrid engine caches only up to the
   scheduler block a later hit could match. */
static int cache_coordinator_blocks(Core *c, Request *r, i64 num_tokens) {
    if (!c->enable_caching) return 0;
    if (c->hybrid && !c->partial_hits) num_tokens -= num_tokens % c->scheduler_block_size;
    for (int g = 0; g < c->num_groups; g++)
        if (cache_group(c, &c->managers[g], r, num_tokens)) return -1;
    return 0;
}

/* KVCacheManager.allocate_slots: 1 allocated, 0 not, -1 error. */
static int allocate(Core *c, Request *r, i64 num_new, i64 num_new_computed, int has_hits,
                    i64 lookahead, int full_sequence_must_fit, i64 reserved) {
    static IVec no_hit = {0};
    i64 max_model_len = c->max_model_len;
    i64 num_local = r->num_computed + num_new_computed;
    i64 total = num_local < max_model_len ? num_local : max_model_len;
    i64 prefill_end = 0;
    if (c->retention == 0) {
        prefill_end = r->num_tokens - 1;
        if (prefill_end < r->prompt_len) prefill_end = r->prompt_len;
    }
    i64 need, part;
    if (full_sequence_must_fit) {
        i64 full = r->num_tokens < max_model_len ? r->num_tokens : max_model_len;
        need = 0;
        for (int g = 0; g < c->num_groups; g++) {
            if (blocks_to_allocate(c, &c->managers[g], r, full,
                                   has_hits ? &r->pending[g] : &no_hit, total, num_local, full,
                                   1, prefill_end, &part))
                return -1;
            need += part;
        }
        if (need > c->num_free) return 0;
    }
    i64 num_main = total + num_new;
    i64 num_tokens = num_main + lookahead;
    if (num_tokens > max_model_len) num_tokens = max_model_len;
    /* Full attention keeps every block; a step in flight has not processed its tokens. */
    i64 num_processed = total - r->num_in_flight;
    if (num_processed < 0) num_processed = 0;
    for (int g = 0; g < c->num_groups; g++)
        if (c->managers[g].is_mamba && retire(c, &c->managers[g], r, num_processed)) return -1;
    need = 0;
    for (int g = 0; g < c->num_groups; g++) {
        if (blocks_to_allocate(c, &c->managers[g], r, num_tokens,
                               has_hits ? &r->pending[g] : &no_hit, total, num_local, num_main,
                               0, prefill_end, &part))
            return -1;
        need += part;
    }
    if (need > c->num_free - reserved) return 0;
    if (has_hits) {
        int running = 0, any_hit = 0;
        for (int g = 0; g < c->num_groups; g++) {
            running |= r->groups[g].has_num_cached;
            any_hit |= r->pending[g].n > 0;
        }
        if (running) {
            if (any_hit) {
                PyErr_Format(PyExc_AssertionError, "running request %lld got prefix hits",
                             r->req);
                return -1;
            }
        } else {
            for (int g = 0; g < c->num_groups; g++)
                if (add_hit(c, &c->managers[g], r, &r->pending[g], num_local, total))
                    return -1;
        }
    }
    for (int g = 0; g < c->num_groups; g++)
        if (allocate_blocks(c, &c->managers[g], r, num_tokens, num_main)) return -1;
    i64 cacheable = total + num_new;
    if (cacheable > r->num_tokens) cacheable = r->num_tokens;
    return cache_coordinator_blocks(c, r, cacheable) ? -1 : 1;
}

/* --- the Python type -------------------------------------------------------------------------- */

/* Raise the configured KvtraceError class ``type`` (T_KVTRACE_ERROR, T_SNAPSHOT_ERROR) with
   a message and a hint (NULL: the class's own). Returns -1. */
static int set_error_v(int type, const char *hint, const char *format, va_list ap) {
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

static int set_kvtrace_error(const char *hint, const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    set_error_v(T_KVTRACE_ERROR, hint, format, ap);
    va_end(ap);
    return -1;
}

static int as_i64(PyObject *value, i64 *out) {
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Fast-call arguments into ``values`` by ``names`` (positional first, then keywords); the
   first ``num_required`` must be given. */
static int parse_args(const char *function, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames, const char *const *names, int num_names,
                      int num_required, PyObject **values) {
    for (int i = 0; i < num_names; i++) values[i] = NULL;
    if (nargs > num_names) {
        PyErr_Format(PyExc_TypeError, "%s: too many arguments", function);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) values[i] = args[i];
    Py_ssize_t num_keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < num_keywords; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int slot = -1;
        for (int j = 0; j < num_names; j++)
            if (PyUnicode_CompareWithASCIIString(name, names[j]) == 0) slot = j;
        if (slot < 0 || values[slot]) {
            PyErr_Format(PyExc_TypeError, "%s: unexpected argument %R", function, name);
            return -1;
        }
        values[slot] = args[nargs + k];
    }
    for (int i = 0; i < num_required; i++)
        if (!values[i]) {
            PyErr_Format(PyExc_TypeError, "%s: missing argument %s", function, names[i]);
            return -1;
        }
    return 0;
}

static int Core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->sink);
    Py_VISIT(c->records);
    if (c->columns) Py_VISIT(c->columns->sink);
    Py_VISIT(c->variant);
    Py_VISIT(c->checkpoint_action);
    return 0;
}

static int Core_clear(Core *c) {
    if (c->columns) Py_CLEAR(c->columns->sink);
    Py_CLEAR(c->sink);
    Py_CLEAR(c->records);
    Py_CLEAR(c->variant);
    Py_CLEAR(c->checkpoint_action);
    return 0;
}

static void Core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    for (Py_ssize_t i = 0; i < c->num_requests; i++)
        if (c->requests[i]) drop_request(c, c->requests[i]);
    PyMem_Free(c->requests);
    ivec_free(&c->free_requests);
    map_clear(&c->request_slots);
    map_clear(&c->depth);
    for (int g = 0; g < c->num_groups; g++) {
        if (c->cached) map_clear(&c->cached[g]);
        if (c->managers) {
            ivec_free(&c->managers[g].cow);
            lvec_free(&c->managers[g].cached_this_step);
        }
        if (c->hits) ivec_free(&c->hits[g]);
    }
    PyMem_Free(c->cached); PyMem_Free(c->managers); PyMem_Free(c->hits); PyMem_Free(c->specs);
    for (Py_ssize_t i = 0; i < c->num_multi; i++) ivec_free(&c->multi[i]);
    PyMem_Free(c->multi);
    ivec_free(&c->free_multi);
    if (c->extra)
        for (int b = 0; b < c->num_blocks; b++)
            if (c->extra[b]) {
                PyMem_Free(c->extra[b]->hash);
                PyMem_Free(c->extra[b]->group);
                PyMem_Free(c->extra[b]);
            }
    PyMem_Free(c->extra);
    PyMem_Free(c->ref); PyMem_Free(c->next_free); PyMem_Free(c->prev_free);
    PyMem_Free(c->key_group); PyMem_Free(c->key_hash); PyMem_Free(c->key_tokens);
    PyMem_Free(c->has_key);
    ivec_free(&c->scratch); ivec_free(&c->scratch2);
    Tally *t = &c->tally;
    PyMem_Free(t->block_group); PyMem_Free(t->hit_blocks); PyMem_Free(t->evicted);
    PyMem_Free(t->stored);
    map_clear(&t->arrived); map_clear(&t->lookups); map_clear(&t->admitted);
    if (c->columns) {
        Columns *w = c->columns;
        for (int type = 0; type < NUM_RECORD_TYPES; type++) {
            for (int f = 0; f < w->types[type].num_fields; f++) {
                lvec_free(&w->types[type].values[f]);
                lvec_free(&w->types[type].elements[f]);
            }
            PyMem_Free(w->types[type].values);
            PyMem_Free(w->types[type].elements);
            Py_XDECREF(w->tags[type]);
        }
        PyMem_Free(w->kinds);
        PyMem_Free(w->out);
    }
    Core_clear(c);
    PyMem_Free(c->columns);
    Py_TYPE(c)->tp_free((PyObject *)c);  /* a subclass's type is released by subtype_dealloc */
}

/* Core(sink, variant, num_blocks, hash_block_size, scheduler_block_size, max_model_len,
        retention_interval, enable_caching, hybrid, partial_hits, alignment, simple_hybrid,
        groups, specs): groups = [(is_mamba, block_size, num_checkpoint_blocks,
        checkpoint_alignment or None)], specs = [(is_mamba, block_size, (group ids...))].
   A sink of None: count (_counts()), make no record. */
static int Core_init(Core *c, PyObject *args, PyObject *kwargs) {
    PyObject *sink, *variant, *retention, *groups, *specs, *batch_sink = Py_None;
    int num_blocks, hash_block_size, enable_caching, hybrid, partial_hits, alignment, simple;
    long long scheduler_block_size, max_model_len;
    Py_ssize_t batch_size = 0;
    if (!PyArg_ParseTuple(args, "OOiiLLOpppipOO|On", &sink, &variant, &num_blocks,
                          &hash_block_size, &scheduler_block_size, &max_model_len, &retention,
                          &enable_caching, &hybrid, &partial_hits, &alignment, &simple, &groups,
                          &specs, &batch_sink, &batch_size))
        return -1;
    if (c->ref) {
        PyErr_SetString(PyExc_RuntimeError, "a model core is initialised once");
        return -1;
    }
    if (!configured[T_BLOCK_STORED]) {
        PyErr_SetString(PyExc_RuntimeError, "kvtrace._model_core.configure() was not called");
        return -1;
    }
    c->checkpoint_action = PyObject_GetAttrString(variant, "checkpoint_action");
    PyObject *reserve = PyObject_GetAttrString(variant, "reserve_every_chunk");
    if (!c->checkpoint_action || !reserve) { Py_XDECREF(reserve); return -1; }
    c->reserve_every_chunk = PyObject_IsTrue(reserve);
    Py_DECREF(reserve);
    Py_INCREF(sink); c->sink = sink;
    Py_INCREF(variant); c->variant = variant;
    c->records = PyList_New(0);
    if (!c->records) return -1;
    c->num_blocks = num_blocks;
    c->hash_block_size = hash_block_size;
    c->scheduler_block_size = scheduler_block_size;
    c->max_model_len = max_model_len;
    if (retention == Py_None) c->retention = -1;
    else if (as_i64(retention, &c->retention)) return -1;
    c->enable_caching = enable_caching;
    c->hybrid = hybrid;
    c->partial_hits = partial_hits;
    c->alignment = alignment;
    c->simple_hybrid = simple;
    c->next_made_up = (i64)1 << 62;
    /* groups */
    Py_ssize_t num_groups = PySequence_Length(groups), num_specs = PySequence_Length(specs);
    if (num_groups < 1 || num_groups > 64 || num_specs < 1 || num_specs > 64) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "1 to 64 groups");
        return -1;
    }
    c->num_groups = (int)num_groups;
    c->num_specs = (int)num_specs;
    c->managers = PyMem_Calloc((size_t)num_groups, sizeof(Manager));
    c->cached = PyMem_Calloc((size_t)num_groups, sizeof(Map));
    c->hits = PyMem_Calloc((size_t)num_groups, sizeof(IVec));
    c->specs = PyMem_Calloc((size_t)num_specs, sizeof(SpecGroup));
    if (!c->managers || !c->cached || !c->hits || !c->specs) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        PyObject *item = PySequence_GetItem(groups, g), *checkpoint_alignment;
        Manager *m = &c->managers[g];
        int num_checkpoint_blocks;
        if (!item || !PyArg_ParseTuple(item, "iiiO", &m->is_mamba, &m->block_size,
                                       &num_checkpoint_blocks, &checkpoint_alignment)) {
            Py_XDECREF(item);
            return -1;
        }
        m->group = (int)g;
        m->has_checkpoint_blocks = num_checkpoint_blocks > 0;
        m->checkpoint_alignment = -1;
        int rc = checkpoint_alignment == Py_None ? 0
            : as_i64(checkpoint_alignment, &m->checkpoint_alignment);
        Py_DECREF(item);
        if (rc) return -1;
    }
    for (Py_ssize_t s = 0; s < num_specs; s++) {
        PyObject *item = PySequence_GetItem(specs, s), *ids;
        SpecGroup *spec = &c->specs[s];
        if (!item || !PyArg_ParseTuple(item, "iiO", &spec->is_mamba, &spec->block_size, &ids)) {
            Py_XDECREF(item);
            return -1;
        }
        Py_ssize_t n = PySequence_Length(ids);
        for (Py_ssize_t k = 0; k < n && k < 64; k++) {
            PyObject *id = PySequence_GetItem(ids, k);
            spec->groups[k] = id ? (int)PyLong_AsLong(id) : -1;
            Py_XDECREF(id);
        }
        spec->num_groups = (int)n;
        Py_DECREF(item);
        if (PyErr_Occurred()) return -1;
    }
    /* the pool: queue ids 1..N-1 (block 0 is the null block) */
    size_t n = (size_t)num_blocks;
    c->ref = PyMem_Calloc(n, sizeof(int32_t));
    c->key_group = PyMem_Calloc(n, sizeof(int32_t));
    c->key_hash = PyMem_Calloc(n, sizeof(i64));
    c->key_tokens = PyMem_Malloc(n * sizeof(i64));
    c->has_key = PyMem_Calloc(n, 1);
    c->extra = PyMem_Calloc(n, sizeof(Extra *));
    c->next_free = PyMem_Malloc((n + 2) * sizeof(int32_t));
    c->prev_free = PyMem_Malloc((n + 2) * sizeof(int32_t));
    if (!c->ref || !c->key_group || !c->key_hash || !c->key_tokens || !c->has_key || !c->extra
        || !c->next_free || !c->prev_free) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t b = 0; b < n; b++) c->key_tokens[b] = -1;
    c->counting = sink == Py_None;
    if (batch_sink != Py_None) {  /* counting, and writing the records as column batches */
        if (!c->counting || batch_size < 1) {
            PyErr_SetString(PyExc_ValueError, "column batches need no sink and a batch size");
            return -1;
        }
        c->columns = PyMem_Calloc(1, sizeof(Columns));
        if (!c->columns) { PyErr_NoMemory(); return -1; }
        c->columns->sink = Py_NewRef(batch_sink);
        c->columns->batch_size = batch_size;
        for (int t = 0; t < NUM_RECORD_TYPES; t++) {
            PyObject *config = PyObject_GetAttrString(configured[t], "__struct_config__");
            c->columns->tags[t] = config ? PyObject_GetAttrString(config, "tag") : NULL;
            Py_XDECREF(config);
            if (!c->columns->tags[t]) return -1;
        }
    }
    if (c->counting) {
        Tally *t = &c->tally;
        t->block_group = PyMem_Malloc(n * sizeof(int32_t));
        t->hit_blocks = PyMem_Calloc((size_t)num_groups, sizeof(i64));
        t->evicted = PyMem_Calloc((size_t)num_groups, sizeof(i64));
        t->stored = PyMem_Calloc((size_t)num_groups * NUM_STORE_KINDS, sizeof(i64));
        if (!t->block_group || !t->hit_blocks || !t->evicted || !t->stored) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t b = 0; b < n; b++) t->block_group[b] = -1;
    }
    c->head = num_blocks;
    c->tail = num_blocks + 1;
    for (size_t b = 0; b < n + 2; b++) c->next_free[b] = c->prev_free[b] = -1;
    int32_t previous = c->head;
    for (int32_t b = 1; b < num_blocks; b++) {
        c->next_free[previous] = b;
        c->prev_free[b] = previous;
        previous = b;
    }
    c->next_free[previous] = c->tail;
    c->prev_free[c->tail] = previous;
    c->num_free = num_blocks - 1;
    return 0;
}

static PyObject *Core_flushed(Core *c, PyObject *result) {
    if (flush(c)) { Py_XDECREF(result); return NULL; }
    return result;
}

static PyObject *Core_new_step(Core *c, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"step", "ts_ns"};
    PyObject *values[2];
    if (parse_args("new_step", args, nargs, kwnames, names, 2, 2, values)
        || emit(c, T_STEP_STARTED, "oo", values[0], values[1]))
        return NULL;
    for (int g = 0; g < c->num_groups; g++) c->managers[g].cached_this_step.n = 0;
    Py_INCREF(Py_None);
    return Core_flushed(c, Py_None);
}

/* A new request, known from now on, its hash ids (known ones) taken from a sequence; NULL on
   error. Made-up ids continue past them. */
static Request *new_request(Core *c, i64 req, i64 prompt_len, i64 max_tokens,
                            PyObject *hash_ids) {
    Request *r = PyMem_Calloc(1, sizeof(Request));
    if (!r) return (Request *)PyErr_NoMemory();
    r->groups = PyMem_Calloc((size_t)c->num_groups, sizeof(GroupState));
    r->pending = PyMem_Calloc((size_t)c->num_groups, sizeof(IVec));
    if (!r->groups || !r->pending) {
        PyMem_Free(r->groups);
        PyMem_Free(r->pending);
        PyMem_Free(r);
        return (Request *)PyErr_NoMemory();
    }
    r->req = req;
    r->prompt_len = prompt_len;
    r->max_tokens = max_tokens;
    r->num_tokens = prompt_len;
    r->num_hashes = prompt_len / c->hash_block_size;
    r->num_reported = -1;
    Py_ssize_t n = PySequence_Length(hash_ids);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(hash_ids, i);
        i64 value = 0;
        if (!item || as_i64(item, &value) || lvec_push(&r->hash_ids, value)) {
            Py_XDECREF(item);
            drop_request(c, r);
            return NULL;
        }
        Py_DECREF(item);
        if (value + 1 > c->next_made_up) c->next_made_up = value + 1;
    }
    Py_ssize_t index;
    if (c->free_requests.n) {
        index = c->free_requests.v[--c->free_requests.n];
    } else {
        if (c->num_requests == c->cap_requests) {
            Py_ssize_t size = c->cap_requests ? c->cap_requests * 2 : 64;
            Request **requests = PyMem_Realloc(c->requests, (size_t)size * sizeof(Request *));
            if (!requests) { drop_request(c, r); return (Request *)PyErr_NoMemory(); }
            c->requests = requests;
            c->cap_requests = size;
        }
        index = c->num_requests++;
    }
    c->requests[index] = r;
    if (map_set(&c->request_slots, req, index)) return NULL;
    return r;
}

/* _add(req, prompt_len, max_tokens, hash_ids): the request, validated by the Python side. */
static PyObject *Core_add(Core *c, PyObject *args) {
    long long req, prompt_len, max_tokens;
    PyObject *hash_ids;
    if (!PyArg_ParseTuple(args, "LLLO", &req, &prompt_len, &max_tokens, &hash_ids)
        || !new_request(c, req, prompt_len, max_tokens, hash_ids))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_get_computed_blocks(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames) {
    static const char *const names[] = {"req"};
    PyObject *value;
    i64 req, hit = 0, uncached = 0, junction = 0;
    if (parse_args("get_computed_blocks", args, nargs, kwnames, names, 1, 1, &value)
        || as_i64(value, &req))
        return NULL;
    Request *r = find_request(c, req);
    if (!r || report_request(c, r)) return NULL;
    if (c->enable_caching) {
        if (find_longest_cache_hit(c, r, r->num_tokens - 1, &hit, &uncached)) return NULL;
        junction = uncached ? hit + uncached : 0;
    }
    r->junction = junction;
    r->has_pending = 1;
    r->pending_none = !c->enable_caching;
    r->pending_num_hit = hit;
    for (int g = 0; g < c->num_groups; g++) {
        IVec *pending = &r->pending[g], *found = &c->hits[g];
        pending->n = 0;
        if (!c->enable_caching) continue;
        if (ivec_reserve(pending, found->n)) return NULL;
        memcpy(pending->v, found->v, (size_t)found->n * sizeof(int32_t));
        pending->n = found->n;
    }
    if (emit(c, T_COMPUTED_BLOCKS_FOUND, "qqq", req, hit, junction)) return NULL;
    return Core_flushed(c, Py_BuildValue("LL", hit, junction));
}

static PyObject *Core_allocate_slots(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    static const char *const names[] = {
        "req", "num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
        "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs"};
    PyObject *values[7];
    if (nargs > 4) {  /* the last three are keyword-only */
        PyErr_SetString(PyExc_TypeError, "allocate_slots: too many positional arguments");
        return NULL;
    }
    if (parse_args("allocate_slots", args, nargs, kwnames, names, 7, 2, values)) return NULL;
    i64 req, num_new, num_new_computed = 0, lookahead = 0, reserved = 0;
    int must_fit = 0, has_scheduled = 0;
    if (as_i64(values[0], &req) || as_i64(values[1], &num_new)
        || (values[2] && as_i64(values[2], &num_new_computed))
        || (values[3] && as_i64(values[3], &lookahead))
        || (values[5] && as_i64(values[5], &reserved))
        || (values[4] && (must_fit = PyObject_IsTrue(values[4])) < 0)
        || (values[6] && (has_scheduled = PyObject_IsTrue(values[6])) < 0))
        return NULL;
    Request *r = find_request(c, req);
    if (!r) return NULL;
    int has_hits = 0;
    if (num_new_computed > 0) {
        i64 num_hit = r->has_pending ? r->pending_num_hit : 0;
        has_hits = r->has_pending && !r->pending_none;
        r->has_pending = 0;
        if (num_hit != num_new_computed) {
            set_kvtrace_error("Call get_computed_blocks first and pass its hit (or 0).",
                              "request %lld: allocate_slots with %lld computed tokens, but its "
                              "last lookup found %lld", req, num_new_computed, num_hit);
            return NULL;
        }
    }
    if ((r->num_reported < 0 || r->num_hashes != r->num_reported) && report_request(c, r))
        return NULL;
    Py_ssize_t first_effect = c->columns ? c->columns->num_kinds : PyList_GET_SIZE(c->records);
    i64 num_computed = r->num_computed, num_tokens = r->num_tokens;
    int success = 0;
    if (num_new == 0 && num_new_computed == 0) {
        PyErr_SetString(PyExc_ValueError, "num_new_tokens must be greater than 0 when there are "
                        "no computed tokens to adopt");
        success = -1;
    } else {
        success = allocate(c, r, num_new, num_new_computed, has_hits, lookahead, must_fit,
                           reserved);
    }
    PyObject *error_type, *error_value, *error_traceback;
    PyErr_Fetch(&error_type, &error_value, &error_traceback);
    if (emit(c, T_SLOTS_ALLOCATED, "qqqqqdqbbqbq", req, num_new, num_computed,
             num_new_computed, lookahead, 0, num_tokens, success == 1, must_fit, reserved,
             has_scheduled, r->num_in_flight)) {
        Py_XDECREF(error_type); Py_XDECREF(error_value); Py_XDECREF(error_traceback);
        return NULL;
    }
    /* the input record goes in front of the call's effects */
    if (c->columns && c->columns->num_kinds - 1 > first_effect) {
        uint8_t *kinds = c->columns->kinds;
        Py_ssize_t last = c->columns->num_kinds - 1;
        uint8_t kind = kinds[last];
        memmove(kinds + first_effect + 1, kinds + first_effect, (size_t)(last - first_effect));
        kinds[first_effect] = kind;
    }
    Py_ssize_t last = PyList_GET_SIZE(c->records) - 1;
    if (!c->columns && last > first_effect) {
        PyObject *record = PyList_GET_ITEM(c->records, last);
        Py_INCREF(record);
        if (PyList_SetSlice(c->records, last, last + 1, NULL)
            || PyList_Insert(c->records, first_effect, record)) {
            Py_DECREF(record);
            return NULL;
        }
        Py_DECREF(record);
    }
    int flushed = flush(c);
    if (error_type) {
        PyErr_Restore(error_type, error_value, error_traceback);
        return NULL;
    }
    if (flushed) return NULL;
    if (success == 1) {
        r->has_pending = 0;
        r->num_computed += num_new_computed;
    }
    return PyBool_FromLong(success == 1);
}

static PyObject *Core_end_schedule(Core *c, PyObject *unused) {
    IVec retained = {0};
    for (int g = 0; g < c->num_groups; g++) {
        IVec *cow = &c->managers[g].cow;
        for (Py_ssize_t i = 0; i < cow->n; i++)
            if (ivec_push(&retained, cow->v[i])) { ivec_free(&retained); return NULL; }
        cow->n = 0;
    }
    int rc = retained.n ? free_blocks(c, retained.v, retained.n, 1) : 0;
    ivec_free(&retained);
    if (rc) return NULL;
    Py_INCREF(Py_None);
    return Core_flushed(c, Py_None);
}

/* The request and the count a method's two arguments ``names`` give (both required); NULL on
   error. */
static Request *request_and_count(Core *c, const char *function, const char *const *names,
                                  PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                                  i64 *count) {
    PyObject *values[2];
    i64 req;
    if (parse_args(function, args, nargs, kwnames, names, 2, 2, values)
        || as_i64(values[0], &req) || as_i64(values[1], count))
        return NULL;
    return find_request(c, req);
}

static PyObject *Core_advance(Core *c, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"req", "num_tokens"};
    i64 count;
    Request *r = request_and_count(c, "advance", names, args, nargs, kwnames, &count);
    if (!r) return NULL;
    r->num_computed += count;
    if (r->num_computed >= r->num_tokens && append_tokens(c, r, 1)) return NULL;
    Py_RETURN_NONE;
}

/* KVCacheManager.cache_blocks called by the scheduler itself (async scheduling): the input
   record, after the hash units the request completed, then the coordinator's caching. */
static PyObject *Core_cache_blocks(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    static const char *const names[] = {"req", "num_tokens_to_cache"};
    i64 num_tokens;
    Request *r = request_and_count(c, "cache_blocks", names, args, nargs, kwnames, &num_tokens);
    if (!r || report_request(c, r)
        || emit(c, T_BLOCKS_CACHED, "qqqq", r->req, num_tokens, r->num_computed, r->num_tokens)
        || cache_coordinator_blocks(c, r, num_tokens))
        return NULL;
    Py_INCREF(Py_None);
    return Core_flushed(c, Py_None);
}

/* status: the FinishStatus member's configured index, for RequestFinished. */
static PyObject *release(Core *c, i64 req, int record_type, int status) {
    Request *r = find_request(c, req);
    if (!r) return NULL;
    r->has_pending = 0;
    if (r->num_reported >= 0
        && emit(c, record_type, record_type == T_REQUEST_FINISHED ? "qe" : "q", req, status))
        return NULL;
    int error = 0;
    for (int g = 0; g < c->num_groups && !error; g++)
        release_group(c, &c->managers[g], r, &error);
    if (error) return NULL;
    if (record_type == T_REQUEST_FINISHED) drop_request(c, r);
    else r->num_computed = 0;
    Py_INCREF(Py_None);
    return Core_flushed(c, Py_None);
}

static PyObject *Core_free(Core *c, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    static const char *const names[] = {"req", "status"};
    PyObject *values[2];
    i64 req;
    if (parse_args("free", args, nargs, kwnames, names, 2, 1, values)
        || as_i64(values[0], &req))
        return NULL;
    int aborted = values[1]
        ? PyObject_RichCompareBool(values[1], configured[E_ABORTED], Py_EQ) : 0;
    if (aborted < 0) return NULL;
    return release(c, req, T_REQUEST_FINISHED, aborted ? E_ABORTED : E_FINISHED);
}

static PyObject *Core_preempt(Core *c, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"req"};
    PyObject *value;
    i64 req;
    if (parse_args("preempt", args, nargs, kwnames, names, 1, 1, &value)
        || as_i64(value, &req))
        return NULL;
    return release(c, req, T_REQUEST_PREEMPTED, 0);
}

static PyObject *Core_num_free_blocks(Core *c, PyObject *unused) {
    return PyLong_FromLongLong(c->num_free);
}

static PyObject *Core_sync_request(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames) {
    static const char *const names[] = {"req", "num_computed_tokens", "num_tokens",
                                        "num_in_flight_tokens"};
    PyObject *values[4];
    i64 req, num_computed, num_tokens, num_in_flight = 0;
    if (parse_args("sync_request", args, nargs, kwnames, names, 4, 3, values)
        || as_i64(values[0], &req) || as_i64(values[1], &num_computed)
        || as_i64(values[2], &num_tokens) || (values[3] && as_i64(values[3], &num_in_flight)))
        return NULL;
    Request *r = find_request(c, req);
    if (!r) return NULL;
    r->num_computed = num_computed;
    r->num_in_flight = num_in_flight;
    i64 missing = num_tokens - r->num_tokens;
    if (missing < 0) {
        set_kvtrace_error("The trace's inputs are inconsistent; was it edited?",
                          "request %lld holds %lld tokens, the trace says %lld", req,
                          r->num_tokens, num_tokens);
        return NULL;
    }
    if (missing && append_tokens(c, r, missing)) return NULL;
    Py_RETURN_NONE;
}

/* A sequence of block ids appended to ``out``. */
static int block_ids_of(PyObject *ids, IVec *out) {
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

/* _release(block_ids): the engine frees blocks itself (checked by the Python side). */
static PyObject *Core_release(Core *c, PyObject *ids) {
    IVec blocks = {0};
    if (block_ids_of(ids, &blocks)) {
        ivec_free(&blocks);
        return NULL;
    }
    int rc = free_blocks(c, blocks.v, blocks.n, 1);
    ivec_free(&blocks);
    if (rc) return NULL;
    Py_INCREF(Py_None);
    return Core_flushed(c, Py_None);
}

static PyObject *Core_ref_count(Core *c, PyObject *arg) {
    long block = PyLong_AsLong(arg);
    if (block == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(block >= 0 && block < c->num_blocks ? c->ref[block] : 0);
}

static PyObject *Core_cached_block_id(Core *c, PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames) {
    static const char *const names[] = {"hash_id", "group"};
    PyObject *values[2];
    i64 hash_id, group;
    if (parse_args("cached_block_id", args, nargs, kwnames, names, 2, 2, values)
        || as_i64(values[0], &hash_id) || as_i64(values[1], &group))
        return NULL;
    int32_t block = group >= 0 && group < c->num_groups ? cached_block(c, hash_id, (int)group) : -1;
    if (block < 0) Py_RETURN_NONE;
    return PyLong_FromLong(block);
}

static PyObject *Core_request_counters(Core *c, PyObject *arg) {
    i64 req;
    if (as_i64(arg, &req)) return NULL;
    Request *r = find_request(c, req);
    if (!r) return NULL;
    return Py_BuildValue("LLL", r->num_tokens, r->num_computed, r->prompt_len);
}

/* _counts(): the Tally as reports.Counts' fields (prompt_tokens, hit_tokens,
   resumed_hit_tokens, removed, checkpoints_suppressed, stale_key_hazards, preemptions,
   hit_blocks, stored, evicted). */
static PyObject *Core_counts(Core *c, PyObject *unused) {
    if (!c->counting) {
        PyErr_SetString(PyExc_RuntimeError, "a model core with a sink counts nothing");
        return NULL;
    }
    Tally *t = &c->tally;
    PyObject *arrived = PyDict_New(), *stored = PyList_New(c->num_groups);
    if (!arrived || !stored) { Py_XDECREF(arrived); Py_XDECREF(stored); return NULL; }
    for (size_t i = 0; i < t->arrived.cap; i++) {
        if (!map_used(&t->arrived, i)) continue;
        PyObject *req = PyLong_FromLongLong(t->arrived.slots[i].key);
        PyObject *prompt_len = PyLong_FromLongLong(t->arrived.slots[i].val);
        int rc = req && prompt_len ? PyDict_SetItem(arrived, req, prompt_len) : -1;
        Py_XDECREF(req);
        Py_XDECREF(prompt_len);
        if (rc) { Py_DECREF(arrived); Py_DECREF(stored); return NULL; }
    }
    for (int g = 0; g < c->num_groups; g++) {
        PyObject *kinds = i64_list(t->stored + g * NUM_STORE_KINDS, NUM_STORE_KINDS);
        if (!kinds) { Py_DECREF(arrived); Py_DECREF(stored); return NULL; }
        PyList_SET_ITEM(stored, g, kinds);
    }
    return Py_BuildValue("NLLNLLLNNN", arrived, t->hit_tokens, t->resumed_hit_tokens,
                         i64_list(t->removed, NUM_REMOVE_REASONS), t->suppressed, t->stale,
                         t->preemptions, i64_list(t->hit_blocks, c->num_groups), stored,
                         i64_list(t->evicted, c->num_groups));
}

static PyObject *Core_close(Core *c, PyObject *unused) {
    if (flush(c) || (c->columns && c->columns->num_kinds
                     && write_batch(c, c->columns->num_kinds)))
        return NULL;
    Py_RETURN_NONE;
}

/* --- a start snapshot (Core_restore) --------------------------------------------------------- */

#include "model_restore.c"

#define FAST(function) (PyCFunction)(void (*)(void))function, METH_FASTCALL | METH_KEYWORDS

static PyMethodDef Core_methods[] = {
    {"new_step", FAST(Core_new_step), NULL},
    {"_add", (PyCFunction)Core_add, METH_VARARGS, NULL},
    {"get_computed_blocks", FAST(Core_get_computed_blocks), NULL},
    {"allocate_slots", FAST(Core_allocate_slots), NULL},
    {"end_schedule", (PyCFunction)Core_end_schedule, METH_NOARGS, NULL},
    {"advance", FAST(Core_advance), NULL},
    {"cache_blocks", FAST(Core_cache_blocks), NULL},
    {"free", FAST(Core_free), NULL},
    {"preempt", FAST(Core_preempt), NULL},
    {"num_free_blocks", (PyCFunction)Core_num_free_blocks, METH_NOARGS, NULL},
    {"sync_request", FAST(Core_sync_request), NULL},
    {"_release", (PyCFunction)Core_release, METH_O, NULL},
    {"_ref_count", (PyCFunction)Core_ref_count, METH_O, NULL},
    {"cached_block_id", FAST(Core_cached_block_id), NULL},
    {"_request_counters", (PyCFunction)Core_request_counters, METH_O, NULL},
    {"_counts", (PyCFunction)Core_counts, METH_NOARGS, NULL},
    {"_restore", (PyCFunction)Core_restore, METH_VARARGS, NULL},
    {"close", (PyCFunction)Core_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtrace._model_core.ModelCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The model backend's cache, in C (the twin of kvtrace.replay.model).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_traverse = (traverseproc)Core_traverse,
    .tp_clear = (inquiry)Core_clear,
    .tp_methods = Core_methods,
};

/* configure(objects): the record types, enum members, CheckpointFacts and KvtraceError, by
   the names in configured_names. */
static PyObject *configure(PyObject *module, PyObject *objects) {
    for (int i = 0; i < NUM_CONFIGURED; i++) {
        PyObject *value = PyMapping_GetItemString(objects, configured_names[i]);
        if (!value) return NULL;
        Py_XSETREF(configured[i], value);
        if (PyLong_Check(value)) {  /* the IntEnum members of kvtrace.events */
            configured_value[i] = PyLong_AsLong(value);
            if (configured_value[i] == -1 && PyErr_Occurred()) return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtrace._model_core",
    "The model replay backend's cache in C (see kvtrace/replay/model/).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__model_core(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "ModelCore", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
