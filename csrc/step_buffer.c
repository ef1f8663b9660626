/* StepBuffer: a capture's hand-over of one engine step's records to the writer.
 *
 * Called by the probes once per engine step with that step's records. They join `pending`;
 * every BATCH_RECORDS records, or once the oldest has waited MAX_DELAY_NS, the pending records
 * are encoded at once (msgspec, via `encode`: one call for many steps costs far less than one
 * per step) and (number of records, bytes) goes to `chunks`, which the writer thread drains.
 * Counters are in records. When the records do not fit in `capacity`, or drops wait to be
 * marked, `overflow(records)` (Python) decides what to keep. kvtrace/capture/step_buffer.py has its
 * twin, which has the constants.
 */
#include "kvtrace_native.h"

#include <time.h>

typedef struct {
    PyObject_HEAD
    PyObject *chunks;
    PyObject *pending;
    PyObject *encode;
    PyObject *overflow;
    Py_ssize_t capacity, num_buffered, num_drained, num_enqueued, unmarked_drops;
    Py_ssize_t batch_records;
    long long max_delay_ns, pending_since_ns;
    vectorcallfunc vectorcall;
} StepBuffer;

static long long
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* Encode the pending records into one chunk. */
static int
step_buffer_encode_pending(StepBuffer *self)
{
    Py_ssize_t num_records = PyList_GET_SIZE(self->pending);
    if (num_records == 0) {
        return 0;
    }
    PyObject *encoded = PyObject_CallOneArg(self->encode, self->pending);
    if (encoded == NULL) {
        return -1;
    }
    PyObject *fresh = PyList_New(0);
    PyObject *size = PyLong_FromSsize_t(num_records);
    PyObject *chunk = size == NULL || fresh == NULL ? NULL : PyTuple_Pack(2, size, encoded);
    Py_XDECREF(size);
    Py_DECREF(encoded);
    if (chunk == NULL || PyList_Append(self->chunks, chunk) < 0) {
        Py_XDECREF(chunk);
        Py_XDECREF(fresh);
        return -1;
    }
    Py_DECREF(chunk);
    Py_SETREF(self->pending, fresh);
    return 0;
}

static PyObject *
step_buffer_call(StepBuffer *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "StepBuffer takes one list of records");
        return NULL;
    }
    PyObject *records = args[0];
    Py_ssize_t num_records = PyList_GET_SIZE(records);
    if (self->unmarked_drops
        || self->num_buffered - self->num_drained + num_records > self->capacity) {
        return PyObject_CallOneArg(self->overflow, records);
    }
    long long now = monotonic_ns();
    if (PyList_GET_SIZE(self->pending) == 0) {
        self->pending_since_ns = now;
    }
    if (PyList_SetSlice(self->pending, PY_SSIZE_T_MAX, PY_SSIZE_T_MAX, records) < 0) {
        return NULL;
    }
    self->num_buffered += num_records;
    self->num_enqueued += num_records;
    if ((PyList_GET_SIZE(self->pending) >= self->batch_records
         || now - self->pending_since_ns >= self->max_delay_ns)
        && step_buffer_encode_pending(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
step_buffer_flush(StepBuffer *self, PyObject *unused)
{
    if (step_buffer_encode_pending(self) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
step_buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *encode, *overflow;
    Py_ssize_t capacity, batch_records;
    double max_delay_s;
    static char *keywords[] = {"encode", "capacity", "overflow", "batch_records", "max_delay_s",
                               NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnOnd:StepBuffer", keywords, &encode,
                                     &capacity, &overflow, &batch_records, &max_delay_s)) {
        return NULL;
    }
    StepBuffer *self = (StepBuffer *)type->tp_alloc(type, 0);
    if (self == NULL || (self->chunks = PyList_New(0)) == NULL
        || (self->pending = PyList_New(0)) == NULL) {
        Py_XDECREF(self);
        return NULL;
    }
    self->encode = Py_NewRef(encode);
    self->overflow = Py_NewRef(overflow);
    self->capacity = capacity;
    self->batch_records = batch_records;
    self->max_delay_ns = (long long)(max_delay_s * 1e9);
    self->vectorcall = (vectorcallfunc)step_buffer_call;
    return (PyObject *)self;
}

static int
step_buffer_traverse(StepBuffer *self, visitproc visit, void *arg)
{
    Py_VISIT(self->chunks);
    Py_VISIT(self->pending);
    Py_VISIT(self->encode);
    Py_VISIT(self->overflow);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
step_buffer_clear(StepBuffer *self)
{
    Py_CLEAR(self->chunks);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->encode);
    Py_CLEAR(self->overflow);
    return 0;
}

static void
step_buffer_dealloc(PyObject *self)
{
    dealloc_with(self, (inquiry)step_buffer_clear);
}

static PyMemberDef step_buffer_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(StepBuffer, vectorcall), READONLY, NULL},
    {"chunks", T_OBJECT, offsetof(StepBuffer, chunks), READONLY, NULL},
    {"capacity", T_PYSSIZET, offsetof(StepBuffer, capacity), 0, NULL},
    {"num_buffered", T_PYSSIZET, offsetof(StepBuffer, num_buffered), 0, NULL},
    {"num_drained", T_PYSSIZET, offsetof(StepBuffer, num_drained), 0, NULL},
    {"num_enqueued", T_PYSSIZET, offsetof(StepBuffer, num_enqueued), 0, NULL},
    {"unmarked_drops", T_PYSSIZET, offsetof(StepBuffer, unmarked_drops), 0, NULL},
    {NULL},
};

static PyMethodDef step_buffer_methods[] = {
    {"flush", (PyCFunction)step_buffer_flush, METH_NOARGS, "Encode the pending records now."},
    {NULL},
};

static PyType_Slot step_buffer_slots[] = {
    {Py_tp_doc, "StepBuffer(encode, capacity, overflow, batch_records, max_delay_s): a "
                "capture's per-step hand-over."},
    {Py_tp_methods, step_buffer_methods},
    {Py_tp_new, step_buffer_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_members, step_buffer_members},
    {Py_tp_traverse, step_buffer_traverse},
    {Py_tp_clear, step_buffer_clear},
    {Py_tp_dealloc, step_buffer_dealloc},
    {0, NULL},
};

static PyType_Spec step_buffer_spec = {
    "kvtrace._native.StepBuffer", sizeof(StepBuffer), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, step_buffer_slots,
};

int
step_buffer_add_type(PyObject *module)
{
    PyObject *type = PyType_FromSpec(&step_buffer_spec);
    int added = type == NULL ? -1 : PyModule_AddObjectRef(module, "StepBuffer", type);
    Py_XDECREF(type);
    return added;
}
