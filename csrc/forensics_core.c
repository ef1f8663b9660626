/* kvtrace._forensics_core: the streaming pass of `kvtrace load` and `kvtrace why` over a trace's
 * record batches, in C (kvtrace/analysis/stream.py drives it).
 *
 * One pass follows the cache record by record and makes three things:
 *
 * - the miss attribution: for every admitted lookup, where its query tokens went. This is the C
 *   twin of kvtrace/analysis/attributor.py's MissAttributor (the reference: same names, same
 *   steps, function for function); tests/test_attribution.py holds the two row for row.
 * - the cache entries (a key stored on a block, until removed) with the hits each took and, for
 *   a removal, how many transient checkpoint entries sat cached in the free queue just before
 *   it, as the SQL twin in kvtrace/analysis/database.py (CACHE_ENTRIES_SQL) defines them;
 * - the rows of the record tables themselves (kinds whose fields are ints, int lists, strings or
 *   bytes: all but the snapshot's maps), as the loader's Python twin (kvtrace/analysis/load.py,
 *   _RunSink) makes them.
 *
 * All come out as int64 columns (int32 where the database stores 32 bits, a list for strings)
 * (take_tables); `why` takes whole lookups
 * instead (take_lookups). Batches come in as kinds (one byte per record, an index into the
 * batch's kinds), per batch kind its index in kvtrace.events.RECORD_TYPES (the records spec
 * given at construction says how each is read) and its columns as the reader decoded them:
 * ints as any buffer of 1, 2, 4 or 8-byte ints (or a list of ints), a list field as a
 * traceio.ListColumn (lengths, values), strings as a list. Python's floor division and modulo
 * are spelled out (floordiv) where an operand can be negative.
 *
 * The state that grows with the trace (a key per hash id and group ever stored, the removal that
 * took each one's last copy, the sets of hash ids, each request's admissions) lives in
 * containers.h's chunked arrays, which spill to the file the caller gives (stream.new_pass's
 * spill_dir): the pass holds a bounded share of it in memory whatever the trace's length.
 *
 * Nothing is agreed on by position with Python: the record kinds and their fields, the causes,
 * the output columns, the geometry and the enum values are handed over by name at construction,
 * and the core finds the ones it uses (csrc/forensics.h names them) or refuses to start; the
 * module publishes the fields of the lookups' tuples by name (LOOKUP_FIELDS, ...).
 *
 * This file holds the type, the batches and the tables; forensics_records.c follows the cache
 * record by record, forensics_lookup.c attributes one lookup (csrc/forensics.h).
 */

#include "forensics.h"

/* --- input columns ------------------------------------------------------------------------------ */

int col_open(Col *c, PyObject *obj) {
    memset(c, 0, sizeof(*c));
    if (PyList_Check(obj)) {
        c->list = obj;
        return 0;
    }
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    c->open = 1;
    const char *format = c->view.format ? c->view.format : "B";
    if (*format == '<' || *format == '=' || *format == '@') format++;
    c->itemsize = (int)c->view.itemsize;
    c->is_unsigned = *format == '?' || *format == 'B' || *format == 'H' || *format == 'I'
                     || *format == 'L' || *format == 'Q';
    if (c->view.ndim > 1 || !strchr("bBhHiIlLqQ?", *format) || format[1]
        || (c->itemsize != 1 && c->itemsize != 2 && c->itemsize != 4 && c->itemsize != 8)) {
        PyErr_Format(PyExc_TypeError, "forensics core: a column of '%s' is not an int column",
                     c->view.format ? c->view.format : "?");
        return -1;
    }
    return 0;
}
void col_close(Col *c) {
    if (c->open) PyBuffer_Release(&c->view);
    c->open = 0;
}

/* --- output columns ------------------------------------------------------------------------------ */

static int table_init(Table *t, int num_columns) {
    t->columns = PyMem_Calloc((size_t)num_columns, sizeof(LVec));
    t->objects = PyMem_Calloc((size_t)num_columns, sizeof(PyObject *));
    t->narrow = PyMem_Calloc((size_t)num_columns, 1);
    t->num_columns = num_columns;
    return t->columns && t->objects && t->narrow ? 0 : (PyErr_NoMemory(), -1);
}
static void table_free(Table *t) {
    for (int i = 0; i < t->num_columns; i++) {
        lvec_free(&t->columns[i]);
        if (t->objects) Py_CLEAR(t->objects[i]);
    }
    PyMem_Free(t->columns);
    PyMem_Free(t->objects);
    PyMem_Free(t->narrow);
    t->columns = NULL;
    t->objects = NULL;
    t->narrow = NULL;
}
static Py_ssize_t table_rows(const Table *t) { return t->num_columns ? t->columns[0].n : 0; }
/* A narrow column's first `count` values as int32 bytes; a value past 32 bits raises
   OverflowError((table, column, value)). */
