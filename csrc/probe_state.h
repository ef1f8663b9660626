/* ProbeState (probe_state.c), CacheProbes' base class: the fields the Python probes and the
 * fast paths (probes.c) both use, and the helpers the fast paths use them through: called per
 * wrapped call or per block, those are static inline here. Private to csrc/ (kvtrace_native.h
 * lists the parts).
 */
#ifndef KVTRACE_PROBE_STATE_H
#define KVTRACE_PROBE_STATE_H

#include "kvtrace_native.h"

#if PY_VERSION_HEX >= 0x030D0000
#define LOOKUP_ATTR PyObject_GetOptionalAttr
#else
#define LOOKUP_ATTR _PyObject_LookupAttr
#endif

/* --- ProbeState ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *records;        /* _records: list of records held until flushed */
    PyObject *req;            /* _req: the current request's number, or _NO_REQ */
    PyObject *request;        /* _request: the current vLLM Request, or None */
    PyObject *held;           /* _held: True while records wait */
    PyObject *reqs;           /* _reqs: request id -> (req, hash units reported) */
    PyObject *depth;          /* _depth: hash id -> prefix length in tokens */
    PyObject *step;           /* _step */
    PyObject *announced_step; /* _announced_step: (step, ts_ns) or None */
    PyObject *remove_reason;  /* _remove_reason */
    PyObject *store_kind;     /* _store_kind */
    PyObject *hash_ids;       /* _interned_ids: the interner's bytes -> id dict, or None */
    PyObject *emit_hash_bytes;
    PyObject *sink_many;      /* takes one step's records as a list, or None */
    long long created_ns;
    long long num_failures;
} ProbeState;

/* probe_state.c */
int probe_state_add_type(PyObject *module);
ProbeState *probe_of_pool(PyObject *pool);
ProbeState *probe_of_manager(PyObject *manager);
extern PyObject *s_flush;

/* --- helpers of the fast paths (static inline) ------------------------------------------------ */

/* Clear the pending error unless it is the engine's own stop (not an Exception: a signal
 * handler's SystemExit or KeyboardInterrupt), which stays pending and must reach vLLM:
 * swallowed, the engine would not stop when told. 1 when a stop is pending. */
static inline int
clear_unless_stop(void)
{
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception)) {
        return 1;
    }
    PyErr_Clear();
    return 0;
}

/* A failure of ours: counted, never raised; -1 if it was a stop instead (kept, not counted). */
static inline int
count_failure(ProbeState *probe)
{
    if (clear_unless_stop()) {
        return -1;
    }
    probe->num_failures++;
    return 0;
}

/* Replace a slot's value (steals `value`). */
static inline void
set_field(PyObject **field, PyObject *value)
{
    PyObject *old = *field;
    *field = value;
    Py_XDECREF(old);
}

/* CacheProbes._flush: hand the held records to the sink; with sink_many (a capture), here. */
static inline void
flush(ProbeState *probe)
{
    PyObject *records = probe->records, *result;
    if (PyErr_Occurred()) {
        return; /* a stop met earlier in this call: it goes to vLLM first */
    }
    if (probe->sink_many == NULL || probe->sink_many == Py_None || records == NULL
        || !PyList_CheckExact(records)) {
        result = PyObject_CallMethodNoArgs((PyObject *)probe, s_flush);
    } else if (PyList_GET_SIZE(records) == 0) {
        return;
    } else {
        PyObject *fresh = PyList_New(0);
        if (fresh == NULL) {
            count_failure(probe);
            return;
        }
        probe->records = fresh; /* the sink may keep the old list */
        result = PyObject_CallOneArg(probe->sink_many, records);
        Py_DECREF(records);
    }
    if (result == NULL) {
        count_failure(probe);
    }
    Py_XDECREF(result);
}

static inline void
flush_unless_held(ProbeState *probe)
{
    if (probe->held != Py_True) {
        flush(probe);
    }
}

/* Append a new record (steals it); NULL (a failed constructor) counts as a failure. */
static inline int
append_record(ProbeState *probe, PyObject *record)
{
    if (record == NULL || probe->records == NULL || PyList_Append(probe->records, record) < 0) {
        Py_XDECREF(record);
        count_failure(probe);
        return -1;
    }
    Py_DECREF(record);
    return 0;
}

/* (hash id, group) of a BlockHashWithGroupId (hash bytes + 4-byte big-endian group), interning
 * the hash bytes as events.HashInterner does; a new id is announced by a HashInterned record
 * when the probe emits hash bytes. Returns a new reference to the id, or NULL with an error. */
static inline PyObject *
intern_key(ProbeState *probe, PyObject *key, unsigned long *group)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 4 || !PyDict_CheckExact(probe->hash_ids)) {
        PyErr_SetString(PyExc_TypeError, "kvtrace probes: unexpected block hash key");
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(key);
    Py_ssize_t num_hash_bytes = PyBytes_GET_SIZE(key) - 4;
    *group = ((unsigned long)data[num_hash_bytes] << 24)
             | ((unsigned long)data[num_hash_bytes + 1] << 16)
             | ((unsigned long)data[num_hash_bytes + 2] << 8) | data[num_hash_bytes + 3];
    PyObject *hash_bytes = PyBytes_FromStringAndSize((const char *)data, num_hash_bytes);
    if (hash_bytes == NULL) {
        return NULL;
    }
    PyObject *hash_id = PyDict_GetItemWithError(probe->hash_ids, hash_bytes);
    if (hash_id != NULL) {
        Py_INCREF(hash_id);
        Py_DECREF(hash_bytes);
        return hash_id;
    }
    if (PyErr_Occurred() || (hash_id = PyLong_FromSsize_t(PyDict_GET_SIZE(probe->hash_ids))) == NULL
        || PyDict_SetItem(probe->hash_ids, hash_bytes, hash_id) < 0) {
        Py_XDECREF(hash_id);
        Py_DECREF(hash_bytes);
        return NULL;
    }
    if (probe->emit_hash_bytes == Py_True) {
        append_record(probe, NEW_RECORD(HashInterned, .hash_id = hash_id,
                                        .hash_bytes = hash_bytes));
    }
    Py_DECREF(hash_bytes);
    if (PyErr_Occurred()) { /* a stop */
        Py_CLEAR(hash_id);
    }
    return hash_id;
}

/* _depth.get(hash_id, fallback): borrowed. */
static inline PyObject *
depth_of(ProbeState *probe, PyObject *hash_id, PyObject *fallback)
{
    PyObject *depth = PyDict_GetItemWithError(probe->depth, hash_id);
    return depth != NULL ? depth : (PyErr_Occurred() ? NULL : fallback);
}

#endif
