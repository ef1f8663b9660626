/* kvtrace._forensics_core: the streaming pass of `kvtrace load` and `kvtrace why` over a trace's
 * record batches, in C (kvtrace/analysis/stream.py drives it).
 *
 * One pass follows the cache record by record and makes three things:
 *
 * - the miss attribution: for every admitted lookup, where its query tokens went. This is the C
 *   twin of kvtrace/analysis/attribution.py's MissAttributor (the reference: same names, same
 *   steps, function for function); tests/test_attribution.py holds the two row for row.
 * - the cache entries (a key stored on a block, until removed) with the hits each took and, for
 *   a removal, how many transient checkpoint entries sat cached in the free queue just before
 *   it, as the SQL twin in kvtrace/analysis/database.py (CACHE_ENTRIES_SQL) defines them;
 * - the rows of the record tables themselves (kinds whose fields are ints, int lists, strings or
 *   bytes: all but the snapshot's maps), as the loader's Python twin (kvtrace/analysis/load.py,
 *   _RunSink) makes them.
 *
 * All come out as int64 columns (int32 where the database stores 32 bits, a list for strings)
 * (take_tables); `why` takes whole lookups
 * instead (take_lookups). Batches come in as kinds (one byte per record, an index into the
 * batch's kinds), per batch kind its index in kvtrace.events.RECORD_TYPES (the records spec
 * given at construction says how each is read) and its columns as the reader decoded them:
 * ints as any buffer of 1, 2, 4 or 8-byte ints (or a list of ints), a list field as a
 * traceio.ListColumn (lengths, values), strings as a list. Python's floor division and modulo
 * are spelled out (floordiv) where an operand can be negative.
 *
 * The state that grows with the trace (a key per hash id and group ever stored, the removal that
 * took each one's last copy, the sets of hash ids, each request's admissions) lives in
 * containers.h's chunked arrays, which spill to the file the caller gives (stream.new_pass's
 * spill_dir): the pass holds a bounded share of it in memory whatever the trace's length.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "containers.h"

/* --- the record kinds the attribution reads (stream.FIELDS, in this order) --------------------- */

enum {
    K_STEP, K_ARRIVED, K_EXTENDED, K_LOOKUP, K_ALLOCATED, K_FINISHED, K_PREEMPTED,
    K_BLOCK_ALLOCATED, K_TOUCHED, K_FREED, K_STORED, K_REMOVED, K_CHECKPOINT, K_SUPPRESSED,
    K_DROPPED, K_BLOCK_STATE, K_KEY_CACHED, K_REQUEST_STATE,
    NUM_KINDS
};
/* The waterfall's levels (attribution.SHORTFALL_CAUSES, in order), then the causes beyond the
   ideal: a cause's index is its position in attribution.CAUSES. */
enum {
    C_HIT_CAP, C_EAGLE_DROPPED_UNIT, C_BLOCK_QUANTISATION, C_MAMBA_NOT_RESERVED,
    C_MAMBA_NOT_RETAINED, C_MAMBA_SUPPRESSED, C_REKEYED, C_INVALIDATED, C_CHECKPOINT_PUSHOUT,
    C_EVICTED, C_MAMBA_EVICTED, C_OTHER, C_COLD, C_PARTIAL_UNIT, C_SHORT_PROMPT
};
#define PRESENT 12  /* a key the cache held (len(SHORTFALL_CAUSES)) */
#define REAL (C_OTHER - 1)  /* keys above this level are the ones the cache held */
#define NO_REQ (-1)
#define PUSHOUT_EXAMPLES 3
#define NONE_VALUE INT64_MIN  /* a NULL in the output columns */
#define MAX_GROUPS 64
#define MAX_BLOCK_ID ((i64)1 << 31)
#define MAX_FIELDS 24

static inline i64 floordiv(i64 a, i64 b) {
    i64 q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline i64 floormod(i64 a, i64 b) { return a - floordiv(a, b) * b; }
static inline i64 min64(i64 a, i64 b) { return a < b ? a : b; }
static inline i64 max64(i64 a, i64 b) { return a > b ? a : b; }

/* --- input columns ------------------------------------------------------------------------------ */

typedef struct {
    PyObject *list;  /* a list (of ints, or of objects), or NULL for a buffer */
    Py_buffer view;
    int itemsize, is_unsigned, open;
} Col;

static int col_open(Col *c, PyObject *obj) {
    memset(c, 0, sizeof(*c));
    if (PyList_Check(obj)) {
        c->list = obj;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    c->open = 1;
    const char *format = c->view.format ? c->view.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    c->itemsize = (int)c->view.itemsize;
    c->is_unsigned = *format == '?' || *format == 'B' || *format == 'H' || *format == 'I'
                     || *format == 'L' || *format == 'Q';
    if (c->view.ndim > 1 || !strchr("bBhHiIlLqQ?", *format) || format[1]
        || (c->itemsize != 1 && c->itemsize != 2 && c->itemsize != 4 && c->itemsize != 8)) {
        PyErr_Format(PyExc_TypeError, "forensics core: a column of '%s' is not an int column",
                     c->view.format ? c->view.format : "?");
        return -1;
    }
    return 0;
}
static void col_close(Col *c) {
    if (c->open) PyBuffer_Release(&c->view);
    c->open = 0;
}
static inline Py_ssize_t col_len(const Col *c) {
    return c->list ? PyList_GET_SIZE(c->list) : c->view.len / c->itemsize;
}
/* The int at row i (checked by the caller against col_len). A list's items are ints. */
static inline i64 col_get(const Col *c, Py_ssize_t i) {
    if (c->list) return PyLong_AsLongLong(PyList_GET_ITEM(c->list, i));
    const char *p = (const char *)c->view.buf + i * c->itemsize;
    switch (c->itemsize) {
    case 1: return c->is_unsigned ? (i64)*(const uint8_t *)p : (i64)*(const int8_t *)p;
    case 2: { int16_t v; memcpy(&v, p, 2); return c->is_unsigned ? (i64)(uint16_t)v : v; }
    case 4: { int32_t v; memcpy(&v, p, 4); return c->is_unsigned ? (i64)(uint32_t)v : v; }
    default: { int64_t v; memcpy(&v, p, 8); return (i64)v; }
    }
}

/* --- output columns ------------------------------------------------------------------------------ */

/* A table's columns: int64s, but a column of objects (a str or bytes field: `objects[i]`, a
   list, the objects as the reader decoded them), and those stored in 32 bits (`narrow[i]`: taken
   as int32s, each value checked). */
typedef struct { LVec *columns; PyObject **objects; char *narrow; int num_columns; } Table;

static int table_init(Table *t, int num_columns) {
    t->columns = PyMem_Calloc((size_t)num_columns, sizeof(LVec));
    t->objects = PyMem_Calloc((size_t)num_columns, sizeof(PyObject *));
    t->narrow = PyMem_Calloc((size_t)num_columns, 1);
    t->num_columns = num_columns;
    return t->columns && t->objects && t->narrow ? 0 : (PyErr_NoMemory(), -1);
}
static void table_free(Table *t) {
    for (int i = 0; i < t->num_columns; i++) {
        lvec_free(&t->columns[i]);
        if (t->objects) Py_CLEAR(t->objects[i]);
    }
    PyMem_Free(t->columns);
    PyMem_Free(t->objects);
    PyMem_Free(t->narrow);
    t->columns = NULL;
    t->objects = NULL;
    t->narrow = NULL;
}
static Py_ssize_t table_rows(const Table *t) { return t->num_columns ? t->columns[0].n : 0; }
/* A narrow column's first `count` values as int32 bytes; a value past 32 bits raises
   OverflowError((table, column, value)). */
static PyObject *narrowed(const LVec *column, Py_ssize_t count, int table, int index) {
    PyObject *data = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int32_t));
    if (!data) return NULL;
    int32_t *out = (int32_t *)PyBytes_AS_STRING(data);
    for (Py_ssize_t row = 0; row < count; row++) {
        i64 value = column->v[row];
        if (value < INT32_MIN || value > INT32_MAX) {
            Py_DECREF(data);
            PyObject *where = Py_BuildValue("(iiL)", table, index, value);
            if (where) PyErr_SetObject(PyExc_OverflowError, where);
            Py_XDECREF(where);
            return NULL;
        }
        out[row] = (int32_t)value;
    }
    return data;
}
/* The table's first `count` rows (all: count 0) as a tuple of columns (bytes of native int64s,
   NONE_VALUE for NULL, or of int32s for a narrow column; a list for a column of objects),
   taken out. `index`: the table's, as take_tables numbers them. */
static PyObject *table_take(Table *t, Py_ssize_t count, int index) {
    Py_ssize_t rows = table_rows(t);
    if (count <= 0 || count > rows) count = rows;
    PyObject *out = PyTuple_New(t->num_columns);
    if (!out) return NULL;
    for (int i = 0; i < t->num_columns; i++) {  /* every column checked before any is taken */
        LVec *column = &t->columns[i];
        PyObject *data = t->objects[i] ? PyList_GetSlice(t->objects[i], 0, count)
                       : t->narrow[i] ? narrowed(column, count, index, i)
                       : PyBytes_FromStringAndSize((const char *)column->v,
                                                   count * (Py_ssize_t)sizeof(i64));
        if (!data) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, data);
    }
    for (int i = 0; i < t->num_columns; i++) {
        LVec *column = &t->columns[i];
        if (t->objects[i]) {
            if (PyList_SetSlice(t->objects[i], 0, count, NULL)) { Py_DECREF(out); return NULL; }
            continue;
        }
        memmove(column->v, column->v + count, (size_t)(column->n - count) * sizeof(i64));
        column->n -= count;
    }
    return out;
}