static PyObject *narrowed(const LVec *column, Py_ssize_t count, int table, int index) {
    PyObject *data = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int32_t));
    if (!data) return NULL;
    int32_t *out = (int32_t *)PyBytes_AS_STRING(data);
    for (Py_ssize_t row = 0; row < count; row++) {
        i64 value = column->v[row];
        if (value < INT32_MIN || value > INT32_MAX) {
            Py_DECREF(data);
            PyObject *where = Py_BuildValue("(iiL)", table, index, value);
            if (where) PyErr_SetObject(PyExc_OverflowError, where);
            Py_XDECREF(where);
            return NULL;
        }
        out[row] = (int32_t)value;
    }
    return data;
}
/* The table's first `count` rows (all: count 0) as a tuple of columns (bytes of native int64s,
   NONE_VALUE for NULL, or of int32s for a narrow column; a list for a column of objects),
   taken out. `index`: the table's, as take_tables numbers them. */
static PyObject *table_take(Table *t, Py_ssize_t count, int index) {
    Py_ssize_t rows = table_rows(t);
    if (count <= 0 || count > rows) count = rows;
    PyObject *out = PyTuple_New(t->num_columns);
    if (!out) return NULL;
    for (int i = 0; i < t->num_columns; i++) {  /* every column checked before any is taken */
        LVec *column = &t->columns[i];
        PyObject *data = t->objects[i] ? PyList_GetSlice(t->objects[i], 0, count)
                       : t->narrow[i] ? narrowed(column, count, index, i)
                       : PyBytes_FromStringAndSize((const char *)column->v,
                                                   count * (Py_ssize_t)sizeof(i64));
        if (!data) { Py_DECREF(out); return NULL; }
        PyTuple_SET_ITEM(out, i, data);
    }
    for (int i = 0; i < t->num_columns; i++) {
        LVec *column = &t->columns[i];
        if (t->objects[i]) {
            if (PyList_SetSlice(t->objects[i], 0, count, NULL)) { Py_DECREF(out); return NULL; }
            continue;
        }
        memmove(column->v, column->v + count, (size_t)(column->n - count) * sizeof(i64));
        column->n -= count;
    }
    return out;
}

/* The output table numbered `t` as take_tables numbers them: the record tables, then the
   attribution's rows, then the cache entries' figures. */
static Table *table_at(ForensicsCore *c, int t) {
    return t < c->num_tables ? &c->tables[t] : t == c->num_tables ? &c->rows : &c->entry_rows;
}

/* --- the record tables ------------------------------------------------------------------- */

/* A batch kind's columns, as this pass reads them: its attribution kind's (Source) and, for a
   kind whose rows it makes (spec->shape), every field's. */
typedef struct {
    const RecordSpec *spec;
    Source source;
    Col fields[MAX_FIELDS], values[MAX_FIELDS];  /* values: a list field's elements */
    Py_ssize_t shaped;  /* the rows its records began this batch (shape_start) */
} Kind;

/* A record's row begins: its seq and step, in file order. Its fields follow in bulk, once the
   batch was followed (shape_rows). */
static int shape_start(ForensicsCore *c, Kind *k) {
    Table *table = &c->tables[k->spec->table];
    if (lvec_push(&table->columns[0], c->seq) || lvec_push(&table->columns[1], c->step))
        return -1;
    k->shaped++;
    return 0;
}

/* A column's first `count` values, appended to `out` as int64s. */
static int col_append(LVec *out, const Col *col, Py_ssize_t count) {
    if (lvec_reserve(out, out->n + count)) return -1;
    i64 *to = out->v + out->n;
    const char *from = col->view.buf;
    if (col->list) {
        for (Py_ssize_t i = 0; i < count; i++) {
            to[i] = PyLong_AsLongLong(PyList_GET_ITEM(col->list, i));
            if (to[i] == -1 && PyErr_Occurred()) return -1;  /* an item that is no int */
        }
    } else if (col->itemsize == 8) {
        memcpy(to, from, (size_t)count * sizeof(i64));
    } else {  /* one loop per width, each a plain widening copy */
#define WIDEN(type) for (Py_ssize_t i = 0; i < count; i++) to[i] = ((const type *)from)[i]
        switch (col->itemsize * 2 + col->is_unsigned) {
        case 2: WIDEN(int8_t); break;
        case 3: WIDEN(uint8_t); break;
        case 4: WIDEN(int16_t); break;
        case 5: WIDEN(uint16_t); break;
        case 8: WIDEN(int32_t); break;
        default: WIDEN(uint32_t); break;
        }
#undef WIDEN
    }
    out->n += count;
    return 0;
}

/* The fields of the rows a batch's records of one kind began (shape_start), column by column
   (a list field's length), and their list fields' rows (seq, the record's req or -1, position,
   element). */
