/* kvtrace._model_core: the native twin of the model replay backend (kvtrace/replay/model/).
 *
 * The pure-Python model (pool.py, managers.py, backend.py) is the reference; the core does the
 * same, function for function (names follow the Python twin), on C arrays: the block pool (ref
 * counts, primary and secondary keys, the free queue, one hash map per KV-cache group), the
 * full-attention and Mamba "align" managers, and the coordinator's hit search, allocation and
 * caching. It makes the same records (the kvtrace.events types handed to configure()) in the
 * same order; or, built without a sink (a summary-only replay), it makes none and counts what
 * kvtrace.replay.run.ReplaySummary would count over them (the Tally; reports.Tally in Python).
 * Built only where a C compiler is found (setup.py, optional); kvtrace.replay.model uses it
 * unless KVTRACE_NATIVE=0. tests/test_model_backend.py holds both twins to vLLM record for
 * record; tests/test_native_snapshot.py its start from a snapshot (model_restore.c).
 *
 * This unit is the Python type, ModelCore, and the module; model_parts.h lists the units below
 * it, one per part of the Python twin.
 */

#include "model_parts.h"

/* --- the Python type -------------------------------------------------------------------------- */

static int set_kvtrace_error(const char *hint, const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    set_error_v(T_KVTRACE_ERROR, hint, format, ap);
    va_end(ap);
    return -1;
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

static int Core_traverse(ModelCore *c, visitproc visit, void *arg) {
    Py_VISIT(c->sink);
    Py_VISIT(c->records);
    if (c->columns) Py_VISIT(c->columns->sink);
    Py_VISIT(c->variant);
    Py_VISIT(c->checkpoint_action);
    return 0;
}

static int Core_clear(ModelCore *c) {
    if (c->columns) Py_CLEAR(c->columns->sink);
    Py_CLEAR(c->sink);
    Py_CLEAR(c->records);
    Py_CLEAR(c->variant);
    Py_CLEAR(c->checkpoint_action);
    return 0;
}

static void Core_dealloc(ModelCore *c) {
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

/* ModelCore(sink, variant, num_blocks, hash_block_size, scheduler_block_size, max_model_len,
        retention_interval, enable_caching, hybrid, partial_hits, alignment, simple_hybrid,
        groups, specs): groups = [(is_mamba, block_size, num_checkpoint_blocks,
        checkpoint_alignment or None)], specs = [(is_mamba, block_size, (group ids...))].
   A sink of None: count (_counts()), make no record. */
static int Core_init(ModelCore *c, PyObject *args, PyObject *kwargs) {
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

static PyObject *Core_flushed(ModelCore *c, PyObject *result) {
    if (flush(c)) { Py_XDECREF(result); return NULL; }
    return result;
}

static PyObject *Core_new_step(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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

/* _add(req, prompt_len, max_tokens, hash_ids): the request, validated by the Python side. */
static PyObject *Core_add(ModelCore *c, PyObject *args) {
    long long req, prompt_len, max_tokens;
    PyObject *hash_ids;
    if (!PyArg_ParseTuple(args, "LLLO", &req, &prompt_len, &max_tokens, &hash_ids)
        || !new_request(c, req, prompt_len, max_tokens, hash_ids))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Core_get_computed_blocks(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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

static PyObject *Core_allocate_slots(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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

static PyObject *Core_end_schedule(ModelCore *c, PyObject *unused) {
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
static Request *request_and_count(ModelCore *c, const char *function, const char *const *names,
                                  PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                                  i64 *count) {
    PyObject *values[2];
    i64 req;
    if (parse_args(function, args, nargs, kwnames, names, 2, 2, values)
        || as_i64(values[0], &req) || as_i64(values[1], count))
        return NULL;
    return find_request(c, req);
}

static PyObject *Core_advance(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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
static PyObject *Core_cache_blocks(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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
static PyObject *release(ModelCore *c, i64 req, int record_type, int status) {
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

static PyObject *Core_free(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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

static PyObject *Core_preempt(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"req"};
    PyObject *value;
    i64 req;
    if (parse_args("preempt", args, nargs, kwnames, names, 1, 1, &value)
        || as_i64(value, &req))
        return NULL;
    return release(c, req, T_REQUEST_PREEMPTED, 0);
}

static PyObject *Core_num_free_blocks(ModelCore *c, PyObject *unused) {
    return PyLong_FromLongLong(c->num_free);
}

static PyObject *Core_sync_request(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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

/* _release(block_ids): the engine frees blocks itself (checked by the Python side). */
static PyObject *Core_release(ModelCore *c, PyObject *ids) {
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

static PyObject *Core_ref_count(ModelCore *c, PyObject *arg) {
    long block = PyLong_AsLong(arg);
    if (block == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLong(block >= 0 && block < c->num_blocks ? c->ref[block] : 0);
}

static PyObject *Core_cached_block_id(ModelCore *c, PyObject *const *args, Py_ssize_t nargs,
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

static PyObject *Core_request_counters(ModelCore *c, PyObject *arg) {
    i64 req;
    if (as_i64(arg, &req)) return NULL;
    Request *r = find_request(c, req);
    if (!r) return NULL;
    return Py_BuildValue("LLL", r->num_tokens, r->num_computed, r->prompt_len);
}

/* _counts(): the Tally as reports.Counts' fields (prompt_tokens, hit_tokens,
   resumed_hit_tokens, removed, checkpoints_suppressed, stale_key_hazards, preemptions,
   hit_blocks, stored, evicted). */
static PyObject *Core_counts(ModelCore *c, PyObject *unused) {
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

static PyObject *Core_close(ModelCore *c, PyObject *unused) {
    if (flush(c) || (c->columns && c->columns->num_kinds
                     && write_batch(c, c->columns->num_kinds)))
        return NULL;
    Py_RETURN_NONE;
}

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
    .tp_basicsize = sizeof(ModelCore),
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