/* --- the state --------------------------------------------------------------------------------- */

typedef struct {  /* the removal that took a key's last copy (attribution.Removal) */
    i64 seq, step, by_req, behind;
    int32_t block;
    int8_t reason;
} Removal;

typedef struct {  /* explaining: a removal's transient checkpoints behind, (req, position, block) */
    i64 examples[PUSHOUT_EXAMPLES][3];
    int num_examples;
} Examples;

typedef struct {  /* a key (hash id, group) ever stored, or removed */
    int32_t copies;
    int32_t removal;  /* index into removals, -1 none */
} Key;

typedef struct { i64 group, position; int8_t position_class; } CheckpointClass;

typedef struct {
    i64 req;
    int has_units;
    LVec units;
    i64 scheduled;
    int has_pending;
    i64 pending_seq, pending_step, pending_hit, pending_boundary;
    CheckpointClass *classes;
    Py_ssize_t num_classes, cap_classes;
} Request;

typedef struct {  /* per block */
    /* the attribution's transient checkpoint entry (MissAttributor._transient), if any */
    char transient, in_use, evictable;
    i64 t_req, t_position;
    int32_t t_group, t_keys;
    int32_t prev, next;  /* evictable blocks in insertion order (a dict's order) */
    /* the cache entries' block state (database.py's block_states view) */
    char s_in_use, s_transient, s_evictable;
    int32_t s_keys;
    int32_t latest_entry;  /* the entry most recently stored on it: -1 none, -2 removed */
    int32_t open_entries;  /* its open entries, newest first (Entry.next_open) */
} Block;

typedef struct {  /* a cache entry, while open */
    i64 stored_seq, hash_id, hits, last_hit_seq, last_hit_step;
    i64 position_class;  /* NONE_VALUE: NULL (not a checkpoint; no class recorded) */
    int32_t block, group, next_open;  /* next_open: the next open entry of its block (or key) */
    char open;
} Entry;

enum {  /* miss_attribution columns (stream.ATTRIBUTION_COLUMNS) */
    A_REQ, A_LOOKUP, A_SEQ, A_STEP, A_QUERY, A_IDEAL, A_HIT, A_ATTENTION_HIT, A_MAMBA_HIT,
    A_CAUSE, A_TOKENS, A_FROM, A_TO, A_KEY_GROUP, A_KEY_DEPTH, A_KEY_HASH, A_REMOVED_BLOCK,
    A_REMOVED_SEQ, A_REMOVED_STEP, A_REMOVED_BY_REQ, A_TRANSIENT_BEHIND, A_IN_FLIGHT,
    NUM_A
};
enum {  /* cache_entry_figures columns (stream.ENTRY_COLUMNS): what an entry adds to its store */
    E_STORED_SEQ, E_BLOCK, E_REMOVED_SEQ, E_REMOVED_STEP, E_REMOVED_REASON, E_POSITION_CLASS,
    E_HITS, E_LAST_HIT_SEQ, E_LAST_HIT_STEP, E_TRANSIENT_CACHED,
    NUM_E
};

typedef struct {  /* a record kind (kvtrace.events.RECORD_TYPES), as this pass reads it */
    int kind;  /* its K_* code, -1: the attribution reads none of it */
    int num_read, read[8];  /* the fields the attribution reads, in its order */
    int shape;  /* its rows go to tables (every field an int, an int list, a str or bytes) */
    int num_fields;
    char field_kinds[MAX_FIELDS];  /* per field: 'i' int, 'l' int list, 's' str or bytes, 'o' other */
    int req_field;  /* the field its list fields' rows carry as req, -1: none */
    int table;  /* its table; its list fields' child tables follow, in field order */
} RecordSpec;

typedef struct {
    PyObject_HEAD
    RecordSpec *specs; int num_specs;
    Table *tables; int num_tables;
    int attribute;  /* 0: only the tables (a trace without an engine config) */
    int make_tables;  /* the record tables' rows (load), or not (why) */
    int broken;  /* a batch failed midway: its tables may be ragged, so nothing more is taken */
    /* geometry (attribution._Geometry) */
    i64 unit, attention_block, mamba_block, alignment;
    i64 eagle_drop, eagle_margin;  /* use_eagle: tokens dropped from, searched past, the cap */
    int num_groups, num_attention, num_mamba;
    int attention_groups[MAX_GROUPS], mamba_groups[MAX_GROUPS], is_mamba[MAX_GROUPS];
    /* enum values (kvtrace.events) */
    i64 checkpoint_kind, transient_class, lru_reuse, stale_checkpoint, rekey, running_queue;
    /* options */
    int explain, keep_lookups, make_rows, make_entries, all_requests;
    i64 only_request;
    PyObject *request_id;  /* a str, or NULL */
    /* the attribution's state */
    Spill spill;  /* where the state that grows with the trace lives (containers.h) */
    IdIndex keys[MAX_GROUPS];  /* per group: hash_id -> index into key_info */
    ChunkVec key_info; Py_ssize_t num_keys;  /* Key */
    ChunkVec removals; Py_ssize_t num_removals;  /* Removal */
    ChunkVec examples;  /* explaining: Examples, one per removal */
    IdSet computed, states, suppressed;  /* sets of hash ids */
    Map requests;  /* req -> Request * (those not finished) */
    IdIndex admissions;  /* req -> admitted lookups so far */
    IdSet in_flight;  /* reqs of the start snapshot */
    Block *blocks; Py_ssize_t num_blocks;
    int32_t evictable_head, evictable_tail;
    i64 num_evictable;
    i64 allocating, seq, step, dropped_events;
    int allocation_ok;
    /* the cache entries' state */
    Entry *entries; Py_ssize_t num_entries, cap_entries;
    IVec free_entries;
    IdIndex unknown_open[MAX_GROUPS];  /* the unknown block's open entries, by key (per group) */
    i64 s_num_evictable;
    /* outputs */
    Table rows, entry_rows;
    PyObject *lookups;  /* keep_lookups: a list of lookup tuples */
    /* scratch per lookup */
    LVec attention_levels, mamba_levels;
} Core;

/* --- small helpers -------------------------------------------------------------------------- */

/* The output table numbered `t` as take_tables numbers them: the record tables, then the
   attribution's rows, then the cache entries' figures. */
static Table *table_at(Core *c, int t) {
    return t < c->num_tables ? &c->tables[t] : t == c->num_tables ? &c->rows : &c->entry_rows;
}

static int fail(const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    PyErr_FormatV(PyExc_ValueError, format, ap);
    va_end(ap);
    return -1;
}


static Request *find_request(Core *c, i64 req) {
    i64 slot;
    return map_get(&c->requests, req, &slot) ? (Request *)(intptr_t)slot : NULL;
}
static Request *request_of(Core *c, i64 req) {
    Request *r = find_request(c, req);
    if (r) return r;
    r = PyMem_Calloc(1, sizeof(Request));
    if (!r) { PyErr_NoMemory(); return NULL; }
    r->req = req;
    if (map_set(&c->requests, req, (i64)(intptr_t)r)) { PyMem_Free(r); return NULL; }
    return r;
}
static void free_request(Request *r) {
    lvec_free(&r->units);
    PyMem_Free(r->classes);
    PyMem_Free(r);
}

static int check_group(Core *c, i64 group, const char *kind) {
    if (group < 0 || group >= c->num_groups)
        return fail("record %lld (%s) names KV-cache group %lld, but the header has %d group%s "
                    "(0 to %d)", c->seq, kind, group, c->num_groups,
                    c->num_groups == 1 ? "" : "s", c->num_groups - 1);
    return 0;
}

/* A block's slot: its id + 1, slot 0 for the unknown block -1 (a source that names none, like
   vLLM's own KV events). */
static inline int32_t slot_of(i64 block_id) { return (int32_t)(block_id + 1); }

static Block *block_at(Core *c, i64 block_id, const char *kind) {
    if (block_id < -1 || block_id >= c->num_blocks - 1) {
        fail("record %lld (%s) names block %lld, outside the header's pool of %lld blocks",
             c->seq, kind, block_id, (i64)c->num_blocks - 1);
        return NULL;
    }
    return &c->blocks[slot_of(block_id)];
}

static Key *key_of(Core *c, i64 hash_id, int group, int create) {
    int32_t index = id_index_get(&c->keys[group], hash_id);
    if (index >= 0) return chunk_at(&c->key_info, index);
    if (!create) return NULL;
    if (c->num_keys == INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "more than 2^31 keys");
        return NULL;
    }
    if (chunk_reserve(&c->key_info, c->num_keys + 1)
        || id_index_set(&c->keys[group], hash_id, (int32_t)c->num_keys))
        return NULL;
    Key *key = chunk_at(&c->key_info, c->num_keys++);
    key->copies = 0;
    key->removal = -1;
    return key;
}

/* --- the transient checkpoints cached in the free queue (attribution) ------------------------- */