static int shape_rows(ForensicsCore *c, Kind *k) {
    const RecordSpec *spec = k->spec;
    Py_ssize_t count = k->shaped;
    if (!count) return 0;
    Table *table = &c->tables[spec->table];
    const i64 *seqs = table->columns[0].v + table->columns[0].n - count;
    int child = spec->table + 1;
    for (int f = 0; f < spec->num_fields; f++) {
        if (spec->field_kinds[f] == 's') {
            PyObject *objects = table->objects[2 + f];
            PyObject *taken = PyList_GetSlice(k->fields[f].list, 0, count);
            Py_ssize_t end = PyList_GET_SIZE(objects);
            int rc = !taken || PyList_SetSlice(objects, end, end, taken);
            Py_XDECREF(taken);
            if (rc) return -1;
            continue;
        }
        LVec *column = &table->columns[2 + f];
        if (col_append(column, &k->fields[f], count)) return -1;
        if (spec->field_kinds[f] != 'l') continue;
        Table *children = &c->tables[child++];
        const i64 *lengths = column->v + column->n - count;
        Py_ssize_t total = 0;
        for (Py_ssize_t row = 0; row < count; row++) total += (Py_ssize_t)lengths[row];
        for (int i = 0; i < 3; i++)
            if (lvec_reserve(&children->columns[i], children->columns[i].n + total)) return -1;
        i64 *seq = children->columns[0].v + children->columns[0].n;
        i64 *req = children->columns[1].v + children->columns[1].n;
        i64 *pos = children->columns[2].v + children->columns[2].n;
        for (Py_ssize_t row = 0, at = 0; row < count; row++) {
            i64 owner = spec->req_field >= 0 ? col_get(&k->fields[spec->req_field], row) : -1;
            for (i64 p = 0; p < lengths[row]; p++, at++) {
                seq[at] = seqs[row];
                req[at] = owner;
                pos[at] = p;
            }
        }
        for (int i = 0; i < 3; i++) children->columns[i].n += total;
        if (col_append(&children->columns[3], &k->values[f], total)) return -1;
    }
    return 0;
}

static int open_kind(Kind *k, const RecordSpec *spec, PyObject *columns, Py_ssize_t needed) {
    memset(k, 0, sizeof(*k));
    k->spec = spec;
    k->source.code = spec->kind;
    if (!PyList_Check(columns) || PyList_GET_SIZE(columns) < spec->num_fields)
        return fail("feed: a kind with %d fields", spec->num_fields);
    /* a list field's two columns, checked: every row's elements are there */
    for (int f = 0; f < spec->num_fields; f++) {
        PyObject *column = PyList_GET_ITEM(columns, f);
        if (spec->field_kinds[f] == 's' || spec->field_kinds[f] == 'o') {
            if (!PyList_Check(column) || PyList_GET_SIZE(column) < needed)
                return fail("feed: a short column");
            k->fields[f].list = column;
            continue;
        }
        if (spec->field_kinds[f] == 'l') {
            PyObject *lengths = PyObject_GetAttrString(column, "lengths");
            PyObject *values = lengths ? PyObject_GetAttrString(column, "values") : NULL;
            int rc = !values || col_open(&k->fields[f], lengths) || col_open(&k->values[f], values);
            Py_XDECREF(lengths);
            Py_XDECREF(values);
            if (rc) return -1;
            i64 total = 0;
            if (col_len(&k->fields[f]) < needed) return fail("feed: a short column");
            for (Py_ssize_t row = 0; row < needed; row++) {
                i64 length = col_get(&k->fields[f], row);
                if (length < 0) return fail("feed: a negative list length");
                total += length;
            }
            if (col_len(&k->values[f]) < total) return fail("feed: a short list column");
            continue;
        }
        if (col_open(&k->fields[f], column)) return -1;
        if (col_len(&k->fields[f]) < needed) return fail("feed: a short column");
    }
    /* the attribution kind's columns: the same, in its order */
    Source *s = &k->source;
    for (int a = 0; spec->kind >= 0 && a < spec->num_read; a++) {
        int f = spec->read[a];
        Col *field = &k->fields[f];
        s->cols[s->num_cols] = *field;
        s->cols[s->num_cols++].open = 0;  /* borrowed: closed once, as the field */
        if (spec->field_kinds[f] == 'l') {
            s->cols[s->num_cols] = k->values[f];
            s->cols[s->num_cols++].open = 0;
        }
    }
    return 0;
}

static void close_kind(Kind *k) {
    for (int f = 0; f < MAX_FIELDS; f++) {
        col_close(&k->fields[f]);
        col_close(&k->values[f]);
    }
}

static PyObject *refuse_broken(void) {
    PyErr_SetString(PyExc_RuntimeError, "forensics core: a batch failed; the pass is over");
    return NULL;
}

/* feed(kinds, first_seq, records, columns): follow one batch of records, in file order.
   records: per batch kind, its index in the records spec (255: unknown); columns:
   per batch kind, its columns as the reader decoded them. */
