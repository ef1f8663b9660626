/* The module kvtrace._native: its functions and types, and configure(), which gives the probes
 * their record types (laid out by records.c) and constants. See kvtrace_native.h for the parts.
 */
#include "kvtrace_native.h"

/* configure(StepStarted, ..., BlocksReleased, NO_REQ, STALE_CHECKPOINT, LRU_REUSE): the record
 * types (kvtrace.events) and constants the probes' fast paths use. Each type's field order is
 * read from the type; a type the native core cannot build by field name is refused, and a
 * refusal changes nothing. */
static PyObject *
configure(PyObject *module, PyObject *args)
{
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != NUM_RECORD_TYPES + 3) {
        return PyErr_Format(PyExc_TypeError, "configure() takes %d record types and 3 "
                            "constants", NUM_RECORD_TYPES);
    }
    if (records_configure(args) < 0) {
        return NULL;
    }
    probes_configure(PyTuple_GET_ITEM(args, NUM_RECORD_TYPES),
                     PyTuple_GET_ITEM(args, NUM_RECORD_TYPES + 1),
                     PyTuple_GET_ITEM(args, NUM_RECORD_TYPES + 2));
    Py_RETURN_NONE;
}

/* --- the module ------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"intern_hashes", intern_hashes, METH_VARARGS,
     "intern_hashes(probe, hashes, start, stop, hash_block_size) -> ids: CacheProbes._hash_ids "
     "for a plain HashInterner."},
    {"write_rows_frame", write_rows_frame, METH_VARARGS,
     "write_rows_frame(fd, chunks) -> number of records: one R frame of pre-encoded rows, "
     "written with the interpreter lock released."},
    {"snapshot_pool", snapshot_pool, METH_VARARGS,
     "snapshot_pool(probe, blocks, cache) -> (block rows, key rows, holders): the pool part of "
     "a start snapshot, packed int64 (kvtrace/probes/snapshot.py's _read_pool)."},
    {"probes_changed", probes_changed, METH_NOARGS,
     "A probe set was armed or disarmed: forget which probe set observes which cache."},
    {"configure", configure, METH_VARARGS,
     "configure(StepStarted, SlotsAllocated, BlockStored, BlockRemoved, HashInterned, "
     "BlockAllocated, BlockTouched, BlockFreed, BlocksReleased, NO_REQ, STALE_CHECKPOINT, "
     "LRU_REUSE): the record types and constants the fast paths use. Each type's field order "
     "is read from the type; one the native core cannot build by field name is refused "
     "(TypeError, ValueError) and nothing changes."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvtrace._native",
    "Native fast paths of kvtrace's cache probes (see kvtrace/probes/wrappers.py).", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        return NULL;
    }
    frames_init();
    if (snapshot_init() < 0 || probes_add_types(module) < 0 || step_buffer_add_type(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