static void evictable_drop(Core *c, int32_t b) {
    Block *k = &c->blocks[b];
    if (!k->evictable) return;
    if (k->prev >= 0) c->blocks[k->prev].next = k->next; else c->evictable_head = k->next;
    if (k->next >= 0) c->blocks[k->next].prev = k->prev; else c->evictable_tail = k->prev;
    k->prev = k->next = -1;
    k->evictable = 0;
    c->num_evictable--;
}
static void evictable_add(Core *c, int32_t b) {  /* at the end, unless already there */
    Block *k = &c->blocks[b];
    if (k->evictable) return;
    k->prev = c->evictable_tail;
    k->next = -1;
    if (c->evictable_tail >= 0) c->blocks[c->evictable_tail].next = b; else c->evictable_head = b;
    c->evictable_tail = b;
    k->evictable = 1;
    c->num_evictable++;
}
/* MissAttributor._recheck */
static void recheck(Core *c, int32_t b) {
    Block *k = &c->blocks[b];
    if (k->transient && k->t_keys && !k->in_use) evictable_add(c, b);
    else evictable_drop(c, b);
}

/* --- the cache entries' block state (block_states) --------------------------------------------- */

static void block_state_changed(Core *c, Block *k) {
    char evictable = !k->s_in_use && k->s_transient && k->s_keys > 0;
    if (evictable != k->s_evictable) {
        c->s_num_evictable += evictable ? 1 : -1;
        k->s_evictable = evictable;
    }
}

static int entry_row(Core *c, Entry *e, i64 removed_seq, i64 removed_step, i64 reason,
                     i64 transient_cached) {
    if (!c->make_entries) return 0;
    i64 values[NUM_E] = {
        e->stored_seq, e->block, removed_seq, removed_step, reason, e->position_class, e->hits,
        e->hits ? e->last_hit_seq : NONE_VALUE, e->hits ? e->last_hit_step : NONE_VALUE,
        transient_cached};
    for (int i = 0; i < NUM_E; i++)
        if (lvec_push(&c->entry_rows.columns[i], values[i])) return -1;
    return 0;
}

static int open_entry(Core *c, int32_t block_id, Block *k, i64 hash_id, int group,
                      i64 position_class, int transient) {
    int32_t index;
    if (c->free_entries.n) {
        index = c->free_entries.v[--c->free_entries.n];
    } else {
        if (c->num_entries == c->cap_entries) {
            Py_ssize_t size = c->cap_entries ? c->cap_entries * 2 : 1024;
            Entry *entries = PyMem_Realloc(c->entries, (size_t)size * sizeof(Entry));
            if (!entries) { PyErr_NoMemory(); return -1; }
            c->entries = entries;
            c->cap_entries = size;
        }
        index = (int32_t)c->num_entries++;
    }
    Entry *e = &c->entries[index];
    memset(e, 0, sizeof(*e));
    e->stored_seq = c->seq;
    e->hash_id = hash_id;
    e->block = block_id;
    e->group = group;
    e->position_class = position_class;
    e->open = 1;
    if (block_id == -1) {  /* any number of keys: chained by key, not by block */
        e->next_open = id_index_get(&c->unknown_open[group], hash_id);
        if (id_index_set(&c->unknown_open[group], hash_id, index)) return -1;
    } else {
        e->next_open = k->open_entries;
        k->open_entries = index;
    }
    k->latest_entry = index;
    k->s_keys++;
    k->s_transient = (char)transient;
    block_state_changed(c, k);
    return 0;
}

/* A key's removal from a block: every open entry of that key on it ends here (the first removal
   after a store closes it), with the transient checkpoints cached just before. */
static int close_entries(Core *c, Block *k, i64 hash_id, int group, i64 reason) {
    i64 cached = c->s_num_evictable;
    int32_t unknown = -1;
    int32_t *link = &k->open_entries;
    if (k == &c->blocks[slot_of(-1)]) {
        unknown = id_index_get(&c->unknown_open[group], hash_id);
        link = &unknown;
    }
    while (*link >= 0) {
        int32_t index = *link;
        Entry *e = &c->entries[index];
        if (e->hash_id != hash_id || e->group != group) {
            link = &e->next_open;
            continue;
        }
        if (entry_row(c, e, c->seq, c->step, reason, cached)) return -1;
        *link = e->next_open;
        e->open = 0;
        if (k->latest_entry == index) k->latest_entry = -2;
        if (ivec_push(&c->free_entries, index)) return -1;
    }
    if (link == &unknown) id_index_clear_one(&c->unknown_open[group], hash_id);
    k->s_keys--;
    block_state_changed(c, k);
    return 0;
}

/* --- the lookup ----------------------------------------------------------------------------- */

/* MissAttributor._level: which restriction of the ideal cache takes hash_id in group. */
static int level_of(Core *c, int group, i64 hash_id) {
    Key *key = key_of(c, hash_id, group, 0);
    if (key && key->copies) return PRESENT;
    int mamba = c->is_mamba[group];
    if (!key || key->removal < 0) {  /* never stored (or, held by no block, never lost) */
        if (!mamba) return C_BLOCK_QUANTISATION;
        if (id_set_has(&c->suppressed, hash_id)) return C_MAMBA_SUPPRESSED;
        if (id_set_has(&c->states, hash_id)) return C_MAMBA_NOT_RETAINED;
        return C_MAMBA_NOT_RESERVED;
    }
    Removal *removal = chunk_at(&c->removals, key->removal);
    if (removal->reason == c->lru_reuse) {
        if (removal->behind) return C_CHECKPOINT_PUSHOUT;
        return mamba ? C_MAMBA_EVICTED : C_EVICTED;
    }
    if (removal->reason == c->stale_checkpoint) return C_MAMBA_SUPPRESSED;
    if (removal->reason == c->rekey) return C_REKEYED;
    return C_INVALIDATED;
}

/* MissAttributor._levels: per unit depth 0..depth (0 is a placeholder), the first restriction
   that takes the key from any of groups. */
static int levels_of(Core *c, const int *groups, int num_groups, const i64 *units, i64 depth,
                     LVec *out) {
    out->n = 0;
    if (lvec_push(out, 0)) return -1;
    for (i64 d = 0; d < depth; d++) {
        int level = PRESENT;
        for (int g = 0; g < num_groups; g++) {
            Key *key = key_of(c, units[d], groups[g], 0);
            if (key && key->copies) continue;
            int found = level_of(c, groups[g], units[d]);
            if (found < level) level = found;
        }
        if (lvec_push(out, level)) return -1;
    }
    return 0;
}

/* _Geometry.attention_reach */
static i64 attention_reach(Core *c, const LVec *levels, i64 threshold, i64 num_units, i64 cap) {
    if (!c->num_attention) return cap;
    i64 unit = c->unit, block = c->attention_block, per_block = floordiv(block, unit);
    i64 limit = c->eagle_drop ? cap + c->eagle_margin : cap;
    i64 known = levels->n - 1;
    i64 num_blocks = min64(floordiv(limit, block), floordiv(num_units, per_block));
    i64 found = 0;
    while (found < num_blocks) {
        i64 depth = (found + 1) * per_block;
        if (depth > known || levels->v[depth] <= threshold) break;
        found++;
    }
    i64 reach = found * block;
    if (c->alignment < block && block % c->alignment == 0) {
        i64 first = found * per_block;
        i64 last = min64(min64(first + per_block - 1, floordiv(limit, unit)),
                         min64(num_units, known));
        for (i64 depth = last; depth > first; depth--)
            if (levels->v[depth] > threshold) { reach = depth * unit; break; }
    }
    if (c->eagle_drop && reach > 0) {
        reach -= c->eagle_drop;
        reach -= floormod(reach, c->alignment);
    }
    return reach;
}

/* _Geometry.eagle_ideal */
static i64 eagle_ideal(Core *c, i64 ideal, i64 cap) {
    i64 reach = min64(ideal, floordiv(cap + c->eagle_margin, c->unit) * c->unit);
    return max64(reach - c->eagle_drop, 0);
}

/* _Geometry.mamba_state */
static i64 mamba_state(Core *c, const LVec *levels, i64 threshold, i64 num_units, i64 limit) {
    if (!c->num_mamba) return limit;
    i64 unit = c->unit, block = c->mamba_block, known = levels->n - 1;
    if (c->alignment < block && block % c->alignment == 0) {
        for (i64 depth = min64(min64(floordiv(limit, unit), num_units), known); depth > 0; depth--)
            if (levels->v[depth] > threshold) return depth * unit;
        return 0;
    }
    i64 per_block = floordiv(block, unit);
    for (i64 index = floordiv(limit, block) - 1; index >= 0; index--) {
        i64 depth = (index + 1) * per_block;
        if (depth <= known && levels->v[depth] > threshold
            && floormod((index + 1) * block, c->alignment) == 0)
            return (index + 1) * block;
    }
    return 0;
}

static i64 joint_hit(Core *c, i64 threshold, i64 num_units, i64 cap) {
    i64 reach = attention_reach(c, &c->attention_levels, threshold, num_units, cap);
    return mamba_state(c, &c->mamba_levels, threshold, num_units, reach);
}

typedef struct { int group; i64 depth, hash_id; int32_t removal; } LostKey;

/* MissAttributor._lost_key */
static void lost_key(Core *c, const int *groups, int num_groups, int level, i64 depth,
                     const i64 *units, LostKey *out) {
    i64 hash_id = units[depth - 1];
    int group = groups[0];
    for (int g = 0; g < num_groups; g++)
        if (level_of(c, groups[g], hash_id) == level) { group = groups[g]; break; }
    Key *key = key_of(c, hash_id, group, 0);
    out->group = group;
    out->depth = depth * c->unit;
    out->hash_id = hash_id;
    out->removal = key ? key->removal : -1;
}

/* MissAttributor._lost_keys: the keys of `cause` its restriction took between start and end (up
   to max_keys; 1 unless explaining). */