static PyObject *Core_feed(ForensicsCore *c, PyObject *args) {
    Py_buffer kinds, records;
    long long first_seq;
    PyObject *columns;
    if (c->broken) return refuse_broken();
    if (!PyArg_ParseTuple(args, "y*Ly*O!", &kinds, &first_seq, &records, &PyList_Type, &columns))
        return NULL;
    Py_ssize_t num_kinds = records.len;
    Kind *batch = PyMem_Calloc((size_t)num_kinds + 1, sizeof(Kind));
    Py_ssize_t *needed = PyMem_Calloc((size_t)num_kinds + 1, sizeof(Py_ssize_t));
    int rc = batch && needed ? 0 : (PyErr_NoMemory(), -1);
    const unsigned char *kind = kinds.buf, *record = records.buf;
    if (!rc && PyList_GET_SIZE(columns) != num_kinds)
        rc = fail("feed: %zd column lists for %zd kinds", PyList_GET_SIZE(columns), num_kinds);
    for (Py_ssize_t i = 0; i < kinds.len && !rc; i++) {
        if (kind[i] >= num_kinds) rc = fail("feed: a record of kind %d", kind[i]);
        else needed[kind[i]]++;
    }
    for (Py_ssize_t i = 0; i < num_kinds && !rc; i++) {
        batch[i].source.code = -1;
        if (record[i] < c->num_specs && (c->specs[record[i]].kind >= 0
                                         || c->specs[record[i]].shape))
            rc = open_kind(&batch[i], &c->specs[record[i]], PyList_GET_ITEM(columns, i),
                           needed[i]);
    }
    i64 seq = first_seq;
    for (Py_ssize_t i = 0; i < kinds.len && !rc; i++, seq++) {
        Kind *k = &batch[kind[i]];
        if (!k->spec) continue;
        c->seq = seq;
        Py_ssize_t row = k->source.row;
        if (k->spec->kind >= 0) {
            rc = c->attribute ? follow_record(c, &k->source) : 0;
            k->source.row = row + 1;
        } else {
            k->source.row = row + 1;
        }
        if (!rc && k->spec->kind == K_STEP && !c->attribute) c->step++;
        if (!rc && k->spec->shape && c->make_tables) rc = shape_start(c, k);
        if (!rc && PyErr_Occurred()) rc = -1;  /* a list column item that is no int */
    }
    for (Py_ssize_t i = 0; i < num_kinds && !rc; i++)
        if (batch[i].spec && batch[i].spec->shape) rc = shape_rows(c, &batch[i]);
    c->broken |= rc != 0;
    for (Py_ssize_t i = 0; batch && i < num_kinds; i++) close_kind(&batch[i]);
    PyMem_Free(batch);
    PyMem_Free(needed);
    PyBuffer_Release(&kinds);
    PyBuffer_Release(&records);
    if (rc) return NULL;
    spill_trim(&c->spill);
    Py_RETURN_NONE;
}

/* take_tables(chunk): [(table, columns as int64 bytes)], every whole chunk of `chunk` rows of
   every table (0: all of every table), taken out. Tables: the record tables, then the
   attribution's rows, then the cache entries' figures. */
static PyObject *Core_take_tables(ForensicsCore *c, PyObject *arg) {
    if (c->broken) return refuse_broken();
    Py_ssize_t chunk = PyLong_AsSsize_t(arg);
    if (chunk == -1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(0);
    for (int t = 0; out && t < c->num_tables + 2; t++) {
        Table *table = table_at(c, t);
        while (out && table_rows(table) && table_rows(table) >= (chunk > 0 ? chunk : 1)) {
            PyObject *columns = table_take(table, chunk, t);
            PyObject *item = columns ? Py_BuildValue("(iN)", t, columns) : NULL;
            if (!item || PyList_Append(out, item)) Py_CLEAR(out);
            Py_XDECREF(item);
        }
    }
    return out;
}

/* finish(): the entries still open when the trace ends (never removed) become rows. */
static PyObject *Core_finish(ForensicsCore *c, PyObject *unused) {
    for (Py_ssize_t index = 0; index < c->num_entries; index++) {
        Entry *e = &c->entries[index];
        if (e->open && entry_row(c, e, NONE_VALUE, NONE_VALUE, NONE_VALUE, NONE_VALUE))
            return NULL;
        e->open = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *Core_take_lookups(ForensicsCore *c, PyObject *unused) {
    PyObject *lookups = c->lookups;
    c->lookups = PyList_New(0);
    if (!c->lookups) { c->lookups = lookups; return NULL; }
    return lookups;
}
static PyObject *Core_dropped_events(ForensicsCore *c, void *closure) {
    return PyLong_FromLongLong(c->dropped_events);
}
static PyObject *Core_spill(ForensicsCore *c, void *closure) {
    return Py_BuildValue("(Ln)", c->spill.end, c->spill.trims);
}

/* --- the type ----------------------------------------------------------------------------- */

static int int_tuple(PyObject *tuple, int *out, int *count) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > MAX_GROUPS) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of at most 64 ints");
        return -1;
    }
    *count = (int)PyTuple_GET_SIZE(tuple);
    for (int i = 0; i < *count; i++) {
        long value = PyLong_AsLong(PyTuple_GET_ITEM(tuple, i));
        if (value == -1 && PyErr_Occurred()) return -1;
        out[i] = (int)value;
    }
    return 0;
}

