/* snapshot_pool: the pool part of a capture's start snapshot, in C.
 *
 * The twin of kvtrace/probes/snapshot.py's _read_pool (the reference): on vLLM's scheduler
 * thread, between two steps, it reads every key of the prefix cache and every held or keyed
 * block, interning the keys' hashes into the probe set's HashInterner (and learning the prefix
 * length of each block's primary key), and returns them as packed int64 rows, no Python object
 * per row: the writer thread makes the records. Python does the same in comprehensions at
 * several times the instructions, which the engine's step would wait for. */

#include "kvtrace_native.h"

static PyObject *s_ref_cnt, *s_block_hash, *s_block_hash_num_tokens, *s_block_id,
    *s_interned_ids, *s_depth, *Zero;

int
snapshot_init(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(s_ref_cnt, "ref_cnt")
    NAME(s_block_hash, "_block_hash") /* KVCacheBlock.block_hash, read without the property */
    NAME(s_block_hash_num_tokens, "_block_hash_num_tokens")
    NAME(s_block_id, "block_id")
    NAME(s_interned_ids, "_interned_ids")
    NAME(s_depth, "_depth")
#undef NAME
    Zero = PyLong_FromLong(0);
    return Zero == NULL ? -1 : 0;
}

/* A growing buffer of int64 rows. */
typedef struct {
    long long *values;
    Py_ssize_t size, capacity;
} Rows;

static int
put(Rows *rows, long long value)
{
    if (rows->size == rows->capacity) {
        Py_ssize_t capacity = rows->capacity ? 2 * rows->capacity : 1024;
        long long *grown = PyMem_Realloc(rows->values, capacity * sizeof(long long));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        rows->values = grown;
        rows->capacity = capacity;
    }
    rows->values[rows->size++] = value;
    return 0;
}

static PyObject *
rows_bytes(Rows *rows)
{
    return PyBytes_FromStringAndSize((const char *)rows->values,
                                     rows->size * (Py_ssize_t)sizeof(long long));
}

/* An int attribute of a block, or -1 with an error. */
static long long
int_attr(PyObject *block, PyObject *name, int *failed)
{
    PyObject *value = PyObject_GetAttr(block, name);
    long long result = value == NULL ? -1 : PyLong_AsLongLong(value);
    Py_XDECREF(value);
    *failed = PyErr_Occurred() != NULL;
    return result;
}

/* A key's hash id (a new reference; interned if new) and its group: a key is the hash's bytes
 * and the group as 4 big-endian bytes. */
static PyObject *
key_hash_id(PyObject *key, PyObject *ids, long long *group)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 4) {
        PyErr_SetString(PyExc_TypeError, "snapshot_pool: a cache key is not hash bytes + group");
        return NULL;
    }
    const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(key);
    Py_ssize_t length = PyBytes_GET_SIZE(key) - 4;
    *group = ((long long)bytes[length] << 24) | (bytes[length + 1] << 16)
             | (bytes[length + 2] << 8) | bytes[length + 3];
    PyObject *hash_bytes = PyBytes_FromStringAndSize((const char *)bytes, length);
    if (hash_bytes == NULL) {
        return NULL;
    }
    PyObject *hash_id = PyDict_GetItemWithError(ids, hash_bytes);
    if (hash_id != NULL) {
        Py_INCREF(hash_id);
    } else if (!PyErr_Occurred()
               && (hash_id = PyLong_FromSsize_t(PyDict_GET_SIZE(ids))) != NULL
               && PyDict_SetItem(ids, hash_bytes, hash_id) < 0) {
        Py_CLEAR(hash_id);
    }
    Py_DECREF(hash_bytes);
    return hash_id;
}

/* snapshot_pool(probe, blocks, cache) -> (block rows, key rows, holders), packed native int64:
 * a row (block_id, ref_cnt, hash_id, group, num_tokens) per held or keyed block but the null
 * block (hash_id -1, group 0 and num_tokens -1 for no key; num_tokens -1 for a key without a
 * length); a row (hash_id, group, num_tokens, number of holders) per key, in the map's order,
 * num_tokens the probe set's prefix length for it (0: unknown); every key's holders' block ids,
 * in lookup order, one after another. ``blocks``: BlockPool.blocks, block i at index i;
 * ``cache``: its cached_block_hash_to_block._cache. A block's primary key is found while its
 * keys are read (the object the map is keyed by, or an equal one), so no lookup by key is
 * needed. */