static Py_ssize_t lost_keys(Core *c, int cause, i64 start, i64 end, const i64 *units,
                            LostKey *keys, Py_ssize_t max_keys) {
    if (cause < C_BLOCK_QUANTISATION || cause > C_MAMBA_EVICTED) return 0;
    const LVec *attention = &c->attention_levels, *mamba = &c->mamba_levels;
    Py_ssize_t n = 0;
    i64 last = floordiv(end, c->unit);
    if (0 <= last && last < mamba->n && mamba->v[last] == cause && n < max_keys)
        lost_key(c, c->mamba_groups, c->num_mamba, cause, last, units, &keys[n++]);
    i64 per_block = floordiv(c->attention_block, c->unit);
    i64 top = min64(last, attention->n - 1);
    for (i64 depth = max64(floordiv(start, c->unit) + 1, 1); depth <= top; depth++) {
        if (attention->v[depth] == cause && (floormod(depth, per_block) == 0 || depth == last)
            && n < max_keys)
            lost_key(c, c->attention_groups, c->num_attention, cause, depth, units, &keys[n++]);
        if (n && !c->explain) break;
    }
    return n;
}

typedef struct { int cause; i64 start, end; } Segment;

static PyObject *removal_tuple(Core *c, int32_t index) {
    if (index < 0) Py_RETURN_NONE;
    const Removal *r = chunk_at(&c->removals, index);
    const Examples *behind = c->explain ? chunk_at(&c->examples, index) : NULL;
    PyObject *examples = PyTuple_New(behind ? behind->num_examples : 0);
    if (!examples) return NULL;
    for (int i = 0; behind && i < behind->num_examples; i++) {
        const i64 *e = behind->examples[i];
        PyObject *example = Py_BuildValue("(LLL)", e[0], e[1], e[2]);
        if (!example) { Py_DECREF(examples); return NULL; }
        PyTuple_SET_ITEM(examples, i, example);
    }
    return Py_BuildValue("(iLLiLLN)", (int)r->reason, r->seq, r->step, (int)r->block, r->by_req,
                         r->behind, examples);
}

static PyObject *optional(i64 value) {
    if (value == NONE_VALUE) Py_RETURN_NONE;
    return PyLong_FromLongLong(value);
}

/* One segment: a row for the table, or a (cause, start, end, keys) tuple for `why`. */
static int segment_out(Core *c, PyObject *segments, const i64 *head, int cause, i64 start,
                       i64 end, const LostKey *keys, Py_ssize_t num_keys) {
    if (c->make_rows) {
        const LostKey *key = num_keys ? &keys[0] : NULL;
        const Removal *removal = key && key->removal >= 0
            ? chunk_at(&c->removals, key->removal) : NULL;
        i64 values[NUM_A] = {
            head[A_REQ], head[A_LOOKUP], head[A_SEQ], head[A_STEP], head[A_QUERY],
            head[A_IDEAL], head[A_HIT], head[A_ATTENTION_HIT], head[A_MAMBA_HIT], cause,
            end - start, start, end,
            key ? key->group : NONE_VALUE, key ? key->depth : NONE_VALUE,
            key ? key->hash_id : NONE_VALUE,
            removal ? removal->block : NONE_VALUE, removal ? removal->seq : NONE_VALUE,
            removal ? removal->step : NONE_VALUE,
            removal && removal->by_req != NO_REQ ? removal->by_req : NONE_VALUE,
            removal ? removal->behind : NONE_VALUE, head[A_IN_FLIGHT]};
        for (int i = 0; i < NUM_A; i++)
            if (lvec_push(&c->rows.columns[i], values[i])) return -1;
    }
    if (segments) {
        PyObject *key_list = PyList_New(num_keys);
        if (!key_list) return -1;
        for (Py_ssize_t i = 0; i < num_keys; i++) {
            PyObject *removal = removal_tuple(c, keys[i].removal);
            PyObject *key = removal ? Py_BuildValue("(iLLN)", keys[i].group, keys[i].depth,
                                                    keys[i].hash_id, removal) : NULL;
            if (!key) { Py_DECREF(key_list); return -1; }
            PyList_SET_ITEM(key_list, i, key);
        }
        PyObject *segment = Py_BuildValue("(iLLN)", cause, start, end, key_list);
        if (!segment || PyList_Append(segments, segment)) { Py_XDECREF(segment); return -1; }
        Py_DECREF(segment);
    }
    return 0;
}

/* MissAttributor._attribute */
static int attribute(Core *c, Request *r, i64 req, i64 admission, i64 num_tokens) {
    i64 unit = c->unit;
    const i64 *units = r && r->has_units ? r->units.v : NULL;
    i64 num_known = r && r->has_units ? r->units.n : 0;
    i64 num_units = min64(num_known, floordiv(num_tokens, unit));
    i64 seen = 0;
    while (seen < num_units && id_set_has(&c->computed, units[seen])) seen++;
    i64 hit = r->pending_hit;
    i64 ideal = max64(seen * unit, hit);
    i64 depth = min64(floordiv(ideal, unit), num_units);
    if (levels_of(c, c->attention_groups, c->num_attention, units, depth, &c->attention_levels)
        || levels_of(c, c->mamba_groups, c->num_mamba, units, depth, &c->mamba_levels))
        return -1;
    i64 cap = num_tokens - 1;
    i64 head[NUM_A];
    head[A_REQ] = req;
    head[A_LOOKUP] = admission;
    head[A_SEQ] = r->pending_seq;
    head[A_STEP] = r->pending_step;
    head[A_QUERY] = num_tokens;
    head[A_IDEAL] = ideal;
    head[A_HIT] = hit;
    head[A_ATTENTION_HIT] = c->num_attention
        ? attention_reach(c, &c->attention_levels, REAL, num_units, cap) : NONE_VALUE;
    head[A_MAMBA_HIT] = c->num_mamba
        ? mamba_state(c, &c->mamba_levels, REAL, num_units, cap) : NONE_VALUE;
    head[A_IN_FLIGHT] = id_set_has(&c->in_flight, req);
    PyObject *segments = c->keep_lookups ? PyList_New(0) : NULL;
    if (c->keep_lookups && !segments) return -1;
    Py_ssize_t max_keys = c->explain ? (Py_ssize_t)(2 + depth) : 1;
    LostKey *keys = PyMem_Malloc((size_t)max_keys * sizeof(LostKey));
    if (!keys) { Py_XDECREF(segments); PyErr_NoMemory(); return -1; }
    int rc = 0;
    i64 previous = ideal;
    if (ideal > hit) {
        /* the waterfall: the last-token cap, EAGLE's dropped unit (use_eagle), then each key
           class in turn (block quantisation always: the search itself quantises); a class no
           key carries is skipped */
        char carried[PRESENT + 1] = {0};
        for (Py_ssize_t i = 0; i < c->attention_levels.n; i++) carried[c->attention_levels.v[i]] = 1;
        for (Py_ssize_t i = 0; i < c->mamba_levels.n; i++) carried[c->mamba_levels.v[i]] = 1;
        for (int cause = C_HIT_CAP; cause <= C_MAMBA_EVICTED && !rc; cause++) {
            if (cause == C_EAGLE_DROPPED_UNIT ? !c->eagle_drop
                : cause != C_HIT_CAP && cause != C_BLOCK_QUANTISATION && !carried[cause])
                continue;
            if (previous == hit) break;
            i64 now = cause == C_HIT_CAP ? min64(ideal, floordiv(cap, unit) * unit)
                    : cause == C_EAGLE_DROPPED_UNIT ? eagle_ideal(c, ideal, cap)
                    : joint_hit(c, cause, num_units, cap);
            now = max64(hit, min64(previous, now));
            if (now < previous) {
                Py_ssize_t n = lost_keys(c, cause, now, previous, units, keys, max_keys);
                rc = segment_out(c, segments, head, cause, now, previous, keys, n);
            }
            previous = now;
        }
    }
    if (!rc && previous > hit) rc = segment_out(c, segments, head, C_OTHER, hit, previous, NULL, 0);
    i64 whole_units = floordiv(num_tokens, unit) * unit;
    if (!rc && whole_units > ideal)
        rc = segment_out(c, segments, head, C_COLD, ideal, whole_units, NULL, 0);
    if (!rc && num_tokens > whole_units)
        rc = segment_out(c, segments, head, whole_units == 0 ? C_SHORT_PROMPT : C_PARTIAL_UNIT,
                         max64(whole_units, ideal), num_tokens, NULL, 0);
    PyMem_Free(keys);
    if (!rc && segments) {
        PyObject *lookup = Py_BuildValue(
            "(LLLLLLLLNNON)", req, admission, head[A_SEQ], head[A_STEP], num_tokens, ideal, hit,
            r->pending_boundary, optional(head[A_ATTENTION_HIT]), optional(head[A_MAMBA_HIT]),
            head[A_IN_FLIGHT] ? Py_True : Py_False, segments);
        segments = NULL;
        if (!lookup || PyList_Append(c->lookups, lookup)) rc = -1;
        Py_XDECREF(lookup);
    }
    Py_XDECREF(segments);
    return rc;
}

/* --- the records ---------------------------------------------------------------------------- */

static int add_units(Request *r, const Col *lengths, const Col *values, Py_ssize_t row,
                     Py_ssize_t start, int replace) {
    i64 n = col_get(lengths, row);
    if (replace) r->units.n = 0;
    for (i64 i = 0; i < n; i++)
        if (lvec_push(&r->units, col_get(values, start + i))) return -1;
    r->has_units = 1;
    return 0;
}