#define FORENSICS_TAG(code, tag, ...) tag,
static const char *const kind_tags[NUM_KINDS] = {FORENSICS_KINDS(FORENSICS_TAG)};
#define FORENSICS_READ(code, tag, ...) (const char *const[]){__VA_ARGS__},
static const char *const *const kind_reads[NUM_KINDS] = {FORENSICS_KINDS(FORENSICS_READ)};
#define FORENSICS_NAME(code, name, ...) name,
static const char *const cause_names[NUM_CAUSES] = {FORENSICS_CAUSES(FORENSICS_NAME)};
#define FORENSICS_SHORTFALL(code, name, in_shortfall) in_shortfall,
static const int cause_in_shortfall[NUM_CAUSES] = {FORENSICS_CAUSES(FORENSICS_SHORTFALL)};
static const char *const row_column_names[NUM_A] = {FORENSICS_ROW_COLUMNS(FORENSICS_NAME)};
static const char *const entry_column_names[NUM_E] = {FORENSICS_ENTRY_COLUMNS(FORENSICS_NAME)};

/* Python and this core disagree on a name (a kind, a field, a cause, a column, an enum value):
   a bug on one side, never a trace's fault, so not a ValueError (which stream.py reads as one). */
static int mismatch(const char *format, ...) {
    va_list ap;
    va_start(ap, format);
    PyObject *message = PyUnicode_FromFormatV(format, ap);
    va_end(ap);
    if (message) PyErr_Format(PyExc_RuntimeError, "forensics core: %U", message);
    Py_XDECREF(message);
    return -1;
}

/* Where `name` is in the tuple of str `names`, or -1. */
static int index_of(PyObject *names, const char *name) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        PyObject *item = PyTuple_GET_ITEM(names, i);
        if (PyUnicode_Check(item) && PyUnicode_CompareWithASCIIString(item, name) == 0)
            return (int)i;
    }
    return -1;
}

/* Each of `wanted`'s names' place in `names`, which must hold exactly them (in any order). */
static int place_names(PyObject *names, const char *const *wanted, int num_wanted, int *places,
                       const char *what) {
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != num_wanted)
        return mismatch("%s: a tuple of %d names", what, num_wanted);
    for (int i = 0; i < num_wanted; i++)
        if ((places[i] = index_of(names, wanted[i])) < 0)
            return mismatch("%s: no '%s'", what, wanted[i]);
    return 0;
}

/* records: per record kind, (tag, field names, field kinds, whether its rows go to tables). The
   kinds the attribution reads are found by tag, and the fields it reads by name. */
static int parse_specs(ForensicsCore *c, PyObject *records) {
    if (!PyTuple_Check(records)) {
        PyErr_SetString(PyExc_TypeError, "records must be a tuple");
        return -1;
    }
    c->num_specs = (int)PyTuple_GET_SIZE(records);
    c->specs = PyMem_Calloc((size_t)c->num_specs + 1, sizeof(RecordSpec));
    if (!c->specs) { PyErr_NoMemory(); return -1; }
    int found[NUM_KINDS] = {0};
    for (int r = 0; r < c->num_specs; r++) {
        RecordSpec *spec = &c->specs[r];
        PyObject *tag, *names;
        const char *field_kinds;
        Py_ssize_t num_fields;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(records, r), "UO!s#p", &tag, &PyTuple_Type,
                              &names, &field_kinds, &num_fields, &spec->shape))
            return -1;
        if (num_fields > MAX_FIELDS || PyTuple_GET_SIZE(names) != num_fields)
            return mismatch("records: %U: more fields than this core reads", tag);
        spec->num_fields = (int)num_fields;
        memcpy(spec->field_kinds, field_kinds, (size_t)num_fields);
        if (spec->shape && memchr(field_kinds, 'o', (size_t)num_fields))
            return mismatch("records: %U: rows of a kind with a field of objects", tag);
        spec->req_field = index_of(names, "req");
        spec->kind = -1;
        for (int k = 0; k < NUM_KINDS; k++)
            if (PyUnicode_CompareWithASCIIString(tag, kind_tags[k]) == 0) spec->kind = k;
        if (spec->kind >= 0) {
            if (found[spec->kind]++) return mismatch("records: %U twice", tag);
            int columns = 0;
            for (const char *const *name = kind_reads[spec->kind]; *name; name++) {
                int f = index_of(names, *name);
                if (f < 0) return mismatch("records: %U has no field '%s'", tag, *name);
                spec->read[spec->num_read++] = f;
                columns += field_kinds[f] == 'l' ? 2 : 1;
            }
            if (columns > MAX_READ * 2) return mismatch("records: %U: too many columns", tag);
        }
        spec->table = -1;
        if (spec->shape) {
            spec->table = c->num_tables;
            c->num_tables += 1;
            for (int f = 0; f < spec->num_fields; f++) c->num_tables += field_kinds[f] == 'l';
        }
    }
    for (int k = 0; k < NUM_KINDS; k++)
        if (!found[k]) return mismatch("records: no kind '%s'", kind_tags[k]);
    c->tables = PyMem_Calloc((size_t)c->num_tables + 1, sizeof(Table));
    if (!c->tables) { PyErr_NoMemory(); return -1; }
    for (int r = 0; r < c->num_specs; r++) {
        RecordSpec *spec = &c->specs[r];
        if (!spec->shape) continue;
        Table *table = &c->tables[spec->table];
        if (table_init(table, 2 + spec->num_fields)) return -1;
        for (int f = 0; f < spec->num_fields; f++)
            if (spec->field_kinds[f] == 's' && !(table->objects[2 + f] = PyList_New(0))) return -1;
        int child = spec->table + 1;
        for (int f = 0; f < spec->num_fields; f++)
            if (spec->field_kinds[f] == 'l' && table_init(&c->tables[child++], 4)) return -1;
    }
    return 0;
}

