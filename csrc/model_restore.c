/* The model core's start from a capture's start snapshot: the twin of ModelBackend.restore
 * (kvtrace/replay/model/backend.py), BlockPool.restore (pool.py) and the managers'
 * restore_request (managers.py), in their order, with the pool's, the requests' and the
 * tally's functions (model_parts.h); NativeModelBackend.restore hands it the snapshot's records
 * as tuples.
 *
 * kvtrace/replay/snapshot_checks.py refuses a snapshot no engine could have held before any
 * backend sees it. What is checked here is only what the core would otherwise read or write
 * outside its arrays (a block, group or index out of range, a request twice or unknown, a
 * block twice in the free queue): a SnapshotError, as the Python twin raises, not a crash.
 */
#include "model_parts.h"

static int snapshot_error(const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    set_error_v(T_SNAPSHOT_ERROR, NULL, format, ap);
    va_end(ap);
    return -1;
}

static int check_restored_block(ModelCore *c, long long block, int null_ok) {
    if (block < !null_ok || block >= c->num_blocks)
        return snapshot_error("the start snapshot names block %lld, outside the pool of %d",
                              block, c->num_blocks);
    return 0;
}

static int check_restored_group(ModelCore *c, int group) {
    if (group < 0 || group >= c->num_groups)
        return snapshot_error("the start snapshot names KV-cache group %d; the engine has %d",
                              group, c->num_groups);
    return 0;
}

/* ``ids`` into ``out`` (emptied first), each a block of the pool (or the null block). */
static int restored_blocks(ModelCore *c, PyObject *ids, IVec *out, int null_ok) {
    out->n = 0;
    if (block_ids_of(ids, out)) return -1;
    for (Py_ssize_t i = 0; i < out->n; i++)
        if (check_restored_block(c, out->v[i], null_ok)) return -1;
    return 0;
}

/* Apply ``restore_one`` to every item of ``items`` (a sequence of tuples). */
static int restore_each(ModelCore *c, PyObject *items, int (*restore_one)(ModelCore *,
                        PyObject *)) {
    PyObject *fast = PySequence_Fast(items, "the start snapshot's records");
    if (!fast) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast) && !rc; i++)
        rc = restore_one(c, PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    return rc;
}

/* (req, prompt_len, max_tokens, known hash ids, num_hashes, num_tokens, num_computed_tokens,
   shared_prefix_boundary, num_in_flight_tokens, never admitted): a request in flight, its hash
   units reported up to num_hashes (their prefix lengths known); counting, an arrival if it was
   never admitted. */
static int restore_request(ModelCore *c, PyObject *item) {
    long long req, prompt_len, max_tokens, num_hashes, num_tokens, num_computed, junction;
    long long num_in_flight;
    PyObject *hash_ids;
    int never_admitted;
    if (!PyArg_ParseTuple(item, "LLLOLLLLLp", &req, &prompt_len, &max_tokens, &hash_ids,
                          &num_hashes, &num_tokens, &num_computed, &junction, &num_in_flight,
                          &never_admitted))
        return -1;
    if (map_find(&c->request_slots, req) >= 0)
        return snapshot_error("the start snapshot lists request %lld twice", req);
    Request *r = new_request(c, req, prompt_len, max_tokens, hash_ids);
    if (!r) return -1;
    if (num_hashes < 0 || num_hashes > r->hash_ids.n)
        return snapshot_error("the start snapshot gives request %lld %lld hash units of %zd",
                              req, num_hashes, r->hash_ids.n);
    r->num_tokens = num_tokens;
    r->num_hashes = r->num_reported = num_hashes;
    r->num_computed = num_computed;
    r->junction = junction;
    r->num_in_flight = num_in_flight;
    if (set_depths(c, r, 0, num_hashes)) return -1;
    if (!c->counting) return 0;
    return never_admitted ? tally_arrival(&c->tally, req, prompt_len)
                          : map_set(&c->tally.admitted, req, 1);
}

