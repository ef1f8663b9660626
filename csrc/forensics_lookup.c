/* The attribution of one admitted lookup (kvtrace._forensics_core; csrc/forensics.h): the C
 * twin of kvtrace/analysis/attributor.py's MissAttributor._attribute and of
 * kvtrace/analysis/hit_search.py (the reference: same names, same steps). Levels are the
 * waterfall's, as Python handed the causes (ForensicsCore.level): a key's level is the first
 * restriction of the ideal cache that takes it, ForensicsCore.present when the cache held it.
 */

#include "forensics.h"

/* MissAttributor._level: which restriction of the ideal cache takes hash_id in group. */
static int level_of(ForensicsCore *c, int group, i64 hash_id) {
    Key *key = key_of(c, hash_id, group, 0);
    if (key && key->copies) return c->present;
    int mamba = c->is_mamba[group];
    if (!key || key->removal < 0) {  /* never stored (or, held by no block, never lost) */
        if (!mamba) return c->level[C_BLOCK_QUANTISATION];
        if (id_set_has(&c->suppressed, hash_id)) return c->level[C_MAMBA_SUPPRESSED];
        if (id_set_has(&c->states, hash_id)) return c->level[C_MAMBA_NOT_RETAINED];
        return c->level[C_MAMBA_NOT_RESERVED];
    }
    Removal *removal = chunk_at(&c->removals, key->removal);
    if (removal->reason == c->lru_reuse) {
        if (removal->behind) return c->level[C_CHECKPOINT_PUSHOUT];
        return c->level[mamba ? C_MAMBA_EVICTED : C_EVICTED];
    }
    if (removal->reason == c->stale_checkpoint) return c->level[C_MAMBA_SUPPRESSED];
    if (removal->reason == c->rekey) return c->level[C_REKEYED];
    return c->level[C_INVALIDATED];
}

/* MissAttributor._levels: per unit depth 0..depth (0 is a placeholder), the first restriction
   that takes the key from any of groups. */