/* causes: per cause, (name, whether it is in the shortfall), in Python's order: a cause's value
   in the rows is its index there, and the shortfall causes' order is the waterfall's. */
static int parse_causes(ForensicsCore *c, PyObject *causes) {
    if (!PyTuple_Check(causes) || PyTuple_GET_SIZE(causes) != NUM_CAUSES)
        return mismatch("causes: a tuple of the %d causes", NUM_CAUSES);
    PyObject *names = PyTuple_New(NUM_CAUSES);
    if (!names) return -1;
    for (int i = 0; i < NUM_CAUSES; i++) {
        PyObject *cause = PyTuple_GET_ITEM(causes, i);
        if (!PyTuple_Check(cause) || PyTuple_GET_SIZE(cause) != 2) {
            Py_DECREF(names);
            return mismatch("causes: (name, in_shortfall) pairs");
        }
        PyTuple_SET_ITEM(names, i, Py_NewRef(PyTuple_GET_ITEM(cause, 0)));
    }
    int rc = place_names(names, cause_names, NUM_CAUSES, c->cause_value, "causes");
    Py_DECREF(names);
    if (rc) return -1;
    c->present = 0;
    for (int i = 0; i < NUM_CAUSES; i++) {  /* levels in Python's order */
        for (int code = 0; code < NUM_CAUSES; code++) {
            if (c->cause_value[code] != i) continue;
            int in_shortfall = PyObject_IsTrue(PyTuple_GET_ITEM(PyTuple_GET_ITEM(causes, i), 1));
            if (in_shortfall < 0) return -1;
            if (in_shortfall != cause_in_shortfall[code])
                return mismatch("causes: '%s' is %sin the shortfall here", cause_names[code],
                            cause_in_shortfall[code] ? "" : "not ");
            c->level[code] = in_shortfall ? c->present : -1;
            if (in_shortfall) c->cause_at[c->present++] = code;
        }
    }
    return 0;
}

/* columns: (miss_attribution's column names, cache_entry_figures'), in the order take_tables
   hands them over. */
static int parse_columns(ForensicsCore *c, PyObject *columns) {
    if (!PyTuple_Check(columns) || PyTuple_GET_SIZE(columns) != 2)
        return mismatch("columns: (the attribution's, the cache entries')");
    return place_names(PyTuple_GET_ITEM(columns, 0), row_column_names, NUM_A, c->row_column,
                       "attribution columns")
        || place_names(PyTuple_GET_ITEM(columns, 1), entry_column_names, NUM_E,
                       c->entry_column, "cache entry columns") ? -1 : 0;
}

/* enums: {"Enum.NAME": value} for the values the core compares with. */
static const struct { const char *name; size_t offset; } enum_values[] = {
    {"StoreKind.CHECKPOINT", offsetof(ForensicsCore, checkpoint_kind)},
    {"CheckpointClass.TRANSIENT", offsetof(ForensicsCore, transient_class)},
    {"RemoveReason.LRU_REUSE", offsetof(ForensicsCore, lru_reuse)},
    {"RemoveReason.STALE_CHECKPOINT", offsetof(ForensicsCore, stale_checkpoint)},
    {"RemoveReason.REKEY", offsetof(ForensicsCore, rekey)},
    {"RequestQueue.RUNNING", offsetof(ForensicsCore, running_queue)},
};
static int parse_enums(ForensicsCore *c, PyObject *enums) {
    for (size_t i = 0; i < sizeof(enum_values) / sizeof(enum_values[0]); i++) {
        PyObject *value = PyDict_GetItemString(enums, enum_values[i].name);  /* borrowed */
        if (!value) return mismatch("enums: no '%s'", enum_values[i].name);
        i64 number = PyLong_AsLongLong(value);
        if (number == -1 && PyErr_Occurred()) return -1;
        *(i64 *)((char *)c + enum_values[i].offset) = number;
    }
    return 0;
}

/* Which columns of each table are stored in 32 bits: `narrow`, per table (as take_tables
   numbers them), a tuple of column indices. */
static int parse_narrow(ForensicsCore *c, PyObject *narrow) {
    if (!PyTuple_Check(narrow) || PyTuple_GET_SIZE(narrow) != c->num_tables + 2) {
        PyErr_SetString(PyExc_TypeError, "narrow: a tuple of column indices per table");
        return -1;
    }
    for (int t = 0; t < c->num_tables + 2; t++) {
        Table *table = table_at(c, t);
        int columns[MAX_GROUPS], count;
        if (int_tuple(PyTuple_GET_ITEM(narrow, t), columns, &count)) return -1;
        for (int i = 0; i < count; i++) {
            if (columns[i] < 0 || columns[i] >= table->num_columns || table->objects[columns[i]]) {
                PyErr_SetString(PyExc_ValueError, "narrow: not an int column of its table");
                return -1;
            }
            table->narrow[columns[i]] = 1;
        }
    }
    return 0;
}

