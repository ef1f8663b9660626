/* The cache followed record by record (kvtrace._forensics_core; csrc/forensics.h): the C twin of
 * kvtrace/analysis/attributor.py's MissAttributor (its handlers, the transient checkpoints
 * cached in the free queue) and of the cache entries' SQL (database.py, CACHE_ENTRIES_SQL):
 * each admitted lookup goes to forensics_lookup.c, each closed entry becomes a row.
 */

#include "forensics.h"

/* --- small helpers -------------------------------------------------------------------------- */

int fail(const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    PyErr_FormatV(PyExc_ValueError, format, ap);
    va_end(ap);
    return -1;
}


static Request *find_request(ForensicsCore *c, i64 req) {
    i64 slot;
    return map_get(&c->requests, req, &slot) ? (Request *)(intptr_t)slot : NULL;
}
static Request *request_of(ForensicsCore *c, i64 req) {
    Request *r = find_request(c, req);
    if (r) return r;
    r = PyMem_Calloc(1, sizeof(Request));
    if (!r) { PyErr_NoMemory(); return NULL; }
    r->req = req;
    if (map_set(&c->requests, req, (i64)(intptr_t)r)) { PyMem_Free(r); return NULL; }
    return r;
}
void free_request(Request *r) {
    lvec_free(&r->units);
    PyMem_Free(r->classes);
    PyMem_Free(r);
}

static int check_group(ForensicsCore *c, i64 group, const char *kind) {
    if (group < 0 || group >= c->num_groups)
        return fail("record %lld (%s) names KV-cache group %lld, but the header has %d group%s "
                    "(0 to %d)", c->seq, kind, group, c->num_groups,
                    c->num_groups == 1 ? "" : "s", c->num_groups - 1);
    return 0;
}


static Block *block_at(ForensicsCore *c, i64 block_id, const char *kind) {
    if (block_id < -1 || block_id >= c->num_blocks - 1) {
        fail("record %lld (%s) names block %lld, outside the header's pool of %lld blocks",
             c->seq, kind, block_id, (i64)c->num_blocks - 1);
        return NULL;
    }
    return &c->blocks[slot_of(block_id)];
}

/* --- the transient checkpoints cached in the free queue (attribution) ------------------------- */

static void evictable_drop(ForensicsCore *c, int32_t b) {
    Block *k = &c->blocks[b];
    if (!k->evictable) return;
    if (k->prev >= 0) c->blocks[k->prev].next = k->next; else c->evictable_head = k->next;
    if (k->next >= 0) c->blocks[k->next].prev = k->prev; else c->evictable_tail = k->prev;
    k->prev = k->next = -1;
    k->evictable = 0;
    c->num_evictable--;
}
static void evictable_add(ForensicsCore *c, int32_t b) {  /* at the end, unless already there */
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
static void recheck(ForensicsCore *c, int32_t b) {
    Block *k = &c->blocks[b];
    if (k->transient && k->t_keys && !k->in_use) evictable_add(c, b);
    else evictable_drop(c, b);
}

/* --- the cache entries' block state (block_states) --------------------------------------------- */

static void block_state_changed(ForensicsCore *c, Block *k) {
    char evictable = !k->s_in_use && k->s_transient && k->s_keys > 0;
    if (evictable != k->s_evictable) {
        c->s_num_evictable += evictable ? 1 : -1;
        k->s_evictable = evictable;
    }
}

int entry_row(ForensicsCore *c, Entry *e, i64 removed_seq, i64 removed_step, i64 reason,
              i64 transient_cached) {
    if (!c->make_entries) return 0;
    i64 values[NUM_E] = {
        e->stored_seq, e->block, removed_seq, removed_step, reason, e->position_class, e->hits,
        e->hits ? e->last_hit_seq : NONE_VALUE, e->hits ? e->last_hit_step : NONE_VALUE,
        transient_cached};
    for (int i = 0; i < NUM_E; i++)
        if (lvec_push(&c->entry_rows.columns[c->entry_column[i]], values[i])) return -1;
    return 0;
}

static int open_entry(ForensicsCore *c, int32_t block_id, Block *k, i64 hash_id, int group,
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
static int close_entries(ForensicsCore *c, Block *k, i64 hash_id, int group, i64 reason) {
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

static int on_allocated(ForensicsCore *c, i64 req, i64 num_new, i64 num_computed,
                        i64 num_new_computed,
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
            && attribute_lookup(c, r, req, admission, num_tokens))
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

static int on_stored(ForensicsCore *c, i64 block_id, i64 hash_id, i64 group, i64 num_tokens,
                     i64 kind,
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

static int on_removed(ForensicsCore *c, i64 block_id, i64 hash_id, i64 group, i64 reason) {
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
static int on_taken(ForensicsCore *c, i64 block_id, int touched) {
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

static int on_freed(ForensicsCore *c, i64 block_id, i64 ref_cnt) {
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

static int on_checkpoint(ForensicsCore *c, i64 req, i64 group, i64 position, i64 position_class) {
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

static int request_matches(ForensicsCore *c, PyObject *request_id) {
    if (!c->request_id || !PyUnicode_Check(request_id)) return 0;
    return PyUnicode_Compare(request_id, c->request_id) == 0;
}

/* --- the state records of a start snapshot ------------------------------------------------------ */

/* A key cached at the start: present (so never cold), held by `num_blocks` blocks, an entry on
   each of them. */
static int on_key_cached(ForensicsCore *c, i64 hash_id, i64 group, const Col *lengths,
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
static int on_request_state(ForensicsCore *c, i64 req, i64 queue, const Col *lengths,
                            const Col *values,
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

/* One record of a kind the attribution reads (its columns in FORENSICS_KINDS' order). */
int follow_record(ForensicsCore *c, Source *s) {
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
