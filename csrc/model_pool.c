/* The model core's block pool, the twin of kvtrace/replay/model/pool.py: ref counts, primary
 * and secondary keys, the free queue, one hash map per KV-cache group (model_parts.h). Its
 * lookups (cached_block, holds) are static inline in model_parts.h.
 */

#include "model_parts.h"

static int unmap(ModelCore *c, i64 hash_id, int group, int32_t block) {
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
int map_block(ModelCore *c, i64 hash_id, int group, int32_t block) {
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
int add_extra_key(ModelCore *c, int32_t block, i64 hash_id, int group) {
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

static int insert_key(ModelCore *c, i64 hash_id, int group, int32_t block, i64 num_tokens,
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
int strip_keys(ModelCore *c, int32_t block, int reason, LVec *removed) {
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

int move_keys(ModelCore *c, int32_t source, int32_t target, i64 req) {
    i64 num_tokens = c->key_tokens[source];
    LVec removed = {0};
    int rc = strip_keys(c, source, E_REKEY, &removed) < 0 ? -1 : 0;
    for (Py_ssize_t i = 0; i + 1 < removed.n && !rc; i += 2)
        rc = insert_key(c, removed.v[i], (int)removed.v[i + 1], target, num_tokens, E_PARTIAL,
                        req);
    lvec_free(&removed);
    return rc;
}

int get_new_blocks(ModelCore *c, i64 count, i64 req, IVec *out) {
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

int touch(ModelCore *c, const int32_t *blocks, Py_ssize_t n, i64 req) {
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

int free_blocks(ModelCore *c, const int32_t *blocks, Py_ssize_t n, int released) {
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

int cache_full_blocks(ModelCore *c, Request *r, IVec *table, i64 num_cached, i64 num_full,
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
int cache_partial_block(ModelCore *c, Request *r, int32_t block, i64 num_tokens, int group,
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