static int on_allocated(Core *c, i64 req, i64 num_new, i64 num_computed, i64 num_new_computed,
                        i64 num_external, i64 num_tokens, int success) {
    c->allocating = req;
    c->allocation_ok = success;
    Request *r = find_request(c, req);
    int had_lookup = r && r->has_pending;
    if (r) r->has_pending = 0;
    if (!success) return 0;
    if (had_lookup) {
        int32_t before = id_index_get(&c->admissions, req);  /* -1: none */
        i64 admission = (before < 0 ? 0 : before) + 1;
        if (id_index_set(&c->admissions, req, (int32_t)admission)) return -1;
        if ((c->all_requests || c->only_request == req)
            && attribute(c, r, req, admission, num_tokens))
            return -1;
    }
    i64 end = min64(num_computed + num_new_computed + num_external + num_new, num_tokens);
    i64 num_known = r && r->has_units ? r->units.n : 0;
    i64 done = min64(floordiv(end, c->unit), num_known);
    i64 start = r ? r->scheduled : 0;
    if (done > start) {
        for (i64 i = start; i < done; i++)
            if (id_set_add(&c->computed, r->units.v[i])) return -1;
        r->scheduled = done;
    }
    i64 at = floordiv(end, c->unit);
    if (floormod(end, c->unit) == 0 && 0 < at && at <= num_known
        && id_set_add(&c->states, r->units.v[at - 1]))
        return -1;
    return 0;
}

static int on_stored(Core *c, i64 block_id, i64 hash_id, i64 group, i64 num_tokens, i64 kind,
                     i64 req) {
    if (check_group(c, group, "block_stored"))
        return -1;
    Block *k = block_at(c, block_id, "block_stored");
    if (!k) return -1;
    Key *key = key_of(c, hash_id, (int)group, 1);
    if (!key) return -1;
    key->copies++;
    i64 position_class = NONE_VALUE;
    if (kind == c->checkpoint_kind) {
        Request *r = find_request(c, req);
        for (Py_ssize_t i = r ? r->num_classes - 1 : -1; i >= 0; i--)
            if (r->classes[i].group == group && r->classes[i].position == num_tokens) {
                position_class = r->classes[i].position_class;
                break;
            }
    }
    int transient = kind == c->checkpoint_kind && position_class == c->transient_class;
    int32_t b = slot_of(block_id);
    if (transient) {
        k->transient = 1;
        k->t_req = req;
        k->t_group = (int32_t)group;
        k->t_position = num_tokens;
        k->t_keys = 1;
        k->in_use = 1;
        evictable_drop(c, b);
    } else if (k->transient) {  /* a newer key: no longer a transient entry */
        k->transient = 0;
        k->in_use = 0;
        evictable_drop(c, b);
    }
    return open_entry(c, (int32_t)block_id, k, hash_id, (int)group, position_class, transient);
}

static int on_removed(Core *c, i64 block_id, i64 hash_id, i64 group, i64 reason) {
    if (check_group(c, group, "block_removed"))
        return -1;
    Block *k = block_at(c, block_id, "block_removed");
    if (!k) return -1;
    int32_t b = slot_of(block_id);
    Key *key = key_of(c, hash_id, (int)group, 1);
    if (!key) return -1;
    if (key->copies > 1) {
        key->copies--;
    } else {  /* the last copy: remember how it went */
        key->copies = 0;
        /* a key's earlier removal is not read again: its slot is reused (so there are no more
           removals than keys) */
        if (key->removal < 0
            && (chunk_reserve(&c->removals, c->num_removals + 1)
                || (c->explain && chunk_reserve(&c->examples, c->num_removals + 1))))
            return -1;
        int32_t index = key->removal >= 0 ? key->removal : (int32_t)c->num_removals++;
        Removal *removal = chunk_at(&c->removals, index);
        key->removal = index;
        memset(removal, 0, sizeof(*removal));
        Examples *examples = c->explain ? chunk_at(&c->examples, index) : NULL;
        if (examples) examples->num_examples = 0;
        removal->reason = (int8_t)reason;
        removal->seq = c->seq;
        removal->step = c->step;
        removal->block = (int32_t)block_id;
        removal->by_req = NO_REQ;
        if (reason == c->lru_reuse) {
            removal->by_req = c->allocating;
            if (c->num_evictable) {
                removal->behind = c->num_evictable - (k->evictable ? 1 : 0);
                if (removal->behind && examples) {
                    for (int32_t o = c->evictable_tail; o >= 0 && examples->num_examples
                         < PUSHOUT_EXAMPLES; o = c->blocks[o].prev) {
                        if (o == b) continue;
                        i64 *example = examples->examples[examples->num_examples++];
                        example[0] = c->blocks[o].t_req;
                        example[1] = c->blocks[o].t_position;
                        example[2] = o - 1;  /* its block id */
                    }
                }
            }
        }
    }
    if (k->transient) {
        k->t_keys = k->t_keys > 0 ? k->t_keys - 1 : 0;
        recheck(c, b);
    }
    return close_entries(c, k, hash_id, (int)group, reason);
}

/* A block reference: BlockAllocated and BlockTouched take it (touched: a hit on its entry). */
static int on_taken(Core *c, i64 block_id, int touched) {
    Block *k = block_at(c, block_id, touched ? "block_touched" : "block_allocated");
    if (!k) return -1;
    if (k->transient) {
        k->in_use = 1;
        evictable_drop(c, slot_of(block_id));
    }
    if (touched && k->latest_entry >= 0) {
        Entry *e = &c->entries[k->latest_entry];
        e->hits++;
        e->last_hit_seq = c->seq;
        e->last_hit_step = c->step;
    }
    k->s_in_use = 1;
    block_state_changed(c, k);
    return 0;
}

static int on_freed(Core *c, i64 block_id, i64 ref_cnt) {
    Block *k = block_at(c, block_id, "block_freed");
    if (!k) return -1;
    if (ref_cnt == 0 && k->transient) {
        k->in_use = 0;
        recheck(c, slot_of(block_id));
    }
    k->s_in_use = ref_cnt > 0;
    block_state_changed(c, k);
    return 0;
}

static int on_checkpoint(Core *c, i64 req, i64 group, i64 position, i64 position_class) {
    Request *r = request_of(c, req);
    if (!r) return -1;
    if (r->num_classes == r->cap_classes) {
        Py_ssize_t size = r->cap_classes ? r->cap_classes * 2 : 4;
        CheckpointClass *classes = PyMem_Realloc(r->classes, (size_t)size * sizeof(*classes));
        if (!classes) { PyErr_NoMemory(); return -1; }
        r->classes = classes;
        r->cap_classes = size;
    }
    r->classes[r->num_classes++] = (CheckpointClass){group, position, (int8_t)position_class};
    i64 at = floordiv(position, c->unit);
    if (c->allocating == req && c->allocation_ok && r->has_units && 0 < at && at <= r->units.n)
        return id_set_add(&c->states, r->units.v[at - 1]);
    return 0;
}

static int request_matches(Core *c, PyObject *request_id) {
    if (!c->request_id || !PyUnicode_Check(request_id)) return 0;
    return PyUnicode_Compare(request_id, c->request_id) == 0;
}

/* --- the state records of a start snapshot ------------------------------------------------------ */

/* A key cached at the start: present (so never cold), held by `num_blocks` blocks, an entry on
   each of them. */
static int on_key_cached(Core *c, i64 hash_id, i64 group, const Col *lengths,
                         const Col *values, Py_ssize_t row, Py_ssize_t start) {
    if (check_group(c, group, "key_cached"))
        return -1;
    i64 n = col_get(lengths, row);
    if (n <= 0) return 0;
    Key *key = key_of(c, hash_id, (int)group, 1);
    if (!key || id_set_add(&c->computed, hash_id)) return -1;
    key->copies += (int32_t)n;
    for (i64 i = 0; i < n; i++) {
        i64 block_id = col_get(values, start + i);
        Block *k = block_at(c, block_id, "key_cached");
        if (!k || open_entry(c, (int32_t)block_id, k, hash_id, (int)group, NONE_VALUE, 0))
            return -1;
    }
    return 0;
}

/* A request in flight at the start: its units so far, those its computed tokens covered, and the
   admissions it had (its first, and one after each preemption, if it runs now). */
static int on_request_state(Core *c, i64 req, i64 queue, const Col *lengths, const Col *values,
                            Py_ssize_t row, Py_ssize_t start, i64 num_computed,
                            i64 num_preemptions) {
    Request *r = request_of(c, req);
    if (!r || add_units(r, lengths, values, row, start, 1) || id_set_add(&c->in_flight, req))
        return -1;
    i64 done = min64(max64(floordiv(num_computed, c->unit), 0), r->units.n);
    for (i64 i = 0; i < done; i++)
        if (id_set_add(&c->computed, r->units.v[i])) return -1;
    r->scheduled = done;
    i64 admissions = num_preemptions + (queue == c->running_queue);
    if (admissions >= INT32_MAX)
        return fail("record %lld (request_state) gives request %lld %lld preemptions", c->seq,
                    req, num_preemptions);
    return admissions > 0 ? id_index_set(&c->admissions, req, (int32_t)admissions) : 0;
}

/* --- feed ------------------------------------------------------------------------------------ */

typedef struct { Col cols[8]; int code, num_cols; Py_ssize_t row, element; } Source;

