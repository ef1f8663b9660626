/* The model core's managers and its coordinator, the twins of kvtrace/replay/model/managers.py
 * (the full-attention and Mamba "align" managers, each over one KV-cache group's blocks in the
 * pool, model_pool.c) and of backend.py's ModelBackend (a request's state across the managers,
 * the longest cache hit over every group, allocation and caching). One unit, so that the
 * coordinator's calls into each manager, several per request and step, are inlined as they were
 * when the core was one file. The checkpoint decision is the shared Python table:
 * Variant.checkpoint_action is called back with a CheckpointFacts.
 */

#include "model_parts.h"

/* --- the managers (managers.py) --------------------------------------------------------------- */

static int num_evictable(ModelCore *c, IVec *hit) {
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

static int blocks_to_allocate(ModelCore *c, Manager *m, Request *r, i64 num_tokens, IVec *hit,
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

static int apply_cow(ModelCore *c, Manager *m, Request *r, int32_t index, int32_t source,
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

static int add_hit(ModelCore *c, Manager *m, Request *r, IVec *hit, i64 num_local, i64 total) {
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

static int allocate_blocks(ModelCore *c, Manager *m, Request *r, i64 num_tokens, i64 num_main) {
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

static int retire(ModelCore *c, Manager *m, Request *r, i64 num_processed) {
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
static int block_mask(ModelCore *c, Manager *m, i64 start, i64 end, const i64 *boundaries,
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

static int cache_full(ModelCore *c, Manager *m, Request *r, i64 num_cached, i64 num_full) {
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

static int is_retained(ModelCore *c, Manager *m, i64 position) {
    if (position % m->block_size) return 0;
    i64 index = position / m->block_size - 1;
    char keep;
    return !block_mask(c, m, index, index + 1, NULL, 0, &keep) || keep;
}

/* Decision 2, by the shared Python table; *keyed: a key was published (*key). */
static int decide_checkpoint(ModelCore *c, Manager *m, Request *r, i64 num_tokens, int *keyed,
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

static int cache_prompt_tail(ModelCore *c, Manager *m, Request *r, i64 num_tokens, int *keyed,
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

static int report_decision(ModelCore *c, Manager *m, Request *r, i64 position, int32_t index,
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

static int cache_group(ModelCore *c, Manager *m, Request *r, i64 num_tokens) {
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

void release_group(ModelCore *c, Manager *m, Request *r, int *error) {
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

Request *find_request(ModelCore *c, i64 req) {
    i64 index;
    if (!map_get(&c->request_slots, req, &index)) {
        PyObject *key = PyLong_FromLongLong(req);
        if (key) { PyErr_SetObject(PyExc_KeyError, key); Py_DECREF(key); }
        return NULL;
    }
    return c->requests[index];
}

void drop_request(ModelCore *c, Request *r) {
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
int set_depths(ModelCore *c, Request *r, i64 start, i64 stop) {
    for (i64 i = start; i < stop; i++)
        if (map_set(&c->depth, r->hash_ids.v[i], (i + 1) * c->hash_block_size)) return -1;
    return 0;
}

int report_request(ModelCore *c, Request *r) {
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

int append_tokens(ModelCore *c, Request *r, i64 count) {
    r->num_tokens += count;
    i64 stop = r->num_tokens / c->hash_block_size;
    while (r->hash_ids.n < stop)
        if (lvec_push(&r->hash_ids, c->next_made_up++)) return -1;
    if (stop > r->num_hashes) r->num_hashes = stop;
    return 0;
}

/* A new request, known from now on, its hash ids (known ones) taken from a sequence; NULL on
   error. Made-up ids continue past them. */
Request *new_request(ModelCore *c, i64 req, i64 prompt_len, i64 max_tokens,
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

/* --- the coordinator (backend.py) ------------------------------------------------------------- */

int lookup(ModelCore *c, const SpecGroup *spec, i64 hash_id, int32_t *found) {
    for (int k = 0; k < spec->num_groups; k++) {
        found[k] = cached_block(c, hash_id, spec->groups[k]);
        if (found[k] < 0) return 0;
    }
    return 1;
}

/* One spec group's hit into c->hits[its groups]; returns the hit length (-1 on error). */
static i64 group_hit(ModelCore *c, const SpecGroup *spec, Request *r, i64 max_length,
                     i64 alignment) {
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

int find_longest_cache_hit(ModelCore *c, Request *r, i64 max_length, i64 *hit_length,
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
int cache_coordinator_blocks(ModelCore *c, Request *r, i64 num_tokens) {
    if (!c->enable_caching) return 0;
    if (c->hybrid && !c->partial_hits) num_tokens -= num_tokens % c->scheduler_block_size;
    for (int g = 0; g < c->num_groups; g++)
        if (cache_group(c, &c->managers[g], r, num_tokens)) return -1;
    return 0;
}

/* KVCacheCoordinator.get_num_blocks_to_allocate: the blocks all groups need for
   ``num_tokens``, each from the request's pending hit (``has_hits``) or none; -1 error. */
static int coordinator_blocks_to_allocate(ModelCore *c, Request *r, i64 num_tokens, int has_hits,
                                          i64 total, i64 num_local, i64 num_main, int admission,
                                          i64 prefill_end, i64 *need) {
    static IVec no_hit = {0};
    i64 part;
    *need = 0;
    for (int g = 0; g < c->num_groups; g++) {
        if (blocks_to_allocate(c, &c->managers[g], r, num_tokens,
                               has_hits ? &r->pending[g] : &no_hit, total, num_local, num_main,
                               admission, prefill_end, &part))
            return -1;
        *need += part;
    }
    return 0;
}

/* KVCacheManager.allocate_slots: 1 allocated, 0 not, -1 error. */
int allocate(ModelCore *c, Request *r, i64 num_new, i64 num_new_computed, int has_hits,
             i64 lookahead, int full_sequence_must_fit, i64 reserved) {
    i64 max_model_len = c->max_model_len;
    i64 num_local = r->num_computed + num_new_computed;
    i64 total = num_local < max_model_len ? num_local : max_model_len;
    i64 prefill_end = 0;
    if (c->retention == 0) {
        prefill_end = r->num_tokens - 1;
        if (prefill_end < r->prompt_len) prefill_end = r->prompt_len;
    }
    i64 need;
    if (full_sequence_must_fit) {
        i64 full = r->num_tokens < max_model_len ? r->num_tokens : max_model_len;
        if (coordinator_blocks_to_allocate(c, r, full, has_hits, total, num_local, full, 1,
                                           prefill_end, &need))
            return -1;
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
    if (coordinator_blocks_to_allocate(c, r, num_tokens, has_hits, total, num_local, num_main, 0,
                                       prefill_end, &need))
        return -1;
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
