/* ProbeState, CacheProbes' base class (kvtrace/probes/cache_probes.py): the fields both the
 * Python probes and the fast paths (probes.c) use; which probe set observes a pool or a
 * manager; and intern_hashes, CacheProbes._hash_ids for a plain HashInterner.
 */
#include "probe_state.h"

/* --- ProbeState ------------------------------------------------------------------------------- */

#define STATE_OBJECTS(X) X(records) X(req) X(request) X(held) X(reqs) X(depth) X(step) \
    X(announced_step) X(remove_reason) X(store_kind) X(hash_ids) X(emit_hash_bytes) X(sink_many)

static int
state_traverse(ProbeState *self, visitproc visit, void *arg)
{
#define VISIT(name) Py_VISIT(self->name);
    STATE_OBJECTS(VISIT)
#undef VISIT
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
state_clear(ProbeState *self)
{
#define CLEAR(name) Py_CLEAR(self->name);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
state_dealloc(PyObject *self)
{
    dealloc_with(self, (inquiry)state_clear);
}

static PyMemberDef state_members[] = {
    {"_records", T_OBJECT_EX, offsetof(ProbeState, records), 0, NULL},
    {"_req", T_OBJECT_EX, offsetof(ProbeState, req), 0, NULL},
    {"_request", T_OBJECT_EX, offsetof(ProbeState, request), 0, NULL},
    {"_held", T_OBJECT_EX, offsetof(ProbeState, held), 0, NULL},
    {"_reqs", T_OBJECT_EX, offsetof(ProbeState, reqs), 0, NULL},
    {"_depth", T_OBJECT_EX, offsetof(ProbeState, depth), 0, NULL},
    {"_step", T_OBJECT_EX, offsetof(ProbeState, step), 0, NULL},
    {"_announced_step", T_OBJECT_EX, offsetof(ProbeState, announced_step), 0, NULL},
    {"_remove_reason", T_OBJECT_EX, offsetof(ProbeState, remove_reason), 0, NULL},
    {"_store_kind", T_OBJECT_EX, offsetof(ProbeState, store_kind), 0, NULL},
    {"_interned_ids", T_OBJECT_EX, offsetof(ProbeState, hash_ids), 0, NULL},
    {"emit_hash_bytes", T_OBJECT_EX, offsetof(ProbeState, emit_hash_bytes), 0, NULL},
    {"sink_many", T_OBJECT_EX, offsetof(ProbeState, sink_many), 0, NULL},
    {"created_ns", T_LONGLONG, offsetof(ProbeState, created_ns), 0, NULL},
    {"num_failures", T_LONGLONG, offsetof(ProbeState, num_failures), 0, NULL},
    {NULL},
};

static PyType_Slot state_slots[] = {
    {Py_tp_doc, "The probe fields the native wrappers read and write (CacheProbes' base)."},
    {Py_tp_members, state_members},
    {Py_tp_traverse, state_traverse},
    {Py_tp_clear, state_clear},
    {Py_tp_dealloc, state_dealloc},
    {0, NULL},
};

static PyType_Spec state_spec = {
    "kvtrace._native.ProbeState", sizeof(ProbeState), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, state_slots,
};

static PyTypeObject *ProbeStateType;
static PyObject *s_block_pool, *s_probe_attr;
PyObject *s_flush;

/* The probe set observing `pool`, or NULL (none, not ours, or the lookup failed: error cleared
 * unless a stop). New reference. */
ProbeState *
probe_of_pool(PyObject *pool)
{
    PyObject *probe;
    if (LOOKUP_ATTR(pool, s_probe_attr, &probe) < 0) {
        clear_unless_stop();
        return NULL;
    }
    if (probe != NULL && !PyObject_TypeCheck(probe, ProbeStateType)) {
        Py_CLEAR(probe);
    }
    return (ProbeState *)probe;
}

/* For managers, which reach their pool as self.block_pool. */
ProbeState *
probe_of_manager(PyObject *manager)
{
    PyObject *pool = PyObject_GetAttr(manager, s_block_pool);
    if (pool == NULL) {
        clear_unless_stop();
        return NULL;
    }
    ProbeState *probe = probe_of_pool(pool);
    Py_DECREF(pool);
    return probe;
}

/* --- intern_hashes ---------------------------------------------------------------------------- */

/* intern_hashes(probe, hashes, start, stop, hash_block_size) -> ids: CacheProbes._hash_ids for a
 * plain HashInterner. Interns hashes[start:stop] (a new id announced by a HashInterned record
 * when the probe emits hash bytes) and records the prefix length each id covers. */
PyObject *
intern_hashes(PyObject *module, PyObject *args)
{
    ProbeState *probe;
    PyObject *hashes;
    Py_ssize_t start, stop, hash_block_size;
    if (!PyArg_ParseTuple(args, "O!O!nnn:intern_hashes", ProbeStateType, &probe, &PyList_Type,
                          &hashes, &start, &stop, &hash_block_size)) {
        return NULL;
    }
    if (probe->hash_ids == NULL || !PyDict_CheckExact(probe->hash_ids) || probe->depth == NULL
        || !PyDict_CheckExact(probe->depth) || probe->records == NULL) {
        PyErr_SetString(PyExc_TypeError, "intern_hashes: the probe set has no HashInterner");
        return NULL;
    }
    stop = Py_MAX(Py_MIN(stop, PyList_GET_SIZE(hashes)), 0); /* as hashes[start:stop] */
    start = Py_MAX(Py_MIN(start, stop), 0);
    PyObject *ids = PyList_New(stop - start);
    for (Py_ssize_t i = start; ids != NULL && i < stop; i++) {
        PyObject *hash_bytes = PyList_GET_ITEM(hashes, i);
        PyObject *hash_id = PyDict_GetItemWithError(probe->hash_ids, hash_bytes);
        if (hash_id != NULL) {
            Py_INCREF(hash_id);
        } else if (PyErr_Occurred()
                   || (hash_id = PyLong_FromSsize_t(PyDict_GET_SIZE(probe->hash_ids))) == NULL
                   || PyDict_SetItem(probe->hash_ids, hash_bytes, hash_id) < 0) {
            Py_XDECREF(hash_id);
            Py_CLEAR(ids);
            break;
        } else if (probe->emit_hash_bytes == Py_True) {
            PyObject *copy = PyBytes_FromObject(hash_bytes); /* bytes(hash_bytes) */
            PyObject *record = copy == NULL ? NULL : NEW_RECORD(HashInterned, .hash_id = hash_id,
                                                                .hash_bytes = copy);
            Py_XDECREF(copy);
            if (record == NULL || PyList_Append(probe->records, record) < 0) {
                Py_XDECREF(record);
                Py_DECREF(hash_id);
                Py_CLEAR(ids);
                break;
            }
            Py_DECREF(record);
        }
        PyObject *depth = PyLong_FromSsize_t((i + 1) * hash_block_size);
        if (depth == NULL || PyDict_SetItem(probe->depth, hash_id, depth) < 0) {
            Py_XDECREF(depth);
            Py_DECREF(hash_id);
            Py_CLEAR(ids);
            break;
        }
        Py_DECREF(depth);
        PyList_SET_ITEM(ids, i - start, hash_id);
    }
    return ids;
}

/* ProbeState, added to `module`; with the names its lookups use. */
int
probe_state_add_type(PyObject *module)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(s_block_pool, "block_pool")
    NAME(s_probe_attr, "_kvtrace_probes")
    NAME(s_flush, "_flush")
#undef NAME
    ProbeStateType = (PyTypeObject *)PyType_FromSpec(&state_spec);
    return ProbeStateType == NULL
        || PyModule_AddObjectRef(module, "ProbeState", (PyObject *)ProbeStateType) < 0 ? -1 : 0;
}
