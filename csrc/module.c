/* The module kvtrace._native: its functions and types, and configure(), which gives the probes
 * their record types and constants. See kvtrace_native.h for the parts.
 */
#include "kvtrace_native.h"

#include <string.h>

/* --- the record types, laid out by configure() ------------------------------------------------ */

#define FIELD_NAME(field) #field,
#define FIELD_NAMES(type, fields) static const char *const type##_fields[] = {fields(FIELD_NAME)};
RECORD_TYPES(FIELD_NAMES)
#undef FIELD_NAMES

#define RECORD_TYPE(type, fields) {#type, type##_fields, 0 fields(FIELD_COUNT)},
RecordType record_types[NUM_RECORD_TYPES] = {RECORD_TYPES(RECORD_TYPE)};
#undef RECORD_TYPE

static void
clear_layout(RecordType *record)
{
    Py_CLEAR(record->type);
    for (int i = 0; i < MAX_RECORD_ARGS; i++) {
        Py_CLEAR(record->default_of[i]);
    }
}

/* Which value the native core supplies for `name`, or -1. */
static int
value_named(const RecordType *record, PyObject *name)
{
    for (int i = 0; i < record->num_values; i++) {
        if (PyUnicode_CompareWithASCIIString(name, record->fields[i]) == 0) {
            return i;
        }
    }
    return -1;
}

/* A Struct's fields (msgspec.structs.fields(type), in __struct_fields__ order) and how many of
 * the first can be passed by position; -1 with a TypeError if `type` is not a msgspec Struct.
 * A stop raised while msgspec's Python code ran (a signal handler's KeyboardInterrupt or
 * SystemExit) stays as it is: replaced, it was lost, and `kvtrace capture` went on capturing
 * after its SIGTERM. */
static int
struct_fields_of(const RecordType *record, PyObject *type, PyObject *struct_fields,
                 PyObject **fields, Py_ssize_t *num_positional)
{
    PyObject *match_args = NULL;
    if ((*fields = PyObject_CallOneArg(struct_fields, type)) == NULL
        || (match_args = PyObject_GetAttrString(type, "__match_args__")) == NULL
        || !PyTuple_Check(*fields) || !PyTuple_Check(match_args)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s is not a msgspec Struct", record->name);
        }
        Py_CLEAR(*fields);
        Py_XDECREF(match_args);
        return -1;
    }
    *num_positional = PyTuple_GET_SIZE(match_args); /* keyword-only fields come last */
    Py_DECREF(match_args);
    return 0;
}

/* Fill `record`'s layout from `type` (a msgspec Struct) by field name: each value goes to its
 * field's position; a field before the last one supplied that the native core does not supply
 * gets its default; every field after it must have one. -1 with a ValueError or TypeError
 * saying why the type does not fit. */
