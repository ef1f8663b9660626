/* Growable int arrays and an int64 -> int64 hash map (open addressing, linear probing), shared
 * by kvtrace's C cores (csrc/model_core.c, csrc/forensics_core.c). Allocation failures raise
 * MemoryError and return -1; the callers hold the interpreter lock.
 */
#ifndef KVTRACE_CONTAINERS_H
#define KVTRACE_CONTAINERS_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef long long i64;

/* --- growable arrays and an int64 hash map ---------------------------------------------------- */

typedef struct { int32_t *v; Py_ssize_t n, cap; } IVec;
typedef struct { i64 *v; Py_ssize_t n, cap; } LVec;

/* Grow an array `*values` of `*cap` items of `item_size` bytes to hold at least `wanted`
   (doubling from 8), keeping its contents. */
static inline int vec_reserve(void **values, Py_ssize_t *cap, Py_ssize_t wanted,
                              size_t item_size) {
    if (wanted <= *cap) return 0;
    Py_ssize_t size = *cap ? *cap : 8;
    while (size < wanted) size *= 2;
    void *grown = PyMem_Realloc(*values, (size_t)size * item_size);
    if (!grown) { PyErr_NoMemory(); return -1; }
    *values = grown;
    *cap = size;
    return 0;
}
static inline int ivec_reserve(IVec *a, Py_ssize_t cap) {
    return vec_reserve((void **)&a->v, &a->cap, cap, sizeof(int32_t));
}
static inline int ivec_push(IVec *a, int32_t x) {
    if (a->n == a->cap && ivec_reserve(a, a->n + 1)) return -1;
    a->v[a->n++] = x;
    return 0;
}
static inline void ivec_free(IVec *a) { PyMem_Free(a->v); a->v = NULL; a->n = a->cap = 0; }

static inline int lvec_reserve(LVec *a, Py_ssize_t cap) {
    return vec_reserve((void **)&a->v, &a->cap, cap, sizeof(i64));
}
static inline int lvec_push(LVec *a, i64 x) {
    if (a->n == a->cap && lvec_reserve(a, a->n + 1)) return -1;
    a->v[a->n++] = x;
    return 0;
}
static inline void lvec_free(LVec *a) { PyMem_Free(a->v); a->v = NULL; a->n = a->cap = 0; }

/* Slots hold a key and its value side by side (one cache miss a probe on a large map); which
   slots are used is a bitmap (an eighth of a byte a slot: it stays in cache). */
typedef struct { i64 key, val; } MapSlot;
typedef struct { MapSlot *slots; uint64_t *used; size_t cap, n; } Map;

static inline int map_used(const Map *m, size_t i) { return (m->used[i >> 6] >> (i & 63)) & 1; }
static inline void map_mark(Map *m, size_t i, int used) {
    if (used) m->used[i >> 6] |= (uint64_t)1 << (i & 63);
    else m->used[i >> 6] &= ~((uint64_t)1 << (i & 63));
}
static inline size_t map_home(i64 key, size_t mask) {
    uint64_t x = (uint64_t)key;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return (size_t)x & mask;
}
static inline Py_ssize_t map_find(const Map *m, i64 key) {
    if (!m->cap) return -1;
    size_t mask = m->cap - 1, i = map_home(key, mask);
    while (map_used(m, i)) {
        if (m->slots[i].key == key) return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
    return -1;
}
static inline int map_get(const Map *m, i64 key, i64 *val) {
    Py_ssize_t i = map_find(m, key);
    if (i < 0) return 0;
    *val = m->slots[i].val;
    return 1;
}
static inline void map_clear(Map *m) {
    PyMem_Free(m->slots); PyMem_Free(m->used);
    memset(m, 0, sizeof(*m));
}
static inline int map_set(Map *m, i64 key, i64 val);
static inline int map_grow(Map *m) {
    Map bigger = {0};
    bigger.cap = m->cap ? m->cap * 2 : 64;
    bigger.slots = PyMem_Malloc(bigger.cap * sizeof(MapSlot));
    bigger.used = PyMem_Calloc(bigger.cap / 64, sizeof(uint64_t));
    if (!bigger.slots || !bigger.used) {
        map_clear(&bigger);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++)
        if (map_used(m, i)) map_set(&bigger, m->slots[i].key, m->slots[i].val);
    map_clear(m);
    *m = bigger;
    return 0;
}
static inline int map_set(Map *m, i64 key, i64 val) {
    if ((m->n + 1) * 2 > m->cap && map_grow(m)) return -1;
    size_t mask = m->cap - 1, i = map_home(key, mask);
    while (map_used(m, i)) {
        if (m->slots[i].key == key) { m->slots[i].val = val; return 0; }
        i = (i + 1) & mask;
    }
    map_mark(m, i, 1);
    m->slots[i].key = key;
    m->slots[i].val = val;
    m->n++;
    return 0;
}
static inline void map_del_at(Map *m, size_t i) {  /* backward-shift deletion (linear probing) */
    size_t mask = m->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!map_used(m, j)) break;
        size_t k = map_home(m->slots[j].key, mask);
        int k_in_i_j = (i <= j) ? (k > i && k <= j) : (k > i || k <= j);
        if (!k_in_i_j) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    map_mark(m, i, 0);
    m->n--;
}
static inline void map_del(Map *m, i64 key) {
    Py_ssize_t i = map_find(m, key);
    if (i >= 0) map_del_at(m, (size_t)i);
}

