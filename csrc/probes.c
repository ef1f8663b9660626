/* The probes' fast paths: FastWrapper (ProbeState and intern_hashes: probe_state.c).
 *
 * FastWrapper: the probes' ten hottest wrappers (kvtrace/probes/wrappers.py).
 * The probes wrap ~10 vLLM cache methods per engine step; as Python functions each wrapper
 * costs a frame, its own argument binding and several attribute lookups. Here
 * KVCacheManager.new_step_starts / allocate_slots, BlockPool._insert_block_hash /
 * _remove_cached_block_hashes / get_new_blocks / touch / free_blocks and
 * MambaManager.get_num_blocks_to_allocate / allocate_new_blocks / cache_blocks handle their
 * common case: forward the caller's arguments untouched to the original and build the records
 * the Python wrapper would. Every other case (a new request, a checkpoint publication, a
 * replay probe set that flushes per call, anything unexpected before the original runs) goes,
 * arguments untouched, to the Python wrapper, which does the whole call.
 *
 * Rules kept from the Python side: nothing of ours raises into vLLM (our failures are cleared and
 * counted in num_failures), and the original's result or exception is returned or raised
 * unchanged. The engine's own stop is not ours: an error that is not an Exception (SystemExit
 * from vLLM's SIGTERM handler, KeyboardInterrupt, GeneratorExit), raised while a probe ran
 * Python code, is kept (clear_unless_stop), no more of our Python code runs, and the call
 * returns NULL with it, as the Python wrappers' `except Exception` let it through.
 */
#include "probe_state.h"

#include <string.h>
#include <time.h>

/* --- the fast paths' constants, set by configure() -------------------------------------------- */

static PyObject *NoReq, *StaleCheckpoint, *LruReuse, *One;
static PyObject *s_checkpoints, *s_pending_offloads, *s_request_id, *s_block_hashes,
    *s_num_computed_tokens, *s_num_in_flight_tokens, *s_all_token_ids, *s_block_hash, *s_block_id,
    *s_report_checkpoint, *s_report_offloads, *s_is_null, *s_ref_cnt;

static int
intern_names(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(s_checkpoints, "_checkpoints")
    NAME(s_pending_offloads, "_pending_boundary_state_offloads")
    NAME(s_request_id, "request_id")
    NAME(s_block_hashes, "block_hashes")
    NAME(s_num_computed_tokens, "num_computed_tokens")
    NAME(s_num_in_flight_tokens, "num_in_flight_tokens")
    /* The attributes behind two vLLM 0.33 properties, read directly (the same value, without a
     * Python call): Request.num_tokens is len(_all_token_ids), KVCacheBlock.block_hash is
     * _block_hash. */
    NAME(s_all_token_ids, "_all_token_ids")
    NAME(s_block_hash, "_block_hash")
    NAME(s_block_id, "block_id")
    NAME(s_report_checkpoint, "_report_checkpoint")
    NAME(s_report_offloads, "_report_offloads")
    NAME(s_is_null, "is_null")
    NAME(s_ref_cnt, "ref_cnt")
#undef NAME
    if ((One = PyLong_FromLong(1)) == NULL) {
        return -1;
    }
    return 0;
}

/* --- FastWrapper ------------------------------------------------------------------------------ */

enum Kind {
    NEW_STEP_STARTS, ALLOCATE_SLOTS, INSERT_BLOCK_HASH, REMOVE_CACHED_BLOCK_HASHES,
    GET_NUM_BLOCKS_TO_ALLOCATE, ALLOCATE_NEW_BLOCKS, CACHE_BLOCKS, GET_NEW_BLOCKS, TOUCH,
    FREE_BLOCKS, NUM_KINDS,
};

/* Which probe set observes a pool or a manager: looked up once per object and cached in the
 * wrapper (a few entries: one manager per KV cache group), until any probe set is armed or
 * disarmed (probes_changed() bumps the generation). Entries hold their objects, so an address
 * is never mistaken for a freed object's. */
#define PROBE_CACHE_SIZE 4

typedef struct {
    PyObject *owner;
    ProbeState *probe;
    PyObject *checkpoints; /* a MambaManager's _checkpoints (vLLM sets it once, in __init__) */
} ProbeCacheEntry;

static unsigned long long probes_generation = 1;

typedef struct {
    PyObject_HEAD
    ProbeCacheEntry cache[PROBE_CACHE_SIZE];
    unsigned long long cache_generation;
    int next_entry;
    int kind;
    PyObject *original;  /* vLLM's function */
    PyObject *slow;      /* the Python wrapper: does the whole call when the fast path cannot */
    PyObject *names;     /* the parameter names, self first */
    PyObject *defaults;  /* the original's __defaults__ (a tuple, maybe empty) */
    PyObject *dict;
    vectorcallfunc vectorcall;
} FastWrapper;

static void
clear_probe_cache(FastWrapper *w)
{
    for (int i = 0; i < PROBE_CACHE_SIZE; i++) {
        Py_CLEAR(w->cache[i].owner);
        Py_CLEAR(w->cache[i].probe);
        Py_CLEAR(w->cache[i].checkpoints);
    }
}