/* The geometry's value `name` (borrowed), or NULL with an error. */
static PyObject *geometry_item(PyObject *geometry, const char *name) {
    PyObject *value = PyDict_GetItemString(geometry, name);
    if (!value) mismatch("geometry: no '%s'", name);
    return value;
}
static int geometry_int(PyObject *geometry, const char *name, long long *out) {
    PyObject *value = geometry_item(geometry, name);
    if (!value) return -1;
    *out = PyLong_AsLongLong(value);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* ForensicsCore(records, causes, columns, geometry, enums, request, request_id, explain,
       keep_lookups, make_rows, make_entries, make_tables, narrow, spill)
   records: parse_specs'; causes: parse_causes'; columns: parse_columns'; geometry: None
   (no attribution: a trace without an engine config), or a dict of hit_search.Geometry's
   fields by name, with is_mamba (per group, whether Mamba) and num_blocks (the pool's);
   enums: parse_enums'; request: the one request to
   attribute (None: all); narrow: parse_narrow's; spill: (a file descriptor or -1, the bytes of
   it to hold in memory). */
static int Core_init(ForensicsCore *c, PyObject *args, PyObject *kwargs) {
    PyObject *records, *causes, *columns, *geometry, *enums, *request, *request_id, *narrow;
    int explain, keep_lookups, make_rows, make_entries, spill_fd;
    long long spill_resident;
    if (!PyArg_ParseTuple(args, "O!OOOO!OOpppppO(iL)", &PyTuple_Type, &records, &causes,
                          &columns, &geometry, &PyDict_Type, &enums, &request, &request_id,
                          &explain, &keep_lookups, &make_rows, &make_entries, &c->make_tables,
                          &narrow, &spill_fd, &spill_resident)
        || spill_open(&c->spill, spill_fd, spill_resident) || parse_specs(c, records)
        || parse_causes(c, causes) || parse_columns(c, columns) || parse_enums(c, enums))
        return -1;
    for (int g = 0; g < MAX_GROUPS; g++) {
        id_index_init(&c->keys[g], &c->spill);
        id_index_init(&c->unknown_open[g], &c->spill);
    }
    chunk_init(&c->key_info, sizeof(Key), &c->spill);
    chunk_init(&c->removals, sizeof(Removal), &c->spill);
    chunk_init(&c->examples, sizeof(Examples), &c->spill);
    id_set_init(&c->computed, &c->spill);
    id_set_init(&c->states, &c->spill);
    id_set_init(&c->suppressed, &c->spill);
    id_index_init(&c->admissions, &c->spill);
    id_set_init(&c->in_flight, &c->spill);
    c->attribute = geometry != Py_None;
    c->unit = c->attention_block = c->mamba_block = c->alignment = 1;
    if (c->attribute) {
        PyObject *is_mamba, *attention, *mamba;
        long long unit, attention_block, mamba_block, alignment;
        long long num_gpu_blocks, eagle_drop, eagle_margin;
        if (!PyDict_Check(geometry)) return mismatch("geometry: a dict");
        if (geometry_int(geometry, "unit", &unit)
            || !(is_mamba = geometry_item(geometry, "is_mamba"))
            || !(attention = geometry_item(geometry, "attention_groups"))
            || !(mamba = geometry_item(geometry, "mamba_groups"))
            || geometry_int(geometry, "attention_block", &attention_block)
            || geometry_int(geometry, "mamba_block", &mamba_block)
            || geometry_int(geometry, "alignment", &alignment)
            || geometry_int(geometry, "num_blocks", &num_gpu_blocks)
            || geometry_int(geometry, "eagle_drop", &eagle_drop)
            || geometry_int(geometry, "eagle_margin", &eagle_margin))
            return -1;
        if (eagle_drop < 0 || eagle_margin < 0) {
            PyErr_SetString(PyExc_ValueError, "EAGLE's drop and margin must not be negative");
            return -1;
        }
        if (num_gpu_blocks < 1 || num_gpu_blocks >= MAX_BLOCK_ID) {
            PyErr_SetString(PyExc_ValueError, "its pool must hold 1 to 2^31 - 1 blocks");
            return -1;
        }
        c->num_blocks = (Py_ssize_t)num_gpu_blocks + 1;  /* the unknown block -1 first */
        c->blocks = PyMem_Calloc((size_t)c->num_blocks, sizeof(Block));
        if (!c->blocks) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t b = 0; b < c->num_blocks; b++) {
            c->blocks[b].prev = c->blocks[b].next = -1;
            c->blocks[b].latest_entry = c->blocks[b].open_entries = -1;
        }
        if (unit <= 0 || attention_block <= 0 || mamba_block <= 0 || alignment <= 0) {
            PyErr_SetString(PyExc_ValueError, "block sizes must be positive");
            return -1;
        }
        c->unit = unit;
        c->attention_block = attention_block;
        c->mamba_block = mamba_block;
        c->alignment = alignment;
        c->eagle_drop = eagle_drop;
        c->eagle_margin = eagle_margin;
        if (int_tuple(is_mamba, c->is_mamba, &c->num_groups)
            || int_tuple(attention, c->attention_groups, &c->num_attention)
            || int_tuple(mamba, c->mamba_groups, &c->num_mamba))
            return -1;
    }
    c->all_requests = request == Py_None && request_id == Py_None;
    c->only_request = NO_REQ;
    if (request != Py_None) {
        c->only_request = PyLong_AsLongLong(request);
        if (c->only_request == -1 && PyErr_Occurred()) return -1;
    }
    if (request_id != Py_None) {
        if (!PyUnicode_Check(request_id)) {
            PyErr_SetString(PyExc_TypeError, "request_id must be a str");
            return -1;
        }
        c->request_id = Py_NewRef(request_id);
    }
    c->explain = explain;
    c->keep_lookups = keep_lookups;
    c->make_rows = make_rows && c->attribute;
    c->make_entries = make_entries && c->attribute;
    c->allocating = NO_REQ;
    c->evictable_head = c->evictable_tail = -1;
    c->lookups = PyList_New(0);
    if (!c->lookups || table_init(&c->rows, NUM_A) || table_init(&c->entry_rows, NUM_E))
        return -1;
    return parse_narrow(c, narrow);
}