PyObject *
snapshot_pool(PyObject *module, PyObject *args)
{
    PyObject *probe, *blocks, *cache;
    if (!PyArg_ParseTuple(args, "OO!O!:snapshot_pool", &probe, &PyList_Type, &blocks,
                          &PyDict_Type, &cache)) {
        return NULL;
    }
    PyObject *ids = PyObject_GetAttr(probe, s_interned_ids);
    PyObject *depth = ids == NULL ? NULL : PyObject_GetAttr(probe, s_depth);
    Py_ssize_t num_keys = PyDict_GET_SIZE(cache), num_blocks = PyList_GET_SIZE(blocks);
    PyObject **key_ids = PyMem_Calloc(num_keys ? num_keys : 1, sizeof(PyObject *));
    Py_ssize_t *primary_of = PyMem_Malloc((num_blocks ? num_blocks : 1) * sizeof(Py_ssize_t));
    Rows block_rows = {0}, key_rows = {0}, holder_rows = {0};
    PyObject *result = NULL, *key, *holders;
    long long group;
    if (depth == NULL || key_ids == NULL || primary_of == NULL) {
        if (key_ids == NULL || primary_of == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    if (!PyDict_CheckExact(ids) || !PyDict_Check(depth)) {
        PyErr_SetString(PyExc_TypeError, "snapshot_pool: the probe set has no HashInterner");
        goto done;
    }
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        primary_of[i] = -1; /* the position of the key a block holds as its primary */
    }
    /* Every key once, in the map's order: its id and group, and its holders. */
    Py_ssize_t pos = 0, index = 0;
    while (PyDict_Next(cache, &pos, &key, &holders)) {
        if ((key_ids[index] = key_hash_id(key, ids, &group)) == NULL
            || put(&key_rows, PyLong_AsLongLong(key_ids[index])) < 0
            || put(&key_rows, group) < 0 || put(&key_rows, 0) < 0) {
            goto done;
        }
        Py_ssize_t num_holders = 0, at = 0;
        PyObject *id_of, *block = holders;
        int several = PyDict_Check(holders);
        while (several ? PyDict_Next(holders, &at, &id_of, &block) : num_holders == 0) {
            int failed;
            long long block_id = int_attr(block, s_block_id, &failed);
            PyObject *primary = failed ? NULL : PyObject_GetAttr(block, s_block_hash);
            if (primary == NULL || put(&holder_rows, block_id) < 0) {
                Py_XDECREF(primary);
                goto done;
            }
            /* The same object mostly; an equal one where the map kept an earlier holder's. */
            int is_primary = primary == key
                             || (primary != Py_None && PyObject_RichCompareBool(primary, key, Py_EQ));
            Py_DECREF(primary);
            if (is_primary < 0) {
                goto done;
            }
            if (is_primary && 0 <= block_id && block_id < num_blocks) {
                primary_of[block_id] = index;
            }
            num_holders++;
        }
        if (put(&key_rows, num_holders) < 0) {
            goto done;
        }
        index++;
    }
    /* Every held or keyed block but the null block, with its primary key. */
    for (Py_ssize_t i = 1; i < num_blocks; i++) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        int failed;
        long long ref_cnt = int_attr(block, s_ref_cnt, &failed);
        Py_ssize_t k = primary_of[i];
        if (failed) {
            goto done;
        }
        if (k < 0 && !ref_cnt) {
            continue;
        }
        long long hash_id = -1, tokens = -1;
        group = 0;
        if (k >= 0) {
            PyObject *num_tokens = PyObject_GetAttr(block, s_block_hash_num_tokens);
            if (num_tokens == NULL) {
                goto done;
            }
            hash_id = key_rows.values[4 * k];
            group = key_rows.values[4 * k + 1];
            tokens = num_tokens == Py_None ? -1 : PyLong_AsLongLong(num_tokens);
            /* The prefix length the records give this key, unless one is known. */
            failed = PyErr_Occurred()
                     || (PyDict_GetItemWithError(depth, key_ids[k]) == NULL
                         && (PyErr_Occurred()
                             || PyDict_SetItem(depth, key_ids[k],
                                               num_tokens == Py_None ? Zero : num_tokens) < 0));
            Py_DECREF(num_tokens);
        }
        if (failed || put(&block_rows, i) < 0 || put(&block_rows, ref_cnt) < 0
            || put(&block_rows, hash_id) < 0 || put(&block_rows, group) < 0
            || put(&block_rows, tokens) < 0) {
            goto done;
        }
    }
    /* Every key's prefix length, now that the blocks taught some. */
    for (index = 0; index < num_keys; index++) {
        PyObject *num_tokens = PyDict_GetItemWithError(depth, key_ids[index]); /* borrowed */
        if (num_tokens == NULL && PyErr_Occurred()) {
            goto done;
        }
        key_rows.values[4 * index + 2] = num_tokens == NULL ? 0 : PyLong_AsLongLong(num_tokens);
    }
    if (PyErr_Occurred()) {
        goto done;
    }
    PyObject *packed[3] = {rows_bytes(&block_rows), rows_bytes(&key_rows),
                           rows_bytes(&holder_rows)};
    if (packed[0] != NULL && packed[1] != NULL && packed[2] != NULL) {
        result = PyTuple_Pack(3, packed[0], packed[1], packed[2]);
    }
    for (int i = 0; i < 3; i++) {
        Py_XDECREF(packed[i]);
    }
done:
    if (key_ids != NULL) {
        for (Py_ssize_t i = 0; i < num_keys; i++) {
            Py_XDECREF(key_ids[i]);
        }
    }
    PyMem_Free(key_ids);
    PyMem_Free(primary_of);
    PyMem_Free(block_rows.values);
    PyMem_Free(key_rows.values);
    PyMem_Free(holder_rows.values);
    Py_XDECREF(ids);
    Py_XDECREF(depth);
    return result;
}
