/* What the parts of kvtrace's native core (kvtrace._native) share; private to csrc/.
 *
 * The core is the hot paths of a live capture, in C. Built at install when a C compiler is
 * there (setup.py, optional); kvtrace/native.py says whether it is on, and every part has a
 * Python twin that is the reference and the fallback:
 *
 * - probes.c: FastWrapper, the probes' fast paths (kvtrace/probes/wrappers.py).
 * - probe_state.c: ProbeState, the fields the probes and their fast paths share
 *   (kvtrace/probes/cache_probes.py), and intern_hashes; probe_state.h holds what probes.c
 *   uses of it.
 * - step_buffer.c: StepBuffer, a capture's per-step hand-over (kvtrace/capture/step_buffer.py).
 * - frames.c: write_rows_frame, a record frame written without the interpreter lock
 *   (kvtrace/traceio/writer.py).
 * - snapshot.c: snapshot_pool, the pool part of a capture's start snapshot
 *   (kvtrace/probes/snapshot.py).
 * - records.c: the record types the probes build, laid out by field name from the types
 *   (kvtrace/events.py is the one source of their field order).
 * - module.c: the module, and configure(), which hands the probes their record types and
 *   constants.
 *
 * tests/test_native.py checks each part against its twin.
 */
#ifndef KVTRACE_NATIVE_H
#define KVTRACE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* tp_dealloc of this module's types: heap types with references that `clear` drops. */
static inline void
dealloc_with(PyObject *self, inquiry clear)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

/* --- records the probes build, by field name ------------------------------------------------- */

/* X(Type, FIELDS): each kvtrace.events record type the native core builds; FIELDS(V) names,
 * with V(field), the values it supplies. Where each value goes in the type's constructor is
 * read from the type (its fields, in __struct_fields__ order) by configure(), never written
 * here: kvtrace/events.py is the one source of field order. */
#define RECORD_TYPES(X)                                                                        \
    X(StepStarted, STEP_STARTED)                                                               \
    X(SlotsAllocated, SLOTS_ALLOCATED)                                                         \
    X(BlockStored, BLOCK_STORED)                                                               \
    X(BlockRemoved, BLOCK_REMOVED)                                                             \
    X(HashInterned, HASH_INTERNED)                                                             \
    X(BlockAllocated, BLOCK_ALLOCATED)                                                         \
    X(BlockTouched, BLOCK_TOUCHED)                                                             \
    X(BlockFreed, BLOCK_FREED)                                                                 \
    X(BlocksReleased, BLOCKS_RELEASED)

#define STEP_STARTED(V) V(step) V(ts_ns)
#define SLOTS_ALLOCATED(V) V(req) V(num_new_tokens) V(num_computed_tokens)                    \
    V(num_new_computed_tokens) V(num_lookahead_tokens) V(num_external_computed_tokens)         \
    V(num_tokens) V(success) V(full_sequence_must_fit) V(reserved_blocks) V(has_scheduled_reqs) \
    V(num_in_flight_tokens)
#define BLOCK_STORED(V) V(block_id) V(hash_id) V(group) V(num_tokens) V(kind) V(req)
#define BLOCK_REMOVED(V) V(block_id) V(hash_id) V(group) V(num_tokens) V(reason)
#define HASH_INTERNED(V) V(hash_id) V(hash_bytes)
#define BLOCK_ALLOCATED(V) V(block_id) V(req)
#define BLOCK_TOUCHED(V) V(block_id) V(req)
#define BLOCK_FREED(V) V(block_id) V(ref_cnt) V(hashed)
#define BLOCKS_RELEASED(V) V(block_ids)

/* The most positional arguments a record's constructor gets from the native core. */
#define MAX_RECORD_ARGS 16

/* One record type, laid out by configure(): argument i of its constructor is the native core's
 * value value_of[i] or, where that is -1, default_of[i] (the default of a field it does not
 * supply, before one it does). The fields after the last argument take their own defaults. */
typedef struct {
    const char *name;          /* the kvtrace.events class */
    const char *const *fields; /* the values the native core supplies, in its own order */
    int num_values;
    PyObject *type;            /* NULL until configure() */
    int num_args;
    int in_order;              /* argument i is value i: the values go as they are */
    signed char value_of[MAX_RECORD_ARGS];
    PyObject *default_of[MAX_RECORD_ARGS];
} RecordType;

#define RECORD_ID(type, fields) type##_RECORD,
enum RecordId { RECORD_TYPES(RECORD_ID) NUM_RECORD_TYPES };
#undef RECORD_ID

extern RecordType record_types[NUM_RECORD_TYPES];

/* TypeValues: a record's values, named by field (a union, so they are also an array). */
#define VALUE_MEMBER(field) PyObject *field;
#define FIELD_COUNT(field) +1
#define RECORD_VALUES(type, fields)                                                            \
    typedef union {                                                                            \
        struct { fields(VALUE_MEMBER) };                                                       \
        PyObject *values[0 fields(FIELD_COUNT)];                                               \
    } type##Values;
RECORD_TYPES(RECORD_VALUES)
#undef RECORD_VALUES

/* A new record of `type` (a new reference), or NULL with an error; its values by field name,
 * every one given: NEW_RECORD(StepStarted, .step = step, .ts_ns = ts_ns). Borrows them. */
#define NEW_RECORD(type, ...) \
    new_record(&record_types[type##_RECORD], (type##Values){__VA_ARGS__}.values)

static inline PyObject *
new_record(const RecordType *record, PyObject *const *values)
{
    if (record->type == NULL) {
        return PyErr_Format(PyExc_RuntimeError, "kvtrace._native: configure() first");
    }
    if (record->in_order) {
        return PyObject_Vectorcall(record->type, values, record->num_args, NULL);
    }
    PyObject *args[MAX_RECORD_ARGS];
    for (int i = 0; i < record->num_args; i++) {
        args[i] = record->value_of[i] < 0 ? record->default_of[i] : values[record->value_of[i]];
    }
    return PyObject_Vectorcall(record->type, args, record->num_args, NULL);
}

/* --- the parts -------------------------------------------------------------------------------- */

/* records.c */
int records_configure(PyObject *types);

/* probes.c */
int probes_add_types(PyObject *module);
void probes_configure(PyObject *no_req, PyObject *stale_checkpoint, PyObject *lru_reuse);
PyObject *probes_changed(PyObject *module, PyObject *unused);

/* probe_state.c */
PyObject *intern_hashes(PyObject *module, PyObject *args);

/* step_buffer.c */
int step_buffer_add_type(PyObject *module);

/* frames.c */
void frames_init(void);
PyObject *write_rows_frame(PyObject *module, PyObject *args);

/* snapshot.c */
int snapshot_init(void);
PyObject *snapshot_pool(PyObject *module, PyObject *args);

#endif