static int handle(Core *c, Source *s) {
    Col *f = s->cols;
    Py_ssize_t row = s->row++;
    i64 req;
    Request *r;
    switch (s->code) {
    case K_STEP:
        c->step++;
        c->allocating = NO_REQ;
        return 0;
    case K_ARRIVED:
    case K_EXTENDED: {
        c->allocating = NO_REQ;
        req = col_get(&f[0], row);
        Py_ssize_t start = s->element;
        s->element += (Py_ssize_t)col_get(&f[1], row);
        r = request_of(c, req);
        if (!r) return -1;
        if (s->code == K_EXTENDED || !r->has_units) {
            if (add_units(r, &f[1], &f[2], row, start, 0)) return -1;
        }
        if (s->code == K_ARRIVED && request_matches(c, PyList_GET_ITEM(f[3].list, row)))
            c->only_request = req;
        return 0;
    }
    case K_LOOKUP:
        c->allocating = NO_REQ;
        r = request_of(c, col_get(&f[0], row));
        if (!r) return -1;
        r->has_pending = 1;
        r->pending_seq = c->seq;
        r->pending_step = c->step;
        r->pending_hit = col_get(&f[1], row);
        r->pending_boundary = col_get(&f[2], row);
        return 0;
    case K_ALLOCATED:
        return on_allocated(c, col_get(&f[0], row), col_get(&f[1], row), col_get(&f[2], row),
                            col_get(&f[3], row), col_get(&f[4], row), col_get(&f[5], row),
                            col_get(&f[6], row) != 0);
    case K_FINISHED: {
        c->allocating = NO_REQ;
        req = col_get(&f[0], row);
        Py_ssize_t slot = map_find(&c->requests, req);
        if (slot >= 0) {
            free_request((Request *)(intptr_t)c->requests.slots[slot].val);
            map_del_at(&c->requests, (size_t)slot);
        }
        return 0;
    }
    case K_PREEMPTED:
        c->allocating = NO_REQ;
        r = find_request(c, col_get(&f[0], row));
        if (r) r->has_pending = 0;
        return 0;
    case K_BLOCK_ALLOCATED:
        return on_taken(c, col_get(&f[0], row), 0);
    case K_TOUCHED:
        return on_taken(c, col_get(&f[0], row), 1);
    case K_FREED:
        return on_freed(c, col_get(&f[0], row), col_get(&f[1], row));
    case K_STORED:
        return on_stored(c, col_get(&f[0], row), col_get(&f[1], row), col_get(&f[2], row),
                         col_get(&f[3], row), col_get(&f[4], row), col_get(&f[5], row));
    case K_REMOVED:
        return on_removed(c, col_get(&f[0], row), col_get(&f[1], row), col_get(&f[2], row),
                          col_get(&f[3], row));
    case K_CHECKPOINT:
        if (check_group(c, col_get(&f[1], row), "checkpoint_recorded")) return -1;
        return on_checkpoint(c, col_get(&f[0], row), col_get(&f[1], row), col_get(&f[2], row),
                             col_get(&f[3], row));
    case K_SUPPRESSED: {
        if (check_group(c, col_get(&f[1], row), "checkpoint_suppressed")) return -1;
        r = find_request(c, col_get(&f[0], row));
        i64 at = floordiv(col_get(&f[2], row), c->unit);
        if (r && r->has_units && 0 < at && at <= r->units.n)
            return id_set_add(&c->suppressed, r->units.v[at - 1]);
        return 0;
    }
    case K_DROPPED:
        c->dropped_events += col_get(&f[0], row);
        return 0;
    case K_BLOCK_STATE: {
        Block *k = block_at(c, col_get(&f[0], row), "block_state");
        if (!k) return -1;
        k->s_in_use = col_get(&f[1], row) > 0;
        block_state_changed(c, k);
        return 0;
    }
    case K_KEY_CACHED: {
        Py_ssize_t start = s->element;
        s->element += (Py_ssize_t)col_get(&f[3], row);
        return on_key_cached(c, col_get(&f[0], row), col_get(&f[1], row), &f[3], &f[4], row,
                             start);
    }
    case K_REQUEST_STATE: {
        Py_ssize_t start = s->element;
        s->element += (Py_ssize_t)col_get(&f[2], row);
        req = col_get(&f[0], row);
        if (request_matches(c, PyList_GET_ITEM(f[6].list, row))) c->only_request = req;
        return on_request_state(c, req, col_get(&f[1], row), &f[2], &f[3], row, start,
                                col_get(&f[4], row), col_get(&f[5], row));
    }
    }
    return 0;
}

/* --- the record tables ------------------------------------------------------------------- */

/* A batch kind's columns, as this pass reads them: its attribution kind's (Source) and, for a
   kind whose rows it makes (spec->shape), every field's. */
typedef struct {
    const RecordSpec *spec;
    Source source;
    Col fields[MAX_FIELDS], values[MAX_FIELDS];  /* values: a list field's elements */
    Py_ssize_t shaped;  /* the rows its records began this batch (shape_start) */
} Kind;

/* A record's row begins: its seq and step, in file order. Its fields follow in bulk, once the
   batch was followed (shape_rows). */
static int shape_start(Core *c, Kind *k) {
    Table *table = &c->tables[k->spec->table];
    if (lvec_push(&table->columns[0], c->seq) || lvec_push(&table->columns[1], c->step))
        return -1;
    k->shaped++;
    return 0;
}

/* A column's first `count` values, appended to `out` as int64s. */
static int col_append(LVec *out, const Col *col, Py_ssize_t count) {
    if (lvec_reserve(out, out->n + count)) return -1;
    i64 *to = out->v + out->n;
    const char *from = col->view.buf;
    if (col->list) {
        for (Py_ssize_t i = 0; i < count; i++) {
            to[i] = PyLong_AsLongLong(PyList_GET_ITEM(col->list, i));
            if (to[i] == -1 && PyErr_Occurred()) return -1;  /* an item that is no int */
        }
    } else if (col->itemsize == 8) {
        memcpy(to, from, (size_t)count * sizeof(i64));
    } else {  /* one loop per width, each a plain widening copy */
#define WIDEN(type) for (Py_ssize_t i = 0; i < count; i++) to[i] = ((const type *)from)[i]
        switch (col->itemsize * 2 + col->is_unsigned) {
        case 2: WIDEN(int8_t); break;
        case 3: WIDEN(uint8_t); break;
        case 4: WIDEN(int16_t); break;
        case 5: WIDEN(uint16_t); break;
        case 8: WIDEN(int32_t); break;
        default: WIDEN(uint32_t); break;
        }
#undef WIDEN
    }
    out->n += count;
    return 0;
}

/* The fields of the rows a batch's records of one kind began (shape_start), column by column
   (a list field's length), and their list fields' rows (seq, the record's req or -1, position,
   element). */
static int shape_rows(Core *c, Kind *k) {
    const RecordSpec *spec = k->spec;
    Py_ssize_t count = k->shaped;
    if (!count) return 0;
    Table *table = &c->tables[spec->table];
    const i64 *seqs = table->columns[0].v + table->columns[0].n - count;
    int child = spec->table + 1;
    for (int f = 0; f < spec->num_fields; f++) {
        if (spec->field_kinds[f] == 's') {
            PyObject *objects = table->objects[2 + f];
            PyObject *taken = PyList_GetSlice(k->fields[f].list, 0, count);
            Py_ssize_t end = PyList_GET_SIZE(objects);
            int rc = !taken || PyList_SetSlice(objects, end, end, taken);
            Py_XDECREF(taken);
            if (rc) return -1;
            continue;
        }
        LVec *column = &table->columns[2 + f];
        if (col_append(column, &k->fields[f], count)) return -1;
        if (spec->field_kinds[f] != 'l') continue;
        Table *children = &c->tables[child++];
        const i64 *lengths = column->v + column->n - count;
        Py_ssize_t total = 0;
        for (Py_ssize_t row = 0; row < count; row++) total += (Py_ssize_t)lengths[row];
        for (int i = 0; i < 3; i++)
            if (lvec_reserve(&children->columns[i], children->columns[i].n + total)) return -1;
        i64 *seq = children->columns[0].v + children->columns[0].n;
        i64 *req = children->columns[1].v + children->columns[1].n;
        i64 *pos = children->columns[2].v + children->columns[2].n;
        for (Py_ssize_t row = 0, at = 0; row < count; row++) {
            i64 owner = spec->req_field >= 0 ? col_get(&k->fields[spec->req_field], row) : -1;
            for (i64 p = 0; p < lengths[row]; p++, at++) {
                seq[at] = seqs[row];
                req[at] = owner;
                pos[at] = p;
            }
        }
        for (int i = 0; i < 3; i++) children->columns[i].n += total;
        if (col_append(&children->columns[3], &k->values[f], total)) return -1;
    }
    return 0;
}

