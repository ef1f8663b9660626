/* The record types the native core builds (kvtrace_native.h's RECORD_TYPES), laid out by
 * configure(): where each value goes in its type's constructor, read from the type by field
 * name (kvtrace/events.py is the one source of field order).
 */
#include "kvtrace_native.h"

#include <string.h>

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

/* Lay out every record type from `types` (a tuple whose first NUM_RECORD_TYPES items are the
 * kvtrace.events types, in RECORD_TYPES order); -1 with a TypeError or ValueError, and nothing
 * changed, if one cannot be built by field name. */
int
records_configure(PyObject *types)
{
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
        if (lay_out(record, PyTuple_GET_ITEM(types, num_laid_out), struct_fields, nodefault) < 0) {
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
        return -1;
    }
    for (int i = 0; i < NUM_RECORD_TYPES; i++) {
        clear_layout(&record_types[i]);
    }
    memcpy(record_types, laid_out, sizeof(laid_out));
    return 0;
}
