/* snapshot_pool: the pool part of a capture's start snapshot, in C.
 *
 * The twin of kvtrace/probes/snapshot.py's _pool_records (the reference): on vLLM's scheduler
 * thread, between two steps, it reads every key of the prefix cache and every held or keyed
 * block, interning the keys' hashes as the probes do, and appends to the probe set's records,
 * in this order, the HashInterned records of new hashes (when hash bytes are emitted), one
 * BlockState per held or keyed block, and one KeyCached per key. Python does the same in
 * comprehensions at several times the instructions, which the engine's step would wait for. */

#include "kvtrace_native.h"

static PyObject *s_ref_cnt, *s_block_hash, *s_block_hash_num_tokens, *s_block_id, *s_records,
    *s_interned_ids, *s_depth, *s_emit_hash_bytes, *MinusOne, *Zero;

int
snapshot_init(void)
{
#define NAME(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    NAME(s_ref_cnt, "ref_cnt")
    NAME(s_block_hash, "_block_hash") /* KVCacheBlock.block_hash, read without the property */
    NAME(s_block_hash_num_tokens, "_block_hash_num_tokens")
    NAME(s_block_id, "block_id")
    NAME(s_records, "_records")
    NAME(s_interned_ids, "_interned_ids")
    NAME(s_depth, "_depth")
    NAME(s_emit_hash_bytes, "emit_hash_bytes")
#undef NAME
    MinusOne = PyLong_FromLong(-1);
    Zero = PyLong_FromLong(0);
    return MinusOne == NULL || Zero == NULL ? -1 : 0;
}

/* A key's hash id (a new reference; interned, with its HashInterned record, if new) and its
 * group: a key is the hash's bytes and the group as 4 big-endian bytes. */
static PyObject *
key_hash_id(PyObject *key, PyObject *ids, PyObject *records, int emit, long *group)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) < 4) {
        PyErr_SetString(PyExc_TypeError, "snapshot_pool: a cache key is not hash bytes + group");
        return NULL;
    }
    const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(key);
    Py_ssize_t length = PyBytes_GET_SIZE(key) - 4;
    *group = ((long)bytes[length] << 24) | (bytes[length + 1] << 16) | (bytes[length + 2] << 8)
             | bytes[length + 3];
    PyObject *hash_bytes = PyBytes_FromStringAndSize((const char *)bytes, length);
    if (hash_bytes == NULL) {
        return NULL;
    }
    PyObject *hash_id = PyDict_GetItemWithError(ids, hash_bytes);
    if (hash_id != NULL) {
        Py_INCREF(hash_id);
    } else if (!PyErr_Occurred()
               && (hash_id = PyLong_FromSsize_t(PyDict_GET_SIZE(ids))) != NULL
               && PyDict_SetItem(ids, hash_bytes, hash_id) == 0 && emit) {
        PyObject *record = NEW_RECORD(HashInterned, .hash_id = hash_id, .hash_bytes = hash_bytes);
        if (record == NULL || PyList_Append(records, record) < 0) {
            Py_CLEAR(hash_id);
        }
        Py_XDECREF(record);
    } else if (PyErr_Occurred()) {
        Py_CLEAR(hash_id);
    }
    Py_DECREF(hash_bytes);
    return hash_id;
}

/* The ids of the blocks holding a key, in lookup order: one KVCacheBlock or a dict of them. */
static PyObject *
holder_ids(PyObject *holders)
{
    if (!PyDict_Check(holders)) {
        PyObject *block_id = PyObject_GetAttr(holders, s_block_id);
        if (block_id == NULL) {
            return NULL;
        }
        PyObject *ids = PyList_New(1);
        if (ids == NULL) {
            Py_DECREF(block_id);
            return NULL;
        }
        PyList_SET_ITEM(ids, 0, block_id);
        return ids;
    }
    PyObject *ids = PyList_New(0), *id_of, *block;
    Py_ssize_t pos = 0;
    while (ids != NULL && PyDict_Next(holders, &pos, &id_of, &block)) {
        PyObject *block_id = PyObject_GetAttr(block, s_block_id);
        if (block_id == NULL || PyList_Append(ids, block_id) < 0) {
            Py_CLEAR(ids);
        }
        Py_XDECREF(block_id);
    }
    return ids;
}

/* snapshot_pool(probe, blocks, cache) -> number of keys. ``blocks``: BlockPool.blocks;
 * ``cache``: its cached_block_hash_to_block._cache. */