static int open_kind(Kind *k, const RecordSpec *spec, PyObject *columns, Py_ssize_t needed) {
    memset(k, 0, sizeof(*k));
    k->spec = spec;
    k->source.code = spec->kind;
    if (!PyList_Check(columns) || PyList_GET_SIZE(columns) < spec->num_fields)
        return fail("feed: a kind with %d fields", spec->num_fields);
    /* a list field's two columns, checked: every row's elements are there */
    for (int f = 0; f < spec->num_fields; f++) {
        PyObject *column = PyList_GET_ITEM(columns, f);
        if (spec->field_kinds[f] == 's' || spec->field_kinds[f] == 'o') {
            if (!PyList_Check(column) || PyList_GET_SIZE(column) < needed)
                return fail("feed: a short column");
            k->fields[f].list = column;
            continue;
        }
        if (spec->field_kinds[f] == 'l') {
            PyObject *lengths = PyObject_GetAttrString(column, "lengths");
            PyObject *values = lengths ? PyObject_GetAttrString(column, "values") : NULL;
            int rc = !values || col_open(&k->fields[f], lengths) || col_open(&k->values[f], values);
            Py_XDECREF(lengths);
            Py_XDECREF(values);
            if (rc) return -1;
            i64 total = 0;
            if (col_len(&k->fields[f]) < needed) return fail("feed: a short column");
            for (Py_ssize_t row = 0; row < needed; row++) {
                i64 length = col_get(&k->fields[f], row);
                if (length < 0) return fail("feed: a negative list length");
                total += length;
            }
            if (col_len(&k->values[f]) < total) return fail("feed: a short list column");
            continue;
        }
        if (col_open(&k->fields[f], column)) return -1;
        if (col_len(&k->fields[f]) < needed) return fail("feed: a short column");
    }
    /* the attribution kind's columns: the same, in its order */
    Source *s = &k->source;
    for (int a = 0; spec->kind >= 0 && a < spec->num_read; a++) {
        int f = spec->read[a];
        Col *field = &k->fields[f];
        s->cols[s->num_cols] = *field;
        s->cols[s->num_cols++].open = 0;  /* borrowed: closed once, as the field */
        if (spec->field_kinds[f] == 'l') {
            s->cols[s->num_cols] = k->values[f];
            s->cols[s->num_cols++].open = 0;
        }
    }
    return 0;
}

static void close_kind(Kind *k) {
    for (int f = 0; f < MAX_FIELDS; f++) {
        col_close(&k->fields[f]);
        col_close(&k->values[f]);
    }
}

static PyObject *refuse_broken(void) {
    PyErr_SetString(PyExc_RuntimeError, "forensics core: a batch failed; the pass is over");
    return NULL;
}

/* feed(kinds, first_seq, records, columns): follow one batch of records, in file order.
   records: per batch kind, its index in kvtrace.events.RECORD_TYPES (255: unknown); columns:
   per batch kind, its columns as the reader decoded them. */
static PyObject *Core_feed(Core *c, PyObject *args) {
    Py_buffer kinds, records;
    long long first_seq;
    PyObject *columns;
    if (c->broken) return refuse_broken();
    if (!PyArg_ParseTuple(args, "y*Ly*O!", &kinds, &first_seq, &records, &PyList_Type, &columns))
        return NULL;
    Py_ssize_t num_kinds = records.len;
    Kind *batch = PyMem_Calloc((size_t)num_kinds + 1, sizeof(Kind));
    Py_ssize_t *needed = PyMem_Calloc((size_t)num_kinds + 1, sizeof(Py_ssize_t));
    int rc = batch && needed ? 0 : (PyErr_NoMemory(), -1);
    const unsigned char *kind = kinds.buf, *record = records.buf;
    if (!rc && PyList_GET_SIZE(columns) != num_kinds)
        rc = fail("feed: %zd column lists for %zd kinds", PyList_GET_SIZE(columns), num_kinds);
    for (Py_ssize_t i = 0; i < kinds.len && !rc; i++) {
        if (kind[i] >= num_kinds) rc = fail("feed: a record of kind %d", kind[i]);
        else needed[kind[i]]++;
    }
    for (Py_ssize_t i = 0; i < num_kinds && !rc; i++) {
        batch[i].source.code = -1;
        if (record[i] < c->num_specs && (c->specs[record[i]].kind >= 0
                                         || c->specs[record[i]].shape))
            rc = open_kind(&batch[i], &c->specs[record[i]], PyList_GET_ITEM(columns, i),
                           needed[i]);
    }
    i64 seq = first_seq;
    for (Py_ssize_t i = 0; i < kinds.len && !rc; i++, seq++) {
        Kind *k = &batch[kind[i]];
        if (!k->spec) continue;
        c->seq = seq;
        Py_ssize_t row = k->source.row;
        if (k->spec->kind >= 0) {
            rc = c->attribute ? handle(c, &k->source) : 0;
            k->source.row = row + 1;
        } else {
            k->source.row = row + 1;
        }
        if (!rc && k->spec->kind == K_STEP && !c->attribute) c->step++;
        if (!rc && k->spec->shape && c->make_tables) rc = shape_start(c, k);
        if (!rc && PyErr_Occurred()) rc = -1;  /* a list column item that is no int */
    }
    for (Py_ssize_t i = 0; i < num_kinds && !rc; i++)
        if (batch[i].spec && batch[i].spec->shape) rc = shape_rows(c, &batch[i]);
    c->broken |= rc != 0;
    for (Py_ssize_t i = 0; batch && i < num_kinds; i++) close_kind(&batch[i]);
    PyMem_Free(batch);
    PyMem_Free(needed);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&records);
    if (rc) return NULL;
    spill_trim(&c->spill);
    Py_RETURN_NONE;
}

/* take_tables(chunk): [(table, columns as int64 bytes)], every whole chunk of `chunk` rows of
   every table (0: all of every table), taken out. Tables: the record tables, then the
   attribution's rows, then the cache entries' figures. */
static PyObject *Core_take_tables(Core *c, PyObject *arg) {
    if (c->broken) return refuse_broken();
    Py_ssize_t chunk = PyLong_AsSsize_t(arg);
    if (chunk == -1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    for (int t = 0; out && t < c->num_tables + 2; t++) {
        Table *table = table_at(c, t);
        while (out && table_rows(table) && table_rows(table) >= (chunk > 0 ? chunk : 1)) {
            PyObject *columns = table_take(table, chunk, t);
            PyObject *item = columns ? Py_BuildValue("(iN)", t, columns) : NULL;
            if (!item || PyList_Append(out, item)) Py_CLEAR(out);
            Py_XDECREF(item);
        }
    }
    return out;
}

/* finish(): the entries still open when the trace ends (never removed) become rows. */
static PyObject *Core_finish(Core *c, PyObject *unused) {
    for (Py_ssize_t index = 0; index < c->num_entries; index++) {
        Entry *e = &c->entries[index];
        if (e->open && entry_row(c, e, NONE_VALUE, NONE_VALUE, NONE_VALUE, NONE_VALUE))
            return NULL;
        e->open = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *Core_take_lookups(Core *c, PyObject *unused) {
    PyObject *lookups = c->lookups;
    c->lookups = PyList_New(0);
    if (!c->lookups) { c->lookups = lookups; return NULL; }
    return lookups;
}
static PyObject *Core_dropped_events(Core *c, void *closure) {
    return PyLong_FromLongLong(c->dropped_events);
}
static PyObject *Core_spill(Core *c, void *closure) {
    return Py_BuildValue("(Ln)", c->spill.end, c->spill.trims);
}

/* --- the type ----------------------------------------------------------------------------- */

static int int_tuple(PyObject *tuple, int *out, int *count) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > MAX_GROUPS) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of at most 64 ints");
        return -1;
    }
    *count = (int)PyTuple_GET_SIZE(tuple);
    for (int i = 0; i < *count; i++) {
        long value = PyLong_AsLong(PyTuple_GET_ITEM(tuple, i));
        if (value == -1 && PyErr_Occurred()) return -1;
        out[i] = (int)value;
    }
    return 0;
}

static int parse_specs(Core *c, PyObject *records) {
    if (!PyTuple_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "records must be a tuple");
        return -1;
    }
    c->num_specs = (int)PyTuple_GET_SIZE(records);
    c->specs = PyMem_Calloc((size_t)c->num_specs + 1, sizeof(RecordSpec));
    if (!c->specs) { PyErr_NoMemory(); return -1; }
    for (int r = 0; r < c->num_specs; r++) {
        RecordSpec *spec = &c->specs[r];
        PyObject *read;
        const char *field_kinds;
        Py_ssize_t num_fields;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(records, r), "iO!ps#i", &spec->kind,
                              &PyTuple_Type, &read, &spec->shape, &field_kinds, &num_fields,
                              &spec->req_field))
            return -1;
        if (num_fields > MAX_FIELDS || PyTuple_GET_SIZE(read) > 8
            || spec->kind >= NUM_KINDS || spec->req_field >= num_fields) {
            PyErr_SetString(PyExc_ValueError, "records: a kind this core cannot read");
            return -1;
        }
        spec->num_fields = (int)num_fields;
        memcpy(spec->field_kinds, field_kinds, (size_t)num_fields);
        if (spec->shape && memchr(field_kinds, 'o', (size_t)num_fields)) {
            PyErr_SetString(PyExc_ValueError, "records: rows of a kind with a field of objects");
            return -1;
        }
        if (int_tuple(read, spec->read, &spec->num_read)) return -1;
        for (int a = 0; a < spec->num_read; a++)
            if (spec->read[a] < 0 || spec->read[a] >= num_fields) {
                PyErr_SetString(PyExc_ValueError, "records: a field out of range");
                return -1;
            }
        spec->table = -1;
        if (spec->shape) {
            spec->table = c->num_tables;
            c->num_tables += 1;
            for (int f = 0; f < spec->num_fields; f++) c->num_tables += field_kinds[f] == 'l';
        }
    }
    c->tables = PyMem_Calloc((size_t)c->num_tables + 1, sizeof(Table));
    if (!c->tables) { PyErr_NoMemory(); return -1; }
    for (int r = 0; r < c->num_specs; r++) {
        RecordSpec *spec = &c->specs[r];
        if (!spec->shape) continue;
        Table *table = &c->tables[spec->table];
        if (table_init(table, 2 + spec->num_fields)) return -1;
        for (int f = 0; f < spec->num_fields; f++)
            if (spec->field_kinds[f] == 's' && !(table->objects[2 + f] = PyList_New(0))) return -1;
        int child = spec->table + 1;
        for (int f = 0; f < spec->num_fields; f++)
            if (spec->field_kinds[f] == 'l' && table_init(&c->tables[child++], 4)) return -1;
    }
    return 0;
}