/* A BlockState: (block_id, ref_cnt, hash_id, group, num_tokens); hash_id -1: no key. */
static int restore_block(ModelCore *c, PyObject *item) {
    int block, ref_cnt, group;
    long long hash_id, num_tokens;
    if (!PyArg_ParseTuple(item, "iiLiL", &block, &ref_cnt, &hash_id, &group, &num_tokens)
        || check_restored_block(c, block, 0))
        return -1;
    c->ref[block] = ref_cnt;
    if (hash_id < 0) return 0;
    if (check_restored_group(c, group)) return -1;
    c->has_key[block] = 1;
    c->key_hash[block] = hash_id;
    c->key_group[block] = group;
    c->key_tokens[block] = num_tokens;
    if (c->counting) c->tally.block_group[block] = group;  /* Tally.block_state */
    return 0;
}

/* A KeyCached: (hash_id, group, num_tokens, block_ids): its holders in lookup order, a key
   that is not a holder's primary one as a secondary key; its prefix length unless a request
   in flight reported the hash. */
static int restore_key(ModelCore *c, PyObject *item) {
    long long hash_id, num_tokens;
    int group;
    PyObject *ids;
    if (!PyArg_ParseTuple(item, "LiLO", &hash_id, &group, &num_tokens, &ids)
        || check_restored_group(c, group) || restored_blocks(c, ids, &c->scratch, 0))
        return -1;
    if (num_tokens > 0 && map_find(&c->depth, hash_id) < 0
        && map_set(&c->depth, hash_id, num_tokens))
        return -1;
    for (Py_ssize_t i = 0; i < c->scratch.n; i++) {
        int32_t block = c->scratch.v[i];
        if (!(c->has_key[block] && c->key_hash[block] == hash_id && c->key_group[block] == group)
            && add_extra_key(c, block, hash_id, group))
            return -1;
        if (map_block(c, hash_id, group, block)) return -1;
    }
    return 0;
}

/* The free queue in its order, head (reused first) to tail. */
static int restore_free_queue(ModelCore *c, PyObject *ids) {
    IVec *queue = &c->scratch;
    if (restored_blocks(c, ids, queue, 0)) return -1;
    for (int b = 0; b < c->num_blocks + 2; b++) c->next_free[b] = c->prev_free[b] = -1;
    int32_t previous = c->head;
    for (Py_ssize_t i = 0; i < queue->n; i++) {
        int32_t block = queue->v[i];
        if (c->prev_free[block] != -1)
            return snapshot_error("the start snapshot lists block %d twice in the free queue",
                                  block);
        c->next_free[previous] = block;
        c->prev_free[block] = previous;
        previous = block;
    }
    c->next_free[previous] = c->tail;
    c->prev_free[c->tail] = previous;
    c->num_free = queue->n;
    return 0;
}

/* The per-request state a group's manager keeps, by vLLM's attribute names
   (probes/snapshot.py REQUEST_FIELDS): how many ints each is, and whether only a Mamba
   "align" manager keeps it. */
enum {
    F_NUM_CACHED, F_PARTIAL_HIT, F_LAST_STATE, F_NUM_RETIRED, F_ALLOCATED, F_CHECKPOINT,
    F_PRODUCER_TAIL, NUM_FIELDS
};
static const struct { const char *name; int size, mamba_only; } request_fields[NUM_FIELDS] = {
    {"num_cached_block", 1, 0}, {"_partial_hit_reqs", 2, 0}, {"last_state_block_idx", 1, 1},
    {"_num_retired_blocks", 1, 1}, {"_allocated_block_reqs", 0, 1}, {"_checkpoints", 2, 1},
    {"_producer_partial_tail_reqs", 2, 1},
};

/* One field of a request's state in ``m``'s group (the managers' restore_field); its indices
   within the request's blocks there. */