static void Core_dealloc(ForensicsCore *c) {
    for (size_t i = 0; i < c->requests.cap; i++)
        if (map_used(&c->requests, i)) free_request((Request *)(intptr_t)c->requests.slots[i].val);
    map_clear(&c->requests);
    for (int g = 0; g < MAX_GROUPS; g++) id_index_clear(&c->keys[g]);
    id_set_clear(&c->computed);
    id_set_clear(&c->states);
    id_set_clear(&c->suppressed);
    id_index_clear(&c->admissions);
    id_set_clear(&c->in_flight);
    chunk_free(&c->key_info);
    chunk_free(&c->removals);
    chunk_free(&c->examples);
    PyMem_Free(c->blocks);
    PyMem_Free(c->entries);
    ivec_free(&c->free_entries);
    for (int g = 0; g < MAX_GROUPS; g++) id_index_clear(&c->unknown_open[g]);
    spill_close(&c->spill);
    table_free(&c->rows);
    table_free(&c->entry_rows);
    for (int t = 0; c->tables && t < c->num_tables; t++) table_free(&c->tables[t]);
    PyMem_Free(c->tables);
    PyMem_Free(c->specs);
    lvec_free(&c->attention_levels);
    lvec_free(&c->mamba_levels);
    Py_CLEAR(c->lookups);
    Py_CLEAR(c->request_id);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Core_methods[] = {
    {"feed", (PyCFunction)Core_feed, METH_VARARGS, "Follow one batch of records."},
    {"finish", (PyCFunction)Core_finish, METH_NOARGS, "The trace ended: close the open entries."},
    {"take_tables", (PyCFunction)Core_take_tables, METH_O,
     "[(table, columns)]: every whole chunk of rows of every table (0: all)."},
    {"take_lookups", (PyCFunction)Core_take_lookups, METH_NOARGS,
     "The attributed lookups so far, as tuples (keep_lookups; fields: LOOKUP_FIELDS, ...)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"dropped_events", (getter)Core_dropped_events, NULL, "Records the capture dropped.", NULL},
    {"spill", (getter)Core_spill, NULL, "(bytes of the spill file, trims so far).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtrace._forensics_core.ForensicsCore",
    .tp_basicsize = sizeof(ForensicsCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The streaming pass of kvtrace load and why (see the module).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtrace._forensics_core",
    "The streaming pass of kvtrace load and why, in C (see csrc/forensics_core.c).", -1, NULL,
};

/* The module's tuple of str `attr` from the NULL-terminated `names`. */
static int add_names(PyObject *m, const char *attr, const char *const *names) {
    Py_ssize_t count = 0;
    while (names[count]) count++;
    PyObject *tuple = PyTuple_New(count);
    for (Py_ssize_t i = 0; tuple && i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (!name) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, i, name);
    }
    int rc = tuple ? PyModule_AddObjectRef(m, attr, tuple) : -1;
    Py_XDECREF(tuple);
    return rc;
}

PyMODINIT_FUNC PyInit__forensics_core(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "ForensicsCore", (PyObject *)&CoreType) < 0
        || PyModule_AddIntConstant(m, "NUM_KINDS", NUM_KINDS) < 0
        || add_names(m, "LOOKUP_FIELDS", lookup_fields)
        || add_names(m, "SEGMENT_FIELDS", segment_fields)
        || add_names(m, "KEY_FIELDS", key_fields)
        || add_names(m, "REMOVAL_FIELDS", removal_fields)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