/* Which columns of each table are stored in 32 bits: `narrow`, per table (as take_tables
   numbers them), a tuple of column indices. */
static int parse_narrow(Core *c, PyObject *narrow) {
    if (!PyTuple_Check(narrow) || PyTuple_GET_SIZE(narrow) != c->num_tables + 2) {
        PyErr_SetString(PyExc_TypeError, "narrow: a tuple of column indices per table");
        return -1;
    }
    for (int t = 0; t < c->num_tables + 2; t++) {
        Table *table = table_at(c, t);
        int columns[MAX_GROUPS], count;
        if (int_tuple(PyTuple_GET_ITEM(narrow, t), columns, &count)) return -1;
        for (int i = 0; i < count; i++) {
            if (columns[i] < 0 || columns[i] >= table->num_columns || table->objects[columns[i]]) {
                PyErr_SetString(PyExc_ValueError, "narrow: not an int column of its table");
                return -1;
            }
            table->narrow[columns[i]] = 1;
        }
    }
    return 0;
}

/* ForensicsCore(records, geometry, enums, request, request_id, explain, keep_lookups,
       make_rows, make_entries, make_tables, narrow)
   records: per kvtrace.events.RECORD_TYPES kind, (K_* code or -1, the fields the attribution
   reads, whether its rows go to tables, its field kinds, its req field or -1); geometry: None
   (no attribution: a trace without an engine config), or (hash unit, per group whether Mamba,
   attention groups, Mamba groups, attention block, Mamba block, hit alignment, the pool's
   blocks, EAGLE's drop and margin); enums:
   (CHECKPOINT kind, TRANSIENT class, LRU_REUSE, STALE_CHECKPOINT, REKEY, RUNNING queue);
   request: the one request to attribute (None: all); narrow: parse_narrow's. */
static int Core_init(Core *c, PyObject *args, PyObject *kwargs) {
    PyObject *records, *geometry, *enums, *request, *request_id, *narrow;
    int explain, keep_lookups, make_rows, make_entries, spill_fd;
    long long spill_resident;
    if (!PyArg_ParseTuple(args, "O!OO!OOpppppO(iL)", &PyTuple_Type, &records, &geometry,
                          &PyTuple_Type, &enums, &request, &request_id, &explain, &keep_lookups,
                          &make_rows, &make_entries, &c->make_tables, &narrow, &spill_fd,
                          &spill_resident)
        || spill_open(&c->spill, spill_fd, spill_resident) || parse_specs(c, records))
        return -1;
    for (int g = 0; g < MAX_GROUPS; g++) {
        id_index_init(&c->keys[g], &c->spill);
        id_index_init(&c->unknown_open[g], &c->spill);
    }
    chunk_init(&c->key_info, sizeof(Key), &c->spill);
    chunk_init(&c->removals, sizeof(Removal), &c->spill);
    chunk_init(&c->examples, sizeof(Examples), &c->spill);
    id_set_init(&c->computed, &c->spill);
    id_set_init(&c->states, &c->spill);
    id_set_init(&c->suppressed, &c->spill);
    id_index_init(&c->admissions, &c->spill);
    id_set_init(&c->in_flight, &c->spill);
    c->attribute = geometry != Py_None;
    c->unit = c->attention_block = c->mamba_block = c->alignment = 1;
    if (c->attribute) {
        PyObject *is_mamba, *attention, *mamba;
        long long unit, attention_block, mamba_block, alignment;
        long long num_gpu_blocks, eagle_drop, eagle_margin;
        if (!PyArg_ParseTuple(geometry, "LO!O!O!LLLLLL", &unit, &PyTuple_Type, &is_mamba,
                              &PyTuple_Type, &attention, &PyTuple_Type, &mamba, &attention_block,
                              &mamba_block, &alignment, &num_gpu_blocks, &eagle_drop,
                              &eagle_margin))
            return -1;
        if (eagle_drop < 0 || eagle_margin < 0) {
            PyErr_SetString(PyExc_ValueError, "EAGLE's drop and margin must not be negative");
            return -1;
        }
        if (num_gpu_blocks < 1 || num_gpu_blocks >= MAX_BLOCK_ID) {
            PyErr_SetString(PyExc_ValueError, "its pool must hold 1 to 2^31 - 1 blocks");
            return -1;
        }
        c->num_blocks = (Py_ssize_t)num_gpu_blocks + 1;  /* the unknown block -1 first */
        c->blocks = PyMem_Calloc((size_t)c->num_blocks, sizeof(Block));
        if (!c->blocks) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t b = 0; b < c->num_blocks; b++) {
            c->blocks[b].prev = c->blocks[b].next = -1;
            c->blocks[b].latest_entry = c->blocks[b].open_entries = -1;
        }
        if (unit <= 0 || attention_block <= 0 || mamba_block <= 0 || alignment <= 0) {
            PyErr_SetString(PyExc_ValueError, "block sizes must be positive");
            return -1;
        }
        c->unit = unit;
        c->attention_block = attention_block;
        c->mamba_block = mamba_block;
        c->alignment = alignment;
        c->eagle_drop = eagle_drop;
        c->eagle_margin = eagle_margin;
        if (int_tuple(is_mamba, c->is_mamba, &c->num_groups)
            || int_tuple(attention, c->attention_groups, &c->num_attention)
            || int_tuple(mamba, c->mamba_groups, &c->num_mamba))
            return -1;
    }
    i64 values[6];
    if (PyTuple_GET_SIZE(enums) != 6) {
        PyErr_SetString(PyExc_TypeError, "enums: six values");
        return -1;
    }
    for (int i = 0; i < 6; i++) {
        values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(enums, i));
        if (values[i] == -1 && PyErr_Occurred()) return -1;
    }
    c->checkpoint_kind = values[0];
    c->transient_class = values[1];
    c->lru_reuse = values[2];
    c->stale_checkpoint = values[3];
    c->rekey = values[4];
    c->running_queue = values[5];
    c->all_requests = request == Py_None && request_id == Py_None;
    c->only_request = NO_REQ;
    if (request != Py_None) {
        c->only_request = PyLong_AsLongLong(request);
        if (c->only_request == -1 && PyErr_Occurred()) return -1;
    }
    if (request_id != Py_None) {
        if (!PyUnicode_Check(request_id)) {
            PyErr_SetString(PyExc_TypeError, "request_id must be a str");
            return -1;
        }
        c->request_id = Py_NewRef(request_id);
    }
    c->explain = explain;
    c->keep_lookups = keep_lookups;
    c->make_rows = make_rows && c->attribute;
    c->make_entries = make_entries && c->attribute;
    c->allocating = NO_REQ;
    c->evictable_head = c->evictable_tail = -1;
    c->lookups = PyList_New(0);
    if (!c->lookups || table_init(&c->rows, NUM_A) || table_init(&c->entry_rows, NUM_E))
        return -1;
    return parse_narrow(c, narrow);
}

static void Core_dealloc(Core *c) {
    for (size_t i = 0; i < c->requests.cap; i++)
        if (map_used(&c->requests, i)) free_request((Request *)(intptr_t)c->requests.slots[i].val);
    map_clear(&c->requests);
    for (int g = 0; g < MAX_GROUPS; g++) id_index_clear(&c->keys[g]);
    id_set_clear(&c->computed);
    id_set_clear(&c->states);
    id_set_clear(&c->suppressed);
    id_index_clear(&c->admissions);
    id_set_clear(&c->in_flight);
    chunk_free(&c->key_info);
    chunk_free(&c->removals);
    chunk_free(&c->examples);
    PyMem_Free(c->blocks);
    PyMem_Free(c->entries);
    ivec_free(&c->free_entries);
    for (int g = 0; g < MAX_GROUPS; g++) id_index_clear(&c->unknown_open[g]);
    spill_close(&c->spill);
    table_free(&c->rows);
    table_free(&c->entry_rows);
    for (int t = 0; c->tables && t < c->num_tables; t++) table_free(&c->tables[t]);
    PyMem_Free(c->tables);
    PyMem_Free(c->specs);
    lvec_free(&c->attention_levels);
    lvec_free(&c->mamba_levels);
    Py_CLEAR(c->lookups);
    Py_CLEAR(c->request_id);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"feed", (PyCFunction)Core_feed, METH_VARARGS, "Follow one batch of records."},
    {"finish", (PyCFunction)Core_finish, METH_NOARGS, "The trace ended: close the open entries."},
    {"take_tables", (PyCFunction)Core_take_tables, METH_O,
     "[(table, columns)]: every whole chunk of rows of every table (0: all)."},
    {"take_lookups", (PyCFunction)Core_take_lookups, METH_NOARGS,
     "The attributed lookups so far, as tuples (keep_lookups)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"dropped_events", (getter)Core_dropped_events, NULL, "Records the capture dropped.", NULL},
    {"spill", (getter)Core_spill, NULL, "(bytes of the spill file, trims so far).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtrace._forensics_core.ForensicsCore",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The streaming pass of kvtrace load and why (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtrace._forensics_core",
    "The streaming pass of kvtrace load and why, in C (see csrc/forensics_core.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__forensics_core(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "ForensicsCore", (PyObject *)&CoreType) < 0
        || PyModule_AddIntConstant(m, "NUM_KINDS", NUM_KINDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