/* Ids (hash ids, mostly) mapped to an int32 (IdIndex) or kept as a set (IdSet). Ids are dense
   from 0 in a trace (interned in order of appearance), so those go to an array indexed by the
   id, which keeps the recent ones, the busy ones, together in memory; the rest (negative ids,
   or ids far beyond the ones seen, e.g. a replay's made-up ids from 2^62) to a hash map. */
#define ID_DENSE_SLACK ((i64)1 << 16)

/* Whether `id` may take an array slot: within four times the ids stored so far. */
static inline int id_dense_fits(i64 id, i64 num_stored) {
    return id >= 0 && id < 4 * (num_stored + ID_DENSE_SLACK);
}
static inline i64 id_dense_size(i64 id, i64 cap) {
    i64 size = cap ? cap : ID_DENSE_SLACK;
    while (size <= id) size *= 2;
    return size;
}

typedef struct { int32_t *dense; i64 cap, n; Map sparse; } IdIndex;

static inline int32_t id_index_get(const IdIndex *x, i64 id) {
    if (id >= 0 && id < x->cap) return x->dense[id];
    i64 value;
    return map_get(&x->sparse, id, &value) ? (int32_t)value : -1;
}
/* Set id -> value (value >= 0). */
static inline int id_index_set(IdIndex *x, i64 id, int32_t value) {
    if (id >= x->cap && id_dense_fits(id, x->n)) {
        i64 size = id_dense_size(id, x->cap);
        int32_t *dense = PyMem_Realloc(x->dense, (size_t)size * sizeof(int32_t));
        if (!dense) { PyErr_NoMemory(); return -1; }
        for (i64 i = x->cap; i < size; i++) dense[i] = -1;
        x->dense = dense;
        x->cap = size;
    }
    if (id >= 0 && id < x->cap) {
        x->n += x->dense[id] < 0;
        x->dense[id] = value;
        return 0;
    }
    x->n += map_find(&x->sparse, id) < 0;
    return map_set(&x->sparse, id, value);
}
/* Drop id (absent already: nothing). */
static inline int id_index_clear_one(IdIndex *x, i64 id) {
    if (id >= 0 && id < x->cap) {
        x->n -= x->dense[id] >= 0;
        x->dense[id] = -1;
        return 0;
    }
    Py_ssize_t i = map_find(&x->sparse, id);
    if (i >= 0) {
        map_del_at(&x->sparse, (size_t)i);
        x->n--;
    }
    return 0;
}
static inline void id_index_clear(IdIndex *x) {
    PyMem_Free(x->dense);
    map_clear(&x->sparse);
    memset(x, 0, sizeof(*x));
}

typedef struct { uint64_t *bits; i64 cap, n; Map sparse; } IdSet;

static inline int id_set_has(const IdSet *x, i64 id) {
    if (id >= 0 && id < x->cap) return (x->bits[id >> 6] >> (id & 63)) & 1;
    return map_find(&x->sparse, id) >= 0;
}
static inline int id_set_add(IdSet *x, i64 id) {
    if (id >= x->cap && id_dense_fits(id, x->n)) {
        i64 size = id_dense_size(id, x->cap);
        uint64_t *bits = PyMem_Realloc(x->bits, (size_t)(size / 64) * sizeof(uint64_t));
        if (!bits) { PyErr_NoMemory(); return -1; }
        memset(bits + x->cap / 64, 0, (size_t)((size - x->cap) / 64) * sizeof(uint64_t));
        x->bits = bits;
        x->cap = size;
    }
    if (id >= 0 && id < x->cap) {
        uint64_t bit = (uint64_t)1 << (id & 63);
        x->n += !(x->bits[id >> 6] & bit);
        x->bits[id >> 6] |= bit;
        return 0;
    }
    if (map_find(&x->sparse, id) >= 0) return 0;
    x->n++;
    return map_set(&x->sparse, id, 1);
}
static inline void id_set_clear(IdSet *x) {
    PyMem_Free(x->bits);
    map_clear(&x->sparse);
    memset(x, 0, sizeof(*x));
}

#endif