/* The probe set observing `owner` (a BlockPool, or a manager with a block_pool), or NULL; new
 * reference. */
static ProbeState *
cached_probe(FastWrapper *w, PyObject *owner, int is_manager)
{
    if (w->cache_generation != probes_generation) {
        clear_probe_cache(w);
        w->cache_generation = probes_generation;
    }
    for (int i = 0; i < PROBE_CACHE_SIZE; i++) {
        if (w->cache[i].owner == owner) {
            Py_INCREF(w->cache[i].probe);
            return w->cache[i].probe;
        }
    }
    ProbeState *probe = is_manager ? probe_of_manager(owner) : probe_of_pool(owner);
    if (probe != NULL) {
        ProbeCacheEntry *entry = &w->cache[w->next_entry];
        w->next_entry = (w->next_entry + 1) % PROBE_CACHE_SIZE;
        Py_XSETREF(entry->owner, Py_NewRef(owner));
        Py_XSETREF(entry->probe, (ProbeState *)Py_NewRef(probe));
        Py_CLEAR(entry->checkpoints);
    }
    return probe;
}

static PyObject *checkpoints_of(PyObject *manager);

/* checkpoints_of(manager), cached with the manager's probe set; new reference. */
static PyObject *
cached_checkpoints(FastWrapper *w, PyObject *manager)
{
    for (int i = 0; i < PROBE_CACHE_SIZE; i++) {
        ProbeCacheEntry *entry = &w->cache[i];
        if (entry->owner == manager) {
            if (entry->checkpoints == NULL
                && (entry->checkpoints = checkpoints_of(manager)) == NULL) {
                return NULL;
            }
            return Py_NewRef(entry->checkpoints);
        }
    }
    return checkpoints_of(manager);
}

/* Parameter `index` of a call (0 is self): positional, keyword or default; borrowed, or NULL
 * when absent. */
static PyObject *
arg_at(FastWrapper *w, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
       Py_ssize_t index)
{
    if (index < nargs) {
        return args[index];
    }
    if (index >= PyTuple_GET_SIZE(w->names)) {
        return NULL;
    }
    PyObject *name = PyTuple_GET_ITEM(w->names, index);
    if (kwnames != NULL) {
        Py_ssize_t num_kw = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < num_kw; i++) {
            if (PyTuple_GET_ITEM(kwnames, i) == name) {
                return args[nargs + i];
            }
        }
        for (Py_ssize_t i = 0; i < num_kw; i++) {
            if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), name) == 0) {
                return args[nargs + i];
            }
        }
    }
    Py_ssize_t first_default = PyTuple_GET_SIZE(w->names) - PyTuple_GET_SIZE(w->defaults);
    if (index >= first_default) {
        return PyTuple_GET_ITEM(w->defaults, index - first_default);
    }
    return NULL;
}

#define CALL_ORIGINAL() PyObject_Vectorcall(w->original, args, nargsf, kwnames)
/* The Python wrapper does the whole call, unless a stop is pending (any other error of ours was
 * cleared): then the stop goes to vLLM instead. */
#define CALL_SLOW() \
    (PyErr_Occurred() ? NULL : PyObject_Vectorcall(w->slow, args, nargsf, kwnames))