PyObject *
snapshot_pool(PyObject *module, PyObject *args)
{
    PyObject *probe, *blocks, *cache;
    if (!PyArg_ParseTuple(args, "OO!O!:snapshot_pool", &probe, &PyList_Type, &blocks,
                          &PyDict_Type, &cache)) {
        return NULL;
    }
    PyObject *records = PyObject_GetAttr(probe, s_records);
    PyObject *ids = records == NULL ? NULL : PyObject_GetAttr(probe, s_interned_ids);
    PyObject *depth = ids == NULL ? NULL : PyObject_GetAttr(probe, s_depth);
    PyObject *emit_bytes = depth == NULL ? NULL : PyObject_GetAttr(probe, s_emit_hash_bytes);
    Py_ssize_t num_keys = PyDict_GET_SIZE(cache);
    PyObject **key_ids = PyMem_Calloc(num_keys ? num_keys : 1, sizeof(PyObject *));
    long *key_groups = PyMem_Calloc(num_keys ? num_keys : 1, sizeof(long));
    PyObject *key_index = PyDict_New(); /* key -> its position in the cache */
    PyObject *result = NULL;
    if (emit_bytes == NULL || key_ids == NULL || key_groups == NULL || key_index == NULL) {
        goto done;
    }
    if (!PyList_Check(records) || !PyDict_CheckExact(ids) || !PyDict_Check(depth)) {
        PyErr_SetString(PyExc_TypeError, "snapshot_pool: the probe set has no HashInterner");
        goto done;
    }
    int emit = emit_bytes == Py_True;
    /* Every key once, in the map's order. */
    PyObject *key, *holders;
    Py_ssize_t pos = 0, index = 0;
    while (PyDict_Next(cache, &pos, &key, &holders)) {
        PyObject *at = PyLong_FromSsize_t(index);
        if (at == NULL || PyDict_SetItem(key_index, key, at) < 0) {
            Py_XDECREF(at);
            goto done;
        }
        Py_DECREF(at);
        if ((key_ids[index] = key_hash_id(key, ids, records, emit, &key_groups[index])) == NULL) {
            goto done;
        }
        index++;
    }
    /* Every held or keyed block but the null block, with its primary key. */
    for (Py_ssize_t i = 1; i < PyList_GET_SIZE(blocks); i++) {
        PyObject *block = PyList_GET_ITEM(blocks, i);
        PyObject *ref_cnt = PyObject_GetAttr(block, s_ref_cnt);
        PyObject *primary = ref_cnt == NULL ? NULL : PyObject_GetAttr(block, s_block_hash);
        if (primary == NULL) {
            Py_XDECREF(ref_cnt);
            goto done;
        }
        int held = PyObject_IsTrue(ref_cnt);
        PyObject *record = NULL, *block_id = NULL, *group = NULL, *num_tokens = NULL;
        if (held < 0) {
            goto block_failed;
        }
        if (primary == Py_None && !held) {
            Py_DECREF(ref_cnt);
            Py_DECREF(primary);
            continue;
        }
        if ((block_id = PyObject_GetAttr(block, s_block_id)) == NULL) {
            goto block_failed;
        }
        if (primary == Py_None) {
            record = NEW_RECORD(BlockState, .block_id = block_id, .ref_cnt = ref_cnt,
                                .hash_id = MinusOne, .group = Zero, .num_tokens = MinusOne);
        } else {
            PyObject *at = PyDict_GetItemWithError(key_index, primary); /* borrowed */
            if (at == NULL) {
                if (!PyErr_Occurred()) {
                    PyErr_SetString(PyExc_KeyError, "a block's key is not in the cache");
                }
                goto block_failed;
            }
            Py_ssize_t k = PyLong_AsSsize_t(at);
            PyObject *tokens = PyObject_GetAttr(block, s_block_hash_num_tokens);
            if (tokens == NULL || (group = PyLong_FromLong(key_groups[k])) == NULL) {
                Py_XDECREF(tokens);
                goto block_failed;
            }
            num_tokens = tokens == Py_None ? Py_NewRef(MinusOne) : Py_NewRef(tokens);
            if (PyDict_GetItemWithError(depth, key_ids[k]) == NULL
                && (PyErr_Occurred()
                    || PyDict_SetItem(depth, key_ids[k], tokens == Py_None ? Zero : tokens) < 0)) {
                Py_DECREF(tokens);
                goto block_failed;
            }
            Py_DECREF(tokens);
            record = NEW_RECORD(BlockState, .block_id = block_id, .ref_cnt = ref_cnt,
                                .hash_id = key_ids[k], .group = group, .num_tokens = num_tokens);
        }
        if (record != NULL && PyList_Append(records, record) == 0) {
            Py_DECREF(record);
            Py_DECREF(block_id);
            Py_XDECREF(group);
            Py_XDECREF(num_tokens);
            Py_DECREF(ref_cnt);
            Py_DECREF(primary);
            continue;
        }
    block_failed:
        Py_XDECREF(record);
        Py_XDECREF(block_id);
        Py_XDECREF(group);
        Py_XDECREF(num_tokens);
        Py_DECREF(ref_cnt);
        Py_DECREF(primary);
        goto done;
    }
    /* Every key with its holders, in lookup order, and the prefix length it covers. */
    pos = index = 0;
    while (PyDict_Next(cache, &pos, &key, &holders)) {
        PyObject *holder_list = holder_ids(holders);
        PyObject *group = holder_list == NULL ? NULL : PyLong_FromLong(key_groups[index]);
        PyObject *num_tokens = group == NULL ? NULL
                               : PyDict_GetItemWithError(depth, key_ids[index]); /* borrowed */
        PyObject *record = NULL;
        if (group != NULL && (num_tokens != NULL || !PyErr_Occurred())) {
            record = NEW_RECORD(KeyCached, .hash_id = key_ids[index], .group = group,
                                .num_tokens = num_tokens == NULL ? Zero : num_tokens,
                                .block_ids = holder_list);
        }
        int appended = record != NULL && PyList_Append(records, record) == 0;
        Py_XDECREF(record);
        Py_XDECREF(group);
        Py_XDECREF(holder_list);
        if (!appended) {
            goto done;
        }
        index++;
    }
    result = PyLong_FromSsize_t(num_keys);
done:
    if (key_ids != NULL) {
        for (Py_ssize_t i = 0; i < num_keys; i++) {
            Py_XDECREF(key_ids[i]);
        }
    }
    PyMem_Free(key_ids);
    PyMem_Free(key_groups);
    Py_XDECREF(key_index);
    Py_XDECREF(records);
    Py_XDECREF(ids);
    Py_XDECREF(depth);
    Py_XDECREF(emit_bytes);
    return result;
}