static int levels_of(ForensicsCore *c, const int *groups, int num_groups, const i64 *units,
                     i64 depth,
                     LVec *out) {
    out->n = 0;
    if (lvec_push(out, 0)) return -1;
    for (i64 d = 0; d < depth; d++) {
        int level = c->present;
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

/* hit_search.Geometry.attention_reach */
static i64 attention_reach(ForensicsCore *c, const LVec *levels, i64 threshold, i64 num_units,
                           i64 cap) {
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

/* hit_search.Geometry.eagle_ideal */
static i64 eagle_ideal(ForensicsCore *c, i64 ideal, i64 cap) {
    i64 reach = min64(ideal, floordiv(cap + c->eagle_margin, c->unit) * c->unit);
    return max64(reach - c->eagle_drop, 0);
}

/* hit_search.Geometry.mamba_state */
static i64 mamba_state(ForensicsCore *c, const LVec *levels, i64 threshold, i64 num_units,
                       i64 limit) {
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

static i64 joint_hit(ForensicsCore *c, i64 threshold, i64 num_units, i64 cap) {
    i64 reach = attention_reach(c, &c->attention_levels, threshold, num_units, cap);
    return mamba_state(c, &c->mamba_levels, threshold, num_units, reach);
}

typedef struct { int group; i64 depth, hash_id; int32_t removal; } LostKey;

/* MissAttributor._lost_key */
static void lost_key(ForensicsCore *c, const int *groups, int num_groups, int level, i64 depth,
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

/* MissAttributor._lost_keys: the keys of the restriction at `level` took between start and end
   (up to max_keys; 1 unless explaining): none unless keys carry it (a key class). */
static Py_ssize_t lost_keys(ForensicsCore *c, int level, i64 start, i64 end, const i64 *units,
                            LostKey *keys, Py_ssize_t max_keys) {
    if (level < c->level[C_BLOCK_QUANTISATION] || level >= c->level[C_OTHER]) return 0;
    const LVec *attention = &c->attention_levels, *mamba = &c->mamba_levels;
    Py_ssize_t n = 0;
    i64 last = floordiv(end, c->unit);
    if (0 <= last && last < mamba->n && mamba->v[last] == level && n < max_keys)
        lost_key(c, c->mamba_groups, c->num_mamba, level, last, units, &keys[n++]);
    i64 per_block = floordiv(c->attention_block, c->unit);
    i64 top = min64(last, attention->n - 1);
    for (i64 depth = max64(floordiv(start, c->unit) + 1, 1); depth <= top; depth++) {
        if (attention->v[depth] == level && (floormod(depth, per_block) == 0 || depth == last)
            && n < max_keys)
            lost_key(c, c->attention_groups, c->num_attention, level, depth, units, &keys[n++]);
        if (n && !c->explain) break;
    }
    return n;
}

/* The tuples take_lookups hands over, their fields named in the order built below: the module
   publishes these names (LOOKUP_FIELDS, ...), by which stream.py reads each field. */
const char *const lookup_fields[] = {
    "req", "lookup", "seq", "step", "query_tokens", "ideal_tokens", "hit_tokens",
    "shared_prefix_boundary", "attention_hit", "mamba_hit", "in_flight", "segments", NULL};
const char *const segment_fields[] = {"cause", "start", "end", "keys", NULL};
const char *const key_fields[] = {"group", "depth_tokens", "hash_id", "removal", NULL};
const char *const removal_fields[] = {
    "reason", "seq", "step", "block_id", "by_req", "transient_behind", "behind", NULL};

static PyObject *removal_tuple(ForensicsCore *c, int32_t index) {
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

/* One segment: a row for the table, or a (cause, start, end, keys) tuple for `why` (the cause
   by its value: its index among the causes Python handed). */
static int segment_out(ForensicsCore *c, PyObject *segments, const i64 *head, int cause, i64 start,
                       i64 end, const LostKey *keys, Py_ssize_t num_keys) {
    if (c->make_rows) {
        const LostKey *key = num_keys ? &keys[0] : NULL;
        const Removal *removal = key && key->removal >= 0
            ? chunk_at(&c->removals, key->removal) : NULL;
        i64 values[NUM_A] = {
            head[A_REQ], head[A_LOOKUP], head[A_SEQ], head[A_STEP], head[A_QUERY],
            head[A_IDEAL], head[A_HIT], head[A_ATTENTION_HIT], head[A_MAMBA_HIT],
            c->cause_value[cause],
            end - start, start, end,
            key ? key->group : NONE_VALUE, key ? key->depth : NONE_VALUE,
            key ? key->hash_id : NONE_VALUE,
            removal ? removal->block : NONE_VALUE, removal ? removal->seq : NONE_VALUE,
            removal ? removal->step : NONE_VALUE,
            removal && removal->by_req != NO_REQ ? removal->by_req : NONE_VALUE,
            removal ? removal->behind : NONE_VALUE, head[A_IN_FLIGHT]};
        for (int i = 0; i < NUM_A; i++)
            if (lvec_push(&c->rows.columns[c->row_column[i]], values[i])) return -1;
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
        PyObject *segment = Py_BuildValue("(iLLN)", c->cause_value[cause], start, end, key_list);
        if (!segment || PyList_Append(segments, segment)) { Py_XDECREF(segment); return -1; }
        Py_DECREF(segment);
    }
    return 0;
}

/* MissAttributor._attribute */
int attribute_lookup(ForensicsCore *c, Request *r, i64 req, i64 admission, i64 num_tokens) {
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
    i64 real = c->level[C_OTHER] - 1;  /* keys with a level above this are the ones the cache held */
    i64 head[NUM_A];
    head[A_REQ] = req;
    head[A_LOOKUP] = admission;
    head[A_SEQ] = r->pending_seq;
    head[A_STEP] = r->pending_step;
    head[A_QUERY] = num_tokens;
    head[A_IDEAL] = ideal;
    head[A_HIT] = hit;
    head[A_ATTENTION_HIT] = c->num_attention
        ? attention_reach(c, &c->attention_levels, real, num_units, cap) : NONE_VALUE;
    head[A_MAMBA_HIT] = c->num_mamba
        ? mamba_state(c, &c->mamba_levels, real, num_units, cap) : NONE_VALUE;
    head[A_IN_FLIGHT] = id_set_has(&c->in_flight, req);
    PyObject *segments = c->keep_lookups ? PyList_New(0) : NULL;
    if (c->keep_lookups && !segments) return -1;
    Py_ssize_t max_keys = c->explain ? (Py_ssize_t)(2 + depth) : 1;
    LostKey *keys = PyMem_Malloc((size_t)max_keys * sizeof(LostKey));
    if (!keys) { Py_XDECREF(segments); PyErr_NoMemory(); return -1; }
    int rc = 0;
    i64 previous = ideal;
    if (ideal > hit) {
        /* the waterfall, level by level up to `other`: the last-token cap and EAGLE's dropped
           unit (use_eagle) by their rules, each key class (from block quantisation on) by the
           hit search over the keys it leaves (block quantisation always: the search itself
           quantises); a class no key carries is skipped */
        char carried[NUM_CAUSES + 1] = {0};
        for (Py_ssize_t i = 0; i < c->attention_levels.n; i++) carried[c->attention_levels.v[i]] = 1;
        for (Py_ssize_t i = 0; i < c->mamba_levels.n; i++) carried[c->mamba_levels.v[i]] = 1;
        int key_classes = c->level[C_BLOCK_QUANTISATION];
        for (int level = 0; level < c->level[C_OTHER] && !rc; level++) {
            int cause = c->cause_at[level];
            if (cause == C_EAGLE_DROPPED_UNIT ? !c->eagle_drop
                : cause != C_HIT_CAP && !(level >= key_classes
                                          && (carried[level] || cause == C_BLOCK_QUANTISATION)))
                continue;
            if (previous == hit) break;
            i64 now = cause == C_HIT_CAP ? min64(ideal, floordiv(cap, unit) * unit)
                    : cause == C_EAGLE_DROPPED_UNIT ? eagle_ideal(c, ideal, cap)
                    : joint_hit(c, level, num_units, cap);
            now = max64(hit, min64(previous, now));
            if (now < previous) {
                Py_ssize_t n = lost_keys(c, level, now, previous, units, keys, max_keys);
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