/* KVCacheManager.new_step_starts(self) */
static PyObject *
new_step_starts(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        return CALL_SLOW();
    }
    ProbeState *probe = cached_probe(w, args[0], 1);
    if (probe == NULL) {
        return CALL_SLOW();
    }
    if (probe->announced_step != Py_None || probe->step == NULL || probe->records == NULL
        || !PyList_Check(probe->records)) {
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    if (PyList_GET_SIZE(probe->records)) {
        flush(probe); /* the last step's, when held for sink_many */
        if (PyErr_Occurred()) { /* a stop, before the step */
            Py_DECREF(probe);
            return NULL;
        }
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    PyObject *step = PyNumber_Add(probe->step, One);
    PyObject *ts_ns = PyLong_FromLongLong((long long)now.tv_sec * 1000000000LL + now.tv_nsec
                                          - probe->created_ns);
    if (step == NULL || ts_ns == NULL) {
        count_failure(probe);
    } else {
        Py_INCREF(step);
        set_field(&probe->step, step);
        append_record(probe, NEW_RECORD(StepStarted, .step = step, .ts_ns = ts_ns));
    }
    Py_XDECREF(step);
    Py_XDECREF(ts_ns);
    PyObject *result = CALL_ORIGINAL();
    if (result != NULL) {
        flush_unless_held(probe);
    }
    Py_DECREF(probe);
    return result;
}

/* request.num_tokens; new reference. */
static PyObject *
num_tokens_of(PyObject *request)
{
    PyObject *token_ids = PyObject_GetAttr(request, s_all_token_ids);
    Py_ssize_t num_tokens = token_ids == NULL ? -1 : PyObject_Size(token_ids);
    Py_XDECREF(token_ids);
    return num_tokens < 0 ? NULL : PyLong_FromSsize_t(num_tokens);
}

/* KVCacheManager.allocate_slots(self, request, num_new_tokens, num_new_computed_tokens,
 *   new_computed_blocks, num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
 *   num_encoder_tokens, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
 *   skip_zeroing_group_ids): fast for a known request with no newly completed hash unit. */
static PyObject *
allocate_slots(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    enum { REQUEST = 1, NUM_NEW_TOKENS, NUM_NEW_COMPUTED_TOKENS, NUM_LOOKAHEAD_TOKENS = 5,
           NUM_EXTERNAL_COMPUTED_TOKENS, FULL_SEQUENCE_MUST_FIT = 9, RESERVED_BLOCKS,
           HAS_SCHEDULED_REQS };
    static const Py_ssize_t recorded_args[] = {
        NUM_NEW_TOKENS, NUM_NEW_COMPUTED_TOKENS, NUM_LOOKAHEAD_TOKENS,
        NUM_EXTERNAL_COMPUTED_TOKENS, FULL_SEQUENCE_MUST_FIT, RESERVED_BLOCKS, HAS_SCHEDULED_REQS};
    PyObject *values[7];
    PyObject *request = nargs >= 2 ? args[REQUEST] : arg_at(w, args, nargs, kwnames, REQUEST);
    if (nargs < 1 || request == NULL) {
        return CALL_SLOW();
    }
    for (int i = 0; i < 7; i++) {
        if ((values[i] = arg_at(w, args, nargs, kwnames, recorded_args[i])) == NULL) {
            return CALL_SLOW();
        }
    }
    ProbeState *probe = cached_probe(w, args[0], 1);
    if (probe == NULL) {
        return CALL_SLOW();
    }
    /* The fast path of _enter: a known request with no newly completed hash unit. */
    PyObject *request_id = NULL, *hashes = NULL, *num_computed = NULL, *num_tokens = NULL;
    PyObject *num_in_flight = NULL, *known = NULL;
    Py_ssize_t num_hashes = -1;
    if (probe->reqs == NULL || !PyDict_CheckExact(probe->reqs) || probe->records == NULL
        || !PyList_Check(probe->records) || probe->held == NULL) {
        goto slow;
    }
    /* The request's attributes first: `known` is borrowed, so no code may run between its
     * lookup and taking `req` from it. */
    if ((request_id = PyObject_GetAttr(request, s_request_id)) == NULL
        || (hashes = PyObject_GetAttr(request, s_block_hashes)) == NULL
        || (num_hashes = PyObject_Size(hashes)) < 0
        || (num_computed = PyObject_GetAttr(request, s_num_computed_tokens)) == NULL
        || (num_tokens = num_tokens_of(request)) == NULL
        || (num_in_flight = PyObject_GetAttr(request, s_num_in_flight_tokens)) == NULL
        || (known = PyDict_GetItemWithError(probe->reqs, request_id)) == NULL
        || !PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) != 2
        || num_hashes > PyLong_AsSsize_t(PyTuple_GET_ITEM(known, 1))
        || PyErr_Occurred()) {
        goto slow;
    }
    PyObject *req = PyTuple_GET_ITEM(known, 0);
    Py_INCREF(req);
    Py_XDECREF(request_id);
    Py_XDECREF(hashes);
    PyObject *held = probe->held;
    Py_INCREF(held);
    Py_INCREF(Py_True);
    set_field(&probe->held, Py_True);
    Py_INCREF(req);
    set_field(&probe->req, req);
    Py_INCREF(request);
    set_field(&probe->request, request);
    PyObject *records = probe->records;
    Py_INCREF(records);
    Py_ssize_t first_effect = PyList_GET_SIZE(records);

    PyObject *result = CALL_ORIGINAL();

    /* As the Python wrapper's finally: the input record goes in front of the call's effects. */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    PyObject *allocated = (result != NULL && result != Py_None) ? Py_True : Py_False;
    PyObject *record = NEW_RECORD(
        SlotsAllocated, .req = req, .num_new_tokens = values[0],
        .num_computed_tokens = num_computed, .num_new_computed_tokens = values[1],
        .num_lookahead_tokens = values[2], .num_external_computed_tokens = values[3],
        .num_tokens = num_tokens, .success = allocated, .full_sequence_must_fit = values[4],
        .reserved_blocks = values[5], .has_scheduled_reqs = values[6],
        .num_in_flight_tokens = num_in_flight);
    if (record == NULL || PyList_Insert(records, first_effect, record) < 0) {
        count_failure(probe);
    }
    Py_XDECREF(record);
    Py_INCREF(NoReq);
    set_field(&probe->req, NoReq);
    Py_INCREF(Py_None);
    set_field(&probe->request, Py_None);
    int was_held = held == Py_True;
    set_field(&probe->held, held);
    if (!was_held) {
        flush(probe);
    }
    if (PyErr_Occurred()) { /* a stop in our code wins over the original's outcome */
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
        Py_CLEAR(result);
    } else {
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    Py_DECREF(records);
    Py_DECREF(req);
    Py_DECREF(num_computed);
    Py_DECREF(num_tokens);
    Py_DECREF(num_in_flight);
    Py_DECREF(probe);
    return result;

slow:
    clear_unless_stop();
    Py_XDECREF(request_id);
    Py_XDECREF(hashes);
    Py_XDECREF(num_computed);
    Py_XDECREF(num_tokens);
    Py_XDECREF(num_in_flight);
    Py_DECREF(probe);
    return CALL_SLOW();
}

/* Conditions for the BlockPool fast paths: records held (the Python wrapper flushes otherwise),
 * and hash ids interned in a dict we can use. */
static int
pool_fast_path_ok(ProbeState *probe)
{
    return probe->held == Py_True && probe->records != NULL && probe->hash_ids != NULL
           && PyDict_CheckExact(probe->hash_ids) && probe->depth != NULL
           && PyDict_CheckExact(probe->depth) && probe->req != NULL
           && probe->store_kind != NULL && probe->remove_reason != NULL
           && probe->emit_hash_bytes != NULL;
}

/* The probe set for a BlockPool fast path (new reference), or NULL when the call went, with
 * its result in *result, to the Python wrapper: nothing of ours observes the pool (the wrapper
 * calls the original), or `usable` is false (the caller's own arguments did not fit the fast
 * path). */
static ProbeState *
fast_pool_probe(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames,
                int usable, PyObject **result)
{
    ProbeState *probe = PyVectorcall_NARGS(nargsf) < 1 ? NULL : cached_probe(w, args[0], 0);
    if (probe != NULL && usable && pool_fast_path_ok(probe)) {
        return probe;
    }
    *result = CALL_SLOW();
    Py_XDECREF(probe);
    return NULL;
}

/* BlockPool._insert_block_hash(self, block_hash_with_group_id, block, num_tokens): fast when the
 * block has no hash yet (so the key is new on it). */
static PyObject *
insert_block_hash(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *key = arg_at(w, args, nargs, kwnames, 1);
    PyObject *block = arg_at(w, args, nargs, kwnames, 2);
    PyObject *num_tokens = arg_at(w, args, nargs, kwnames, 3);
    PyObject *result;
    ProbeState *probe = fast_pool_probe(w, args, nargsf, kwnames,
                                        key != NULL && block != NULL && num_tokens != NULL,
                                        &result);
    if (probe == NULL) {
        return result;
    }
    PyObject *block_hash = PyObject_GetAttr(block, s_block_hash);
    Py_XDECREF(block_hash);
    if (block_hash != Py_None) { /* it has one (or it could not be read): the Python wrapper */
        clear_unless_stop();
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    result = CALL_ORIGINAL();
    if (result == NULL) {
        Py_DECREF(probe);
        return NULL;
    }
    PyObject *block_id = NULL, *hash_id = NULL, *group = NULL, *fallback = NULL;
    if ((block_hash = PyObject_GetAttr(block, s_block_hash)) == NULL) {
        count_failure(probe);
        goto done;
    }
    Py_DECREF(block_hash);
    if (block_hash == Py_None) { /* the key already named the block: nothing new */
        goto done;
    }
    unsigned long group_number;
    int num_tokens_true = num_tokens == Py_None ? 0 : PyObject_IsTrue(num_tokens);
    if ((block_id = PyObject_GetAttr(block, s_block_id)) == NULL || num_tokens_true < 0
        || (hash_id = intern_key(probe, key, &group_number)) == NULL
        || (group = PyLong_FromUnsignedLong(group_number)) == NULL
        || (fallback = num_tokens_true ? Py_NewRef(num_tokens) : PyLong_FromLong(0)) == NULL) {
        count_failure(probe);
        goto done;
    }
    PyObject *depth = depth_of(probe, hash_id, fallback);
    if (depth == NULL) {
        count_failure(probe);
        goto done;
    }
    append_record(probe, NEW_RECORD(BlockStored, .block_id = block_id, .hash_id = hash_id,
                                    .group = group, .num_tokens = depth,
                                    .kind = probe->store_kind, .req = probe->req));
done:
    Py_XDECREF(block_id);
    Py_XDECREF(hash_id);
    Py_XDECREF(group);
    Py_XDECREF(fallback);
    Py_DECREF(probe);
    return result;
}

/* BlockPool._remove_cached_block_hashes(self, block): fast unless a checkpoint publication is
 * stripping keys (the Python wrapper counts those). */
static PyObject *
remove_cached_block_hashes(FastWrapper *w, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    PyObject *block = arg_at(w, args, PyVectorcall_NARGS(nargsf), kwnames, 1);
    PyObject *removed;
    ProbeState *probe = fast_pool_probe(w, args, nargsf, kwnames, block != NULL, &removed);
    if (probe == NULL) {
        return removed;
    }
    if (probe->remove_reason == StaleCheckpoint) {
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    removed = CALL_ORIGINAL();
    int any_removed = removed == NULL ? 0 : PyObject_IsTrue(removed);
    if (any_removed <= 0) { /* mostly not: get_new_blocks asks this of every block it hands out */
        if (any_removed < 0) {
            count_failure(probe);
        }
        Py_DECREF(probe);
        return removed;
    }
    PyObject *block_id = PyObject_GetAttr(block, s_block_id);
    PyObject *keys = block_id == NULL ? NULL : PyObject_GetIter(removed);
    PyObject *zero = PyLong_FromLong(0);
    PyObject *key;
    if (keys == NULL || zero == NULL) {
        count_failure(probe);
    }
    while (keys != NULL && zero != NULL && (key = PyIter_Next(keys)) != NULL) {
        unsigned long group_number;
        PyObject *hash_id = intern_key(probe, key, &group_number);
        PyObject *group = hash_id == NULL ? NULL : PyLong_FromUnsignedLong(group_number);
        PyObject *depth = group == NULL ? NULL : depth_of(probe, hash_id, zero);
        Py_DECREF(key);
        if (depth == NULL) {
            Py_XDECREF(hash_id);
            Py_XDECREF(group);
            break;
        }
        int appended = append_record(
            probe, NEW_RECORD(BlockRemoved, .block_id = block_id, .hash_id = hash_id,
                              .group = group, .num_tokens = depth,
                              .reason = probe->remove_reason));
        Py_DECREF(hash_id);
        Py_DECREF(group);
        if (appended < 0) {
            break;
        }
    }
    if (PyErr_Occurred()) {
        count_failure(probe);
    }
    Py_XDECREF(keys);
    Py_XDECREF(zero);
    Py_XDECREF(block_id);
    Py_DECREF(probe);
    return removed;
}

/* _checkpoints of a MambaManager (None outside "align" mode); new reference, NULL on error. */
static PyObject *
checkpoints_of(PyObject *manager)
{
    PyObject *checkpoints;
    if (LOOKUP_ATTR(manager, s_checkpoints, &checkpoints) < 0) {
        return NULL;
    }
    return checkpoints != NULL ? checkpoints : Py_NewRef(Py_None);
}

/* len(manager._pending_boundary_state_offloads), or -1 with an error. */
static Py_ssize_t
num_pending_offloads(PyObject *manager)
{
    PyObject *pending = PyObject_GetAttr(manager, s_pending_offloads);
    if (pending == NULL) {
        return -1;
    }
    Py_ssize_t size = PyObject_Size(pending);
    Py_DECREF(pending);
    return size;
}

/* After the original: report offloads it queued (rare; the Python method does it). */
static void
report_new_offloads(ProbeState *probe, PyObject *manager, Py_ssize_t num_before)
{
    Py_ssize_t num_after = num_pending_offloads(manager);
    if (num_after < 0) {
        count_failure(probe);
        return;
    }
    if (num_after > num_before) {
        PyObject *before = PyLong_FromSsize_t(num_before);
        PyObject *reported = before == NULL ? NULL : PyObject_CallMethodObjArgs(
            (PyObject *)probe, s_report_offloads, manager, before, NULL);
        if (reported == NULL) {
            count_failure(probe);
        }
        Py_XDECREF(reported);
        Py_XDECREF(before);
    }
}

/* MambaManager.get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
 *   total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
 *   apply_admission_cap, prefill_end): reports a checkpoint it records. */
static PyObject *
get_num_blocks_to_allocate(FastWrapper *w, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *request_id = arg_at(w, args, nargs, kwnames, 1);
    PyObject *num_tokens_main_model = arg_at(w, args, nargs, kwnames, 6);
    PyObject *apply_admission_cap = arg_at(w, args, nargs, kwnames, 7);
    if (nargs < 1 || request_id == NULL || num_tokens_main_model == NULL
        || apply_admission_cap == NULL) {
        return CALL_SLOW();
    }
    ProbeState *probe = cached_probe(w, args[0], 1);
    if (probe == NULL) {
        return CALL_SLOW();
    }
    PyObject *checkpoints = cached_checkpoints(w, args[0]);
    int cap = PyObject_IsTrue(apply_admission_cap);
    if (checkpoints == NULL || cap < 0) {
        clear_unless_stop();
        Py_XDECREF(checkpoints);
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    if (checkpoints == Py_None || cap) {
        Py_DECREF(checkpoints);
        Py_DECREF(probe);
        return CALL_ORIGINAL();
    }
    PyObject *before = PyDict_CheckExact(checkpoints)
                           ? PyDict_GetItemWithError(checkpoints, request_id) : NULL;
    if (!PyDict_CheckExact(checkpoints) || PyErr_Occurred()) {
        clear_unless_stop();
        Py_DECREF(checkpoints);
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    Py_XINCREF(before);
    PyObject *result = CALL_ORIGINAL();
    if (result != NULL) {
        PyObject *after = PyDict_GetItemWithError(checkpoints, request_id);
        if (after == NULL && PyErr_Occurred()) {
            count_failure(probe);
        } else if (after != NULL && after != Py_None && after != before) {
            PyObject *reported = PyObject_CallMethodObjArgs(
                (PyObject *)probe, s_report_checkpoint, args[0], after, num_tokens_main_model,
                NULL);
            if (reported == NULL) {
                count_failure(probe);
            }
            Py_XDECREF(reported);
            flush_unless_held(probe);
        }
    }
    Py_XDECREF(before);
    Py_DECREF(checkpoints);
    Py_DECREF(probe);
    return result;
}

/* MambaManager.allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model) */
static PyObject *
allocate_new_blocks(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        return CALL_SLOW();
    }
    ProbeState *probe = cached_probe(w, args[0], 1);
    if (probe == NULL) {
        return CALL_SLOW();
    }
    Py_ssize_t num_offloads = num_pending_offloads(args[0]);
    if (num_offloads < 0) {
        clear_unless_stop();
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    PyObject *blocks = CALL_ORIGINAL();
    if (blocks != NULL) {
        report_new_offloads(probe, args[0], num_offloads);
    }
    Py_DECREF(probe);
    return blocks;
}

/* MambaManager.cache_blocks(self, request, num_tokens, retention_interval, *,
 *   replay_boundaries): fast when the request has no checkpoint to publish. */
static PyObject *
cache_blocks(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *request = arg_at(w, args, nargs, kwnames, 1);
    if (nargs < 1 || request == NULL) {
        return CALL_SLOW();
    }
    ProbeState *probe = cached_probe(w, args[0], 1);
    if (probe == NULL) {
        return CALL_SLOW();
    }
    PyObject *checkpoints = cached_checkpoints(w, args[0]);
    PyObject *request_id = NULL;
    Py_ssize_t num_offloads = -1;
    if (checkpoints == NULL) {
        goto slow;
    }
    if (checkpoints != Py_None) {
        if (!PyDict_CheckExact(checkpoints)
            || (request_id = PyObject_GetAttr(request, s_request_id)) == NULL) {
            goto slow;
        }
        PyObject *checkpoint = PyDict_GetItemWithError(checkpoints, request_id);
        if (PyErr_Occurred() || (checkpoint != NULL && checkpoint != Py_None)) {
            goto slow; /* a slot to publish or strip: the Python wrapper sets the context */
        }
    }
    if ((num_offloads = num_pending_offloads(args[0])) < 0) {
        goto slow;
    }
    Py_DECREF(checkpoints);
    Py_XDECREF(request_id);
    PyObject *result = CALL_ORIGINAL();
    if (result != NULL) {
        report_new_offloads(probe, args[0], num_offloads);
        flush_unless_held(probe);
    }
    Py_DECREF(probe);
    return result;
slow:
    clear_unless_stop();
    Py_XDECREF(checkpoints);
    Py_XDECREF(request_id);
    Py_DECREF(probe);
    return CALL_SLOW();
}

/* Per-block records of a BlockPool call, added all or none (as the Python wrappers' list
 * comprehensions): BlockAllocated(block_id, req) for every block; BlockTouched(block_id, req)
 * and BlockFreed(block_id, ref_cnt, block_hash is not None) for blocks that are not null. */
enum BlockRecord { ALLOCATED, TOUCHED, FREED };

static void
add_block_records(ProbeState *probe, PyObject *blocks, enum BlockRecord kind)
{
    PyObject *records = PyList_New(0);
    PyObject *iterator = records == NULL ? NULL : PyObject_GetIter(blocks);
    PyObject *block;
    while (iterator != NULL && (block = PyIter_Next(iterator)) != NULL) {
        PyObject *record = NULL, *is_null = NULL, *block_id = NULL, *ref_cnt = NULL,
                 *block_hash = NULL;
        int skip = 0;
        if (kind != ALLOCATED) {
            is_null = PyObject_GetAttr(block, s_is_null);
            skip = is_null == NULL ? -1 : PyObject_IsTrue(is_null);
        }
        if (skip == 0 && (block_id = PyObject_GetAttr(block, s_block_id)) != NULL) {
            if (kind == FREED) {
                if ((ref_cnt = PyObject_GetAttr(block, s_ref_cnt)) != NULL
                    && (block_hash = PyObject_GetAttr(block, s_block_hash)) != NULL) {
                    record = NEW_RECORD(BlockFreed, .block_id = block_id, .ref_cnt = ref_cnt,
                                        .hashed = block_hash != Py_None ? Py_True : Py_False);
                }
            } else if (kind == ALLOCATED) {
                record = NEW_RECORD(BlockAllocated, .block_id = block_id, .req = probe->req);
            } else {
                record = NEW_RECORD(BlockTouched, .block_id = block_id, .req = probe->req);
            }
        }
        int failed = skip < 0
                     || (skip == 0 && (record == NULL || PyList_Append(records, record) < 0));
        Py_XDECREF(record);
        Py_XDECREF(is_null);
        Py_XDECREF(block_id);
        Py_XDECREF(ref_cnt);
        Py_XDECREF(block_hash);
        Py_DECREF(block);
        if (failed) {
            break;
        }
    }
    Py_XDECREF(iterator);
    if (PyErr_Occurred() || records == NULL) {
        count_failure(probe);
    } else if (PyList_SetSlice(probe->records, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, records) < 0) {
        count_failure(probe); /* appended at the end, all at once */
    }
    Py_XDECREF(records);
}

/* BlockPool.get_new_blocks(self, num_blocks): what it evicts is an LRU reuse. */
static PyObject *
get_new_blocks(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *blocks;
    ProbeState *probe = fast_pool_probe(w, args, nargsf, kwnames, 1, &blocks);
    if (probe == NULL) {
        return blocks;
    }
    PyObject *reason = probe->remove_reason; /* its reference moves here for the call */
    probe->remove_reason = Py_NewRef(LruReuse);
    blocks = CALL_ORIGINAL();
    set_field(&probe->remove_reason, reason);
    if (blocks != NULL) {
        add_block_records(probe, blocks, ALLOCATED);
    }
    Py_DECREF(probe);
    return blocks;
}

/* BlockPool.touch(self, blocks) */
static PyObject *
touch(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *blocks = arg_at(w, args, PyVectorcall_NARGS(nargsf), kwnames, 1);
    PyObject *result;
    ProbeState *probe = fast_pool_probe(w, args, nargsf, kwnames, blocks != NULL, &result);
    if (probe == NULL) {
        return result;
    }
    result = CALL_ORIGINAL();
    if (result != NULL) {
        add_block_records(probe, blocks, TOUCHED);
    }
    Py_DECREF(probe);
    return result;
}

/* BlockPool.free_blocks(self, ordered_blocks): a free outside any cache-manager call is the
 * engine releasing blocks itself (BlocksReleased, an input). */
static PyObject *
free_blocks(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *result;
    ProbeState *probe = fast_pool_probe(
        w, args, nargsf, kwnames, PyVectorcall_NARGS(nargsf) == 2 && kwnames == NULL, &result);
    if (probe == NULL) {
        return result;
    }
    int outside = PyObject_RichCompareBool(probe->req, NoReq, Py_EQ);
    if (outside < 0) {
        clear_unless_stop();
        Py_DECREF(probe);
        return CALL_SLOW();
    }
    PyObject *blocks = PySequence_List(args[1]); /* an iterator would be spent by vLLM */
    if (blocks == NULL) { /* not iterable: what list() raises, as the Python wrapper would */
        Py_DECREF(probe);
        return NULL;
    }
    if (outside) {
        PyObject *block_ids = PyList_New(0);
        PyObject *released = NULL, *block;
        for (Py_ssize_t i = 0; block_ids != NULL && i < PyList_GET_SIZE(blocks); i++) {
            block = PyList_GET_ITEM(blocks, i);
            PyObject *is_null = PyObject_GetAttr(block, s_is_null);
            int skip = is_null == NULL ? -1 : PyObject_IsTrue(is_null);
            Py_XDECREF(is_null);
            PyObject *block_id = skip == 0 ? PyObject_GetAttr(block, s_block_id) : NULL;
            if (skip < 0 || (skip == 0 && (block_id == NULL
                                            || PyList_Append(block_ids, block_id) < 0))) {
                Py_XDECREF(block_id);
                Py_CLEAR(block_ids);
                break;
            }
            Py_XDECREF(block_id);
        }
        if (block_ids != NULL) {
            released = NEW_RECORD(BlocksReleased, .block_ids = block_ids);
            append_record(probe, released);
        } else {
            count_failure(probe);
        }
        Py_XDECREF(block_ids);
    }
    if (PyErr_Occurred()) { /* a stop, before the call */
        Py_DECREF(blocks);
        Py_DECREF(probe);
        return NULL;
    }
    PyObject *call_args[] = {args[0], blocks};
    result = PyObject_Vectorcall(w->original, call_args, 2, NULL);
    if (result != NULL) {
        add_block_records(probe, blocks, FREED);
    }
    Py_DECREF(blocks);
    Py_DECREF(probe);
    return result;
}

/* A fast path: a vectorcall whose callable is the wrapper. */
typedef PyObject *(*FastPath)(FastWrapper *w, PyObject *const *args, size_t nargsf,
                              PyObject *kwnames);

static const FastPath fast_paths[NUM_KINDS] = {
    new_step_starts, allocate_slots, insert_block_hash, remove_cached_block_hashes,
    get_num_blocks_to_allocate, allocate_new_blocks, cache_blocks, get_new_blocks, touch,
    free_blocks,
};

/* Every fast path: a stop met by our code after the original returned is raised in place of
 * the result. */
static PyObject *
fast_path(FastWrapper *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *result = fast_paths[w->kind](w, args, nargsf, kwnames);
    if (result != NULL && PyErr_Occurred()) {
        Py_CLEAR(result);
    }
    return result;
}

static const char *kind_names[NUM_KINDS] = {
    "new_step_starts", "allocate_slots", "_insert_block_hash", "_remove_cached_block_hashes",
    "get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks", "get_new_blocks",
    "touch", "free_blocks",
};

static PyObject *
wrapper_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    const char *method_name;
    PyObject *original, *slow, *names, *defaults;
    static char *keywords[] = {"method_name", "original", "slow", "names", "defaults", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOOO!O!:FastWrapper", keywords, &method_name,
                                     &original, &slow, &PyTuple_Type, &names, &PyTuple_Type,
                                     &defaults)) {
        return NULL;
    }
    int kind = 0;
    while (kind < NUM_KINDS && strcmp(kind_names[kind], method_name) != 0) {
        kind++;
    }
    if (kind == NUM_KINDS) {
        return PyErr_Format(PyExc_ValueError, "no native fast path for %s", method_name);
    }
    if (NoReq == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvtrace._native: configure() first");
        return NULL;
    }
    if (PyTuple_GET_SIZE(defaults) > PyTuple_GET_SIZE(names)) {
        PyErr_SetString(PyExc_ValueError, "more defaults than parameters");
        return NULL;
    }
    FastWrapper *self = (FastWrapper *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->kind = kind;
    self->original = Py_NewRef(original);
    self->slow = Py_NewRef(slow);
    self->names = Py_NewRef(names);
    self->defaults = Py_NewRef(defaults);
    self->vectorcall = (vectorcallfunc)fast_path;
    return (PyObject *)self;
}

static int
wrapper_traverse(FastWrapper *self, visitproc visit, void *arg)
{
    for (int i = 0; i < PROBE_CACHE_SIZE; i++) {
        Py_VISIT(self->cache[i].owner);
        Py_VISIT(self->cache[i].probe);
        Py_VISIT(self->cache[i].checkpoints);
    }
    Py_VISIT(self->original);
    Py_VISIT(self->slow);
    Py_VISIT(self->names);
    Py_VISIT(self->defaults);
    Py_VISIT(self->dict);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
wrapper_clear(FastWrapper *self)
{
    clear_probe_cache(self);
    Py_CLEAR(self->original);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->names);
    Py_CLEAR(self->defaults);
    Py_CLEAR(self->dict);
    return 0;
}

static void
wrapper_dealloc(PyObject *self)
{
    dealloc_with(self, (inquiry)wrapper_clear);
}

/* A method: bound like a function, so instance.method(...) passes the instance as self. */
static PyObject *
wrapper_get(PyObject *self, PyObject *instance, PyObject *owner)
{
    if (instance == NULL || instance == Py_None) {
        return Py_NewRef(self);
    }
    return PyMethod_New(self, instance);
}

static PyMemberDef wrapper_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(FastWrapper, vectorcall), READONLY, NULL},
    {"__dictoffset__", T_PYSSIZET, offsetof(FastWrapper, dict), READONLY, NULL},
    {"slow", T_OBJECT, offsetof(FastWrapper, slow), READONLY,
     "The Python wrapper the fast path hands every other case to."},
    {NULL},
};

static PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyType_Slot wrapper_slots[] = {
    {Py_tp_doc, "A probe wrapper whose common case runs in C (see kvtrace/probes/wrappers.py)."},
    {Py_tp_new, wrapper_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_descr_get, wrapper_get},
    {Py_tp_members, wrapper_members},
    {Py_tp_getset, wrapper_getset},
    {Py_tp_traverse, wrapper_traverse},
    {Py_tp_clear, wrapper_clear},
    {Py_tp_dealloc, wrapper_dealloc},
    {0, NULL},
};

static PyType_Spec wrapper_spec = {
    "kvtrace._native.FastWrapper", sizeof(FastWrapper), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL
        | Py_TPFLAGS_METHOD_DESCRIPTOR,
    wrapper_slots,
};

/* --- what the module tells the probes --------------------------------------------------------- */

PyObject *
probes_changed(PyObject *module, PyObject *unused)
{
    probes_generation++;
    Py_RETURN_NONE;
}

void
probes_configure(PyObject *no_req, PyObject *stale_checkpoint, PyObject *lru_reuse)
{
    Py_XSETREF(NoReq, Py_NewRef(no_req));
    Py_XSETREF(StaleCheckpoint, Py_NewRef(stale_checkpoint));
    Py_XSETREF(LruReuse, Py_NewRef(lru_reuse));
}

int
probes_add_types(PyObject *module)
{
    if (intern_names() < 0 || probe_state_add_type(module) < 0) {
        return -1;
    }
    PyObject *wrapper_type = PyType_FromSpec(&wrapper_spec);
    int added = wrapper_type == NULL
                || PyModule_AddObjectRef(module, "FastWrapper", wrapper_type) < 0 ? -1 : 0;
    Py_XDECREF(wrapper_type);
    return added;
}