static int
lay_out(RecordType *record, PyObject *type, PyObject *struct_fields, PyObject *nodefault)
{
    PyObject *fields = NULL;
    Py_ssize_t num_positional;
    if (!PyType_Check(type) || strcmp(((PyTypeObject *)type)->tp_name, record->name) != 0) {
        PyErr_Format(PyExc_TypeError, "%R is not the record type %s", type, record->name);
        return -1;
    }
    if (struct_fields_of(record, type, struct_fields, &fields, &num_positional) < 0) {
        return -1;
    }
    Py_ssize_t num_fields = PyTuple_GET_SIZE(fields);
    Py_ssize_t position_of[MAX_RECORD_ARGS];
    for (int value = 0; value < record->num_values; value++) {
        position_of[value] = -1;
    }
    for (Py_ssize_t i = 0; i < num_fields; i++) {
        PyObject *name = PyObject_GetAttrString(PyTuple_GET_ITEM(fields, i), "name");
        if (name == NULL) {
            goto failed;
        }
        int value = value_named(record, name);
        Py_DECREF(name);
        if (value >= 0) {
            position_of[value] = i;
        }
    }
    record->num_args = 0;
    for (int value = 0; value < record->num_values; value++) {
        if (position_of[value] < 0) {
            PyErr_Format(PyExc_ValueError, "%s has no field %s, which the native core supplies",
                         record->name, record->fields[value]);
            goto failed;
        }
        if (position_of[value] >= Py_MIN(num_positional, MAX_RECORD_ARGS)) {
            PyErr_Format(PyExc_ValueError, "%s.%s is keyword-only or past field %d; the native "
                         "core passes values by position", record->name, record->fields[value],
                         MAX_RECORD_ARGS);
            goto failed;
        }
        record->num_args = Py_MAX(record->num_args, (int)position_of[value] + 1);
    }
    record->in_order = record->num_args == record->num_values;
    for (int i = 0; i < record->num_args; i++) {
        record->value_of[i] = -1;
    }
    for (int value = 0; value < record->num_values; value++) {
        record->value_of[position_of[value]] = (signed char)value;
        record->in_order &= position_of[value] == value;
    }
    /* The fields it does not supply: those it passes need a plain default, the rest any. */
    for (Py_ssize_t i = 0; i < num_fields; i++) {
        int passed = i < record->num_args;
        if (passed && record->value_of[i] >= 0) {
            continue;
        }
        PyObject *field = PyTuple_GET_ITEM(fields, i);
        PyObject *name = PyObject_GetAttrString(field, "name");
        PyObject *required = name == NULL ? NULL : PyObject_GetAttrString(field, "required");
        PyObject *fallback = required == NULL ? NULL : PyObject_GetAttrString(field, "default");
        int is_required = fallback == NULL ? -1 : PyObject_IsTrue(required);
        if (is_required > 0) {
            PyErr_Format(PyExc_ValueError, "%s.%U is required and the native core does not "
                         "supply it", record->name, name);
        } else if (is_required == 0 && passed && fallback == nodefault) {
            PyErr_Format(PyExc_ValueError, "%s.%U comes before a field the native core "
                         "supplies and has a default_factory; only a plain default can be "
                         "passed by position", record->name, name);
        } else if (is_required == 0 && passed) {
            record->default_of[i] = Py_NewRef(fallback);
        }
        Py_XDECREF(name);
        Py_XDECREF(required);
        Py_XDECREF(fallback);
        if (PyErr_Occurred()) {
            goto failed;
        }
    }
    record->type = Py_NewRef(type);
    Py_DECREF(fields);
    return 0;
failed:
    Py_DECREF(fields);
    clear_layout(record);
    return -1;
}

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
    PyObject *msgspec = PyImport_ImportModule("msgspec");
    PyObject *structs = PyImport_ImportModule("msgspec.structs");
    PyObject *nodefault = msgspec == NULL ? NULL : PyObject_GetAttrString(msgspec, "NODEFAULT");
    PyObject *struct_fields = structs == NULL ? NULL : PyObject_GetAttrString(structs, "fields");
    RecordType laid_out[NUM_RECORD_TYPES];
    memcpy(laid_out, record_types, sizeof(laid_out));
    int num_laid_out = 0;
    for (; nodefault != NULL && struct_fields != NULL && num_laid_out < NUM_RECORD_TYPES;
         num_laid_out++) {
        RecordType *record = &laid_out[num_laid_out];
        record->type = NULL;
        memset(record->default_of, 0, sizeof(record->default_of));
        if (lay_out(record, PyTuple_GET_ITEM(args, num_laid_out), struct_fields, nodefault) < 0) {
            break;
        }
    }
    Py_XDECREF(msgspec);
    Py_XDECREF(structs);
    Py_XDECREF(nodefault);
    Py_XDECREF(struct_fields);
    if (num_laid_out < NUM_RECORD_TYPES) {
        for (int i = 0; i < num_laid_out; i++) {
            clear_layout(&laid_out[i]);
        }
        return NULL;
    }
    for (int i = 0; i < NUM_RECORD_TYPES; i++) {
        clear_layout(&record_types[i]);
    }
    memcpy(record_types, laid_out, sizeof(laid_out));
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