static int restore_field(ModelCore *c, Manager *m, Request *r, PyObject *name, PyObject *values) {
    GroupState *s = &r->groups[m->group];
    int field = 0;
    while (field < NUM_FIELDS
           && PyUnicode_CompareWithASCIIString(name, request_fields[field].name) != 0)
        field++;
    if (field == NUM_FIELDS || (request_fields[field].mamba_only && !m->is_mamba))
        return snapshot_error("the start snapshot gives request %lld %S in KV-cache group %d, "
                              "which keeps no such state", r->req, name, m->group);
    i64 v[2] = {0, 0};
    int size = request_fields[field].size;
    if (PySequence_Length(values) != size) {
        PyErr_Clear();
        return snapshot_error("the start snapshot has %S = %R for request %lld, not %d values",
                              name, values, r->req, size);
    }
    for (int i = 0; i < size; i++) {
        PyObject *value = PySequence_GetItem(values, i);
        int rc = value ? as_i64(value, &v[i]) : -1;
        Py_XDECREF(value);
        if (rc) return -1;
    }
    Py_ssize_t n = s->table.n;
    int within = 1;
    switch (field) {
    case F_NUM_CACHED:
        within = 0 <= v[0] && v[0] <= n;
        s->has_num_cached = 1;
        s->num_cached = (int32_t)v[0];
        break;
    case F_PARTIAL_HIT:
        within = 0 <= v[0] && v[0] < n && s->table.v[v[0]] == v[1];
        s->has_partial = 1;
        s->partial_index = (int32_t)v[0];
        s->partial_source = (int32_t)v[1];
        break;
    case F_LAST_STATE:
        within = 0 <= v[0] && v[0] < n;
        s->has_last_state = 1;
        s->last_state = (int32_t)v[0];
        break;
    case F_NUM_RETIRED:
        within = 0 <= v[0] && v[0] <= n;
        s->num_retired = (int32_t)v[0];
        break;
    case F_ALLOCATED:
        s->allocated = 1;
        break;
    case F_CHECKPOINT:
        within = 0 <= v[1] && v[1] < n;
        s->has_checkpoint = 1;
        s->checkpoint_position = v[0];
        s->checkpoint_index = (int32_t)v[1];
        break;
    case F_PRODUCER_TAIL:
        s->has_tail = 1;
        s->tail_block = (int32_t)v[0];
        s->tail_boundary = v[1];
        break;
    }
    if (!within)
        return snapshot_error("the start snapshot gives request %lld %S %R, outside its %zd "
                              "blocks in KV-cache group %d", r->req, name, values, n, m->group);
    return 0;
}

/* A RequestBlocksState: (req, group, block_ids, fields): a request's blocks and state in one
   group (its manager's restore_request). */
static int restore_table(ModelCore *c, PyObject *item) {
    long long req;
    int group;
    PyObject *ids, *fields;
    i64 index;
    if (!PyArg_ParseTuple(item, "LiOO!", &req, &group, &ids, &PyDict_Type, &fields)
        || check_restored_group(c, group))
        return -1;
    if (!map_get(&c->request_slots, req, &index))
        return snapshot_error("the start snapshot gives blocks to request %lld, which it does "
                              "not list", req);
    Request *r = c->requests[index];
    if (restored_blocks(c, ids, &r->groups[group].table, 1)) return -1;
    PyObject *name, *values;
    Py_ssize_t position = 0;
    while (PyDict_Next(fields, &position, &name, &values))
        if (restore_field(c, &c->managers[group], r, name, values)) return -1;
    return 0;
}

/* _restore(requests, blocks, keys, free_queue, tables): start from a start snapshot (a new
   core only). Counting, the Tally starts from the snapshot as ReplaySummary does from its
   records; no record is made (the replay trace's writer has the snapshot's records already). */
PyObject *Core_restore(ModelCore *c, PyObject *args) {
    PyObject *requests, *blocks, *keys, *free_queue, *tables;
    if (!PyArg_ParseTuple(args, "OOOOO", &requests, &blocks, &keys, &free_queue, &tables)
        || restore_each(c, requests, restore_request) || restore_each(c, blocks, restore_block)
        || restore_each(c, keys, restore_key) || restore_free_queue(c, free_queue)
        || restore_each(c, tables, restore_table))
        return NULL;
    Py_RETURN_NONE;
}
