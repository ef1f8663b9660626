/* The private header of kvtrace._forensics_core (csrc/forensics_core.c says what it does): what
 * its three files share. forensics_core.c (the type, the batches, the tables) calls into
 * forensics_records.c (the cache followed record by record), which calls into
 * forensics_lookup.c (the attribution of one lookup); none calls back up.
 *
 * Every code below (a record kind, a field, a cause, an output column, an enum value) has its
 * name beside it: the core finds each by name in what kvtrace/analysis/stream.py hands it at
 * construction, so Python's order of anything is free to change.
 */

#ifndef KVTRACE_FORENSICS_H
#define KVTRACE_FORENSICS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "containers.h"

/* --- names: what the core reads and writes, found by name at construction --------------------- */

/* The record kinds the attribution reads: its code, its tag (kvtrace.events), and the fields
   follow_record() reads, in the order it takes them (a list field as two columns: lengths,
   values), NULL-terminated. */
#define FORENSICS_KINDS(X) \
    X(K_STEP, "step_started", NULL) \
    X(K_ARRIVED, "request_arrived", "req", "hash_ids", "request_id", NULL) \
    X(K_EXTENDED, "hashes_extended", "req", "hash_ids", NULL) \
    X(K_LOOKUP, "computed_blocks_found", "req", "num_hit_tokens", "shared_prefix_boundary", NULL) \
    X(K_ALLOCATED, "slots_allocated", "req", "num_new_tokens", "num_computed_tokens", \
      "num_new_computed_tokens", "num_external_computed_tokens", "num_tokens", "success", NULL) \
    X(K_FINISHED, "request_finished", "req", NULL) \
    X(K_PREEMPTED, "request_preempted", "req", NULL) \
    X(K_BLOCK_ALLOCATED, "block_allocated", "block_id", NULL) \
    X(K_TOUCHED, "block_touched", "block_id", NULL) \
    X(K_FREED, "block_freed", "block_id", "ref_cnt", NULL) \
    X(K_STORED, "block_stored", "block_id", "hash_id", "group", "num_tokens", "kind", "req", NULL) \
    X(K_REMOVED, "block_removed", "block_id", "hash_id", "group", "reason", NULL) \
    X(K_CHECKPOINT, "checkpoint_recorded", "req", "group", "position", "position_class", NULL) \
    X(K_SUPPRESSED, "checkpoint_suppressed", "req", "group", "position", NULL) \
    X(K_DROPPED, "events_dropped", "count", NULL) \
    X(K_BLOCK_STATE, "block_state", "block_id", "ref_cnt", NULL) \
    X(K_KEY_CACHED, "key_cached", "hash_id", "group", "num_tokens", "block_ids", NULL) \
    X(K_REQUEST_STATE, "request_state", "req", "queue", "hash_ids", "num_computed_tokens", \
      "num_preemptions", "request_id", NULL)

/* The causes (kvtrace/analysis/causes.py), each with whether it is in the shortfall. Their
   order here means nothing: a cause's level (its place in the waterfall) and its value in the
   rows come from the order Python hands them in (ForensicsCore.level,
   ForensicsCore.cause_value). */
#define FORENSICS_CAUSES(X) \
    X(C_HIT_CAP, "hit_cap", 1) X(C_EAGLE_DROPPED_UNIT, "eagle_dropped_unit", 1) \
    X(C_BLOCK_QUANTISATION, "block_quantisation", 1) \
    X(C_MAMBA_NOT_RESERVED, "mamba_not_reserved", 1) \
    X(C_MAMBA_NOT_RETAINED, "mamba_not_retained", 1) X(C_MAMBA_SUPPRESSED, "mamba_suppressed", 1) \
    X(C_REKEYED, "rekeyed", 1) X(C_INVALIDATED, "invalidated", 1) \
    X(C_CHECKPOINT_PUSHOUT, "checkpoint_pushout", 1) X(C_EVICTED, "evicted", 1) \
    X(C_MAMBA_EVICTED, "mamba_evicted", 1) X(C_OTHER, "other", 1) X(C_COLD, "cold", 0) \
    X(C_PARTIAL_UNIT, "partial_unit", 0) X(C_SHORT_PROMPT, "short_prompt", 0)

