/* What the units of kvtrace._model_core share; private to csrc/.
 *
 * The model core (see model_core.c) is one extension built from several units; each calls only
 * the ones below it:
 *
 * - model_core.c: the Python type ModelCore and configure(), the face backend.py uses.
 * - model_restore.c: the start from a capture's start snapshot (Core_restore).
 * - model_managers.c: the full-attention and Mamba "align" managers (managers.py), and the
 *   requests and the coordinator's hit search, allocation and caching over them (backend.py).
 * - model_pool.c: the block pool (pool.py).
 * - model_records.c: what the core reports (emit: records, counts or column batches), the
 *   Python objects they are made of (configure()) and the errors it raises.
 *
 * The helpers called per block are static inline here, as fast as when the core was one file.
 * Python's floor division is spelled out (floordiv) where an operand can be negative.
 */
#ifndef KVTRACE_MODEL_PARTS_H
#define KVTRACE_MODEL_PARTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#include "containers.h"

/* The units' functions are the extension's own: not exported, and called directly. */
#if defined(__GNUC__)
#pragma GCC visibility push(hidden)
#endif

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

extern const char *const configured_names[NUM_CONFIGURED];
extern PyObject *configured[NUM_CONFIGURED];
extern long configured_value[NUM_CONFIGURED];  /* the enum members' int values */

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
} ModelCore;

/* --- model_records.c: reports, errors and arguments ------------------------------------------- */
PyObject *i64_list(const i64 *values, Py_ssize_t n);
int tally_arrival(Tally *t, i64 req, i64 prompt_len);
int write_batch(ModelCore *c, Py_ssize_t count);
int emit(ModelCore *c, int type, const char *spec, ...);
int flush(ModelCore *c);
int set_error_v(int type, const char *hint, const char *format, va_list ap);
int block_ids_of(PyObject *ids, IVec *out);

/* --- model_pool.c: the pool (pool.py) --------------------------------------------------------- */
int map_block(ModelCore *c, i64 hash_id, int group, int32_t block);
int add_extra_key(ModelCore *c, int32_t block, i64 hash_id, int group);
int strip_keys(ModelCore *c, int32_t block, int reason, LVec *removed);
int move_keys(ModelCore *c, int32_t source, int32_t target, i64 req);
int get_new_blocks(ModelCore *c, i64 count, i64 req, IVec *out);
int touch(ModelCore *c, const int32_t *blocks, Py_ssize_t n, i64 req);
int free_blocks(ModelCore *c, const int32_t *blocks, Py_ssize_t n, int released);
int cache_full_blocks(ModelCore *c, Request *r, IVec *table, i64 num_cached, i64 num_full,
                      int block_size, int group, const char *mask);
int cache_partial_block(ModelCore *c, Request *r, int32_t block, i64 num_tokens, int group,
                        int replace, int kind, i64 *key);

/* --- model_managers.c: the managers and the coordinator (managers.py, backend.py) ------------- */
void release_group(ModelCore *c, Manager *m, Request *r, int *error);
Request *find_request(ModelCore *c, i64 req);
void drop_request(ModelCore *c, Request *r);
int set_depths(ModelCore *c, Request *r, i64 start, i64 stop);
int report_request(ModelCore *c, Request *r);
int append_tokens(ModelCore *c, Request *r, i64 count);
Request *new_request(ModelCore *c, i64 req, i64 prompt_len, i64 max_tokens,
                     PyObject *hash_ids);
int lookup(ModelCore *c, const SpecGroup *spec, i64 hash_id, int32_t *found);
int find_longest_cache_hit(ModelCore *c, Request *r, i64 max_length, i64 *hit_length,
                           i64 *uncached);
int cache_coordinator_blocks(ModelCore *c, Request *r, i64 num_tokens);
int allocate(ModelCore *c, Request *r, i64 num_new, i64 num_new_computed, int has_hits,
             i64 lookahead, int full_sequence_must_fit, i64 reserved);

/* --- model_restore.c: a start snapshot -------------------------------------------------------- */
PyObject *Core_restore(ModelCore *c, PyObject *args);

/* --- called per block: static inline, as fast as in one unit ---------------------------------- */

static inline i64 depth_get(ModelCore *c, i64 hash_id, i64 fallback) {
    i64 value;
    return map_get(&c->depth, hash_id, &value) ? value : fallback;
}

static inline int32_t holder_first(ModelCore *c, i64 holder) {
    return holder >= 0 ? (int32_t)holder : c->multi[-holder - 1].v[0];
}
static inline int32_t cached_block(ModelCore *c, i64 hash_id, int group) {
    i64 holder;
    if (!map_get(&c->cached[group], hash_id, &holder)) return -1;
    return holder_first(c, holder);
}
static inline int holds(ModelCore *c, i64 hash_id, int group, int32_t block) {
    i64 holder;
    if (!map_get(&c->cached[group], hash_id, &holder)) return 0;
    if (holder >= 0) return holder == block;
    IVec *list = &c->multi[-holder - 1];
    for (Py_ssize_t i = 0; i < list->n; i++)
        if (list->v[i] == block) return 1;
    return 0;
}

static inline i64 checkpoint_position(i64 num_tokens, i64 unit) {
    i64 position = floordiv(num_tokens - 1, unit) * unit;
    return position > 0 ? position : 0;
}

static inline int as_i64(PyObject *value, i64 *out) {
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#endif