/* The miss_attribution columns (miss_table.ATTRIBUTION_COLUMNS). */
#define FORENSICS_ROW_COLUMNS(X) \
    X(A_REQ, "req") X(A_LOOKUP, "lookup") X(A_SEQ, "seq") X(A_STEP, "step") \
    X(A_QUERY, "query_tokens") X(A_IDEAL, "ideal_tokens") X(A_HIT, "hit_tokens") \
    X(A_ATTENTION_HIT, "attention_hit_tokens") X(A_MAMBA_HIT, "mamba_hit_tokens") \
    X(A_CAUSE, "cause") X(A_TOKENS, "tokens") X(A_FROM, "from_tokens") X(A_TO, "to_tokens") \
    X(A_KEY_GROUP, "key_group") X(A_KEY_DEPTH, "key_depth_tokens") \
    X(A_KEY_HASH, "key_hash_id") X(A_REMOVED_BLOCK, "removed_block_id") \
    X(A_REMOVED_SEQ, "removed_seq") X(A_REMOVED_STEP, "removed_step") \
    X(A_REMOVED_BY_REQ, "removed_by_req") X(A_TRANSIENT_BEHIND, "transient_behind") \
    X(A_IN_FLIGHT, "in_flight")

/* The cache_entry_figures columns (stream.ENTRY_COLUMNS): what an entry adds to its store. */
#define FORENSICS_ENTRY_COLUMNS(X) \
    X(E_STORED_SEQ, "stored_seq") X(E_BLOCK, "block_id") X(E_REMOVED_SEQ, "removed_seq") \
    X(E_REMOVED_STEP, "removed_step") X(E_REMOVED_REASON, "removed_reason_code") \
    X(E_POSITION_CLASS, "position_class_code") X(E_HITS, "hits") \
    X(E_LAST_HIT_SEQ, "last_hit_seq") X(E_LAST_HIT_STEP, "last_hit_step") \
    X(E_TRANSIENT_CACHED, "transient_cached")

#define FORENSICS_CODE(code, ...) code,
enum { FORENSICS_KINDS(FORENSICS_CODE) NUM_KINDS };
enum { FORENSICS_CAUSES(FORENSICS_CODE) NUM_CAUSES };
enum { FORENSICS_ROW_COLUMNS(FORENSICS_CODE) NUM_A };
enum { FORENSICS_ENTRY_COLUMNS(FORENSICS_CODE) NUM_E };

#define NO_REQ (-1)
#define PUSHOUT_EXAMPLES 3
#define NONE_VALUE INT64_MIN  /* a NULL in the output columns */
#define MAX_GROUPS 64
#define MAX_BLOCK_ID ((i64)1 << 31)
#define MAX_FIELDS 24
#define MAX_READ 8  /* columns follow_record() reads of one kind */

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

int col_open(Col *c, PyObject *obj);
void col_close(Col *c);
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

/* --- the state --------------------------------------------------------------------------------- */

typedef struct {  /* the removal that took a key's last copy (lookups.Removal) */
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

typedef struct {  /* a record kind (kvtrace.events.RECORD_TYPES), as this pass reads it */
    int kind;  /* its K_* code, -1: the attribution reads none of it */
    int num_read, read[MAX_READ];  /* the fields follow_record() reads (FORENSICS_KINDS) */
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
    /* the causes as Python handed them: per C_* code, its level (its place in the waterfall,
       for a shortfall cause) and its value in the rows; per level, its cause */
    int level[NUM_CAUSES], cause_value[NUM_CAUSES], cause_at[NUM_CAUSES];
    int present;  /* the level of a key the cache held: past the waterfall */
    int row_column[NUM_A], entry_column[NUM_E];  /* each output column's place in its table */
    /* geometry (hit_search.Geometry) */
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
} ForensicsCore;

/* One batch kind's columns that follow_record() reads (RecordSpec.read), a list field's two. */
typedef struct { Col cols[MAX_READ * 2]; int code, num_cols; Py_ssize_t row, element; } Source;

/* --- shared helpers ---------------------------------------------------------------------------- */

/* A block's slot: its id + 1, slot 0 for the unknown block -1 (a source that names none, like
   vLLM's own KV events). */
static inline int32_t slot_of(i64 block_id) { return (int32_t)(block_id + 1); }

static inline Key *key_of(ForensicsCore *c, i64 hash_id, int group, int create) {
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

/* forensics_records.c */
int fail(const char *format, ...);
void free_request(Request *r);
int entry_row(ForensicsCore *c, Entry *e, i64 removed_seq, i64 removed_step, i64 reason,
              i64 transient_cached);
int follow_record(ForensicsCore *c, Source *s);

/* forensics_lookup.c */
int attribute_lookup(ForensicsCore *c, Request *r, i64 req, i64 admission, i64 num_tokens);
extern const char *const lookup_fields[], *const segment_fields[], *const key_fields[],
    *const removal_fields[];  /* NULL-terminated */

#endif
