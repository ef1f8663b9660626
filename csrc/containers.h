/* Growable int arrays, an int64 -> int64 hash map (open addressing, linear probing), chunked
 * arrays that may spill to a file, and id indexes and sets over them, shared
 * by kvtrace's C cores (csrc/model_core.c, csrc/forensics_core.c). Allocation failures raise
 * MemoryError and return -1; the callers hold the interpreter lock.
 */
#ifndef KVTRACE_CONTAINERS_H
#define KVTRACE_CONTAINERS_H

#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

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

/* --- spillable chunked arrays ---------------------------------------------------------------- */

/* What grows with a trace's length (a key for every hash id ever stored, and how each was last
   removed) lives in chunks of CHUNK_ITEMS items that never move and start zeroed. With a spill
   file (the caller's, unnamed) a chunk is a shared mapping of a range of it, allocated on disk
   first (a full disk is then an OSError, not a SIGBUS), and spill_trim hands the mapped pages
   back to the kernel (they stay in the file, to be read again when touched) once the process
   holds `resident` bytes more of file pages than after the last trim: the pass's resident
   share of that state stays bounded whatever the trace's length. Without one (fd -1), the
   chunks are anonymous memory. */
#define CHUNK_SHIFT 17
#define CHUNK_ITEMS ((i64)1 << CHUNK_SHIFT)

typedef struct { void *at; size_t size; } SpillMap;
typedef struct {
    int open, fd;  /* fd -1: anonymous memory */
    i64 end;  /* the file's bytes handed out */
    SpillMap *maps; Py_ssize_t num_maps, cap_maps;
    i64 resident;  /* the file pages it may leave mapped between trims, in bytes */
    i64 resident_after_trim;  /* the process's file pages after the last trim (or the first) */
    Py_ssize_t trims;
} Spill;

typedef struct { char **chunks; Py_ssize_t num_chunks, cap_chunks; size_t item; Spill *spill; } ChunkVec;

/* The bytes of file pages the process has mapped and resident (/proc/self/statm's shared pages,
   which are those of its file mappings), -1 where it cannot tell. */
static inline i64 resident_file_bytes(void) {
    char text[128];
    int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    long long size, resident, shared;
    if (n <= 0) return -1;
    text[n] = 0;
    if (sscanf(text, "%lld %lld %lld", &size, &resident, &shared) != 3) return -1;
    return shared * (i64)sysconf(_SC_PAGESIZE);
}

/* `fd` (the caller keeps its own): a spill file, or -1 for anonymous memory. */
static inline int spill_open(Spill *s, int fd, i64 resident) {
    memset(s, 0, sizeof(*s));
    s->fd = -1;
    s->open = 1;
    s->resident = resident;
    if (fd >= 0 && (s->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    s->resident_after_trim = resident_file_bytes();
    return 0;
}
static inline void *spill_map(Spill *s, size_t size) {
    void *at;
    if (vec_reserve((void **)&s->maps, &s->cap_maps, s->num_maps + 1, sizeof(SpillMap)))
        return NULL;
    if (s->fd >= 0) {
        int rc = posix_fallocate(s->fd, (off_t)s->end, (off_t)size);
        if (rc) {
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return NULL;
        }
        at = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, (off_t)s->end);
    } else {
        at = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (at == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    if (s->fd >= 0) s->end += (i64)size;
    s->maps[s->num_maps++] = (SpillMap){at, size};
    return at;
}
static inline void spill_trim(Spill *s) {
    if (s->fd < 0 || !s->num_maps) return;
    i64 resident = resident_file_bytes();
    if (resident < 0 || resident - s->resident_after_trim < s->resident) return;
    for (Py_ssize_t i = 0; i < s->num_maps; i++)
        madvise(s->maps[i].at, s->maps[i].size, MADV_DONTNEED);
    s->resident_after_trim = resident_file_bytes();
    s->trims++;
}
static inline void spill_close(Spill *s) {
    if (!s->open) return;
    for (Py_ssize_t i = 0; i < s->num_maps; i++) munmap(s->maps[i].at, s->maps[i].size);
    PyMem_Free(s->maps);
    if (s->fd >= 0) close(s->fd);
    memset(s, 0, sizeof(*s));
}

static inline void chunk_init(ChunkVec *v, size_t item, Spill *spill) {
    memset(v, 0, sizeof(*v));
    v->item = item;
    v->spill = spill;
}
static inline i64 chunk_cap(const ChunkVec *v) { return (i64)v->num_chunks << CHUNK_SHIFT; }
static inline void *chunk_at(const ChunkVec *v, i64 i) {
    return v->chunks[i >> CHUNK_SHIFT] + (size_t)(i & (CHUNK_ITEMS - 1)) * v->item;
}
/* Make items [0, n) addressable (zeros, where new). */
static inline int chunk_reserve(ChunkVec *v, i64 n) {
    while (chunk_cap(v) < n) {
        if (vec_reserve((void **)&v->chunks, &v->cap_chunks, v->num_chunks + 1, sizeof(char *)))
            return -1;
        char *chunk = spill_map(v->spill, (size_t)CHUNK_ITEMS * v->item);
        if (!chunk) return -1;
        v->chunks[v->num_chunks++] = chunk;
    }
    return 0;
}
/* Its chunks are the spill's: spill_close unmaps them. */
static inline void chunk_free(ChunkVec *v) {
    PyMem_Free(v->chunks);
    chunk_init(v, v->item, v->spill);
}

/* --- ids ------------------------------------------------------------------------------------- */

/* Ids (hash ids, mostly) mapped to an int32 (IdIndex) or kept as a set (IdSet). Ids are dense
   from 0 in a trace (interned in order of appearance), and a replay's made-up ids (units no
   workload named) are dense from 2^62: those go to chunked arrays indexed by the id, which keep
   the recent ones, the busy ones, together and spill with the rest; others (negative ids, or
   ids far beyond the ones seen) to a hash map. */
#define ID_DENSE_SLACK ((i64)1 << 16)
#define HIGH_IDS ((i64)1 << 62)  /* kvtrace.replay.vllm_backend.FIRST_MADE_UP_HASH_ID */

/* Which dense array `id` belongs to (0: ids from 0; 1: a replay's made-up ids, from HIGH_IDS)
   and its slot there (negative for a negative id, which only the map takes). */
static inline int id_region(i64 id, i64 *slot) {
    int high = id >= HIGH_IDS;
    *slot = high ? id - HIGH_IDS : id;
    return high;
}
/* Whether a new `slot` (in a dense array of `cap` slots) may be taken rather than go to the map:
   within four times the ids stored so far. */
static inline int id_dense_fits(i64 slot, i64 cap, i64 num_stored) {
    return slot >= 0 && (slot < cap || slot < 4 * (num_stored + ID_DENSE_SLACK));
}

typedef struct { ChunkVec dense[2]; i64 n; Map sparse; } IdIndex;  /* dense: value + 1, 0 none */

static inline void id_index_init(IdIndex *x, Spill *spill) {
    memset(x, 0, sizeof(*x));
    for (int r = 0; r < 2; r++) chunk_init(&x->dense[r], sizeof(int32_t), spill);
}
static inline int32_t id_index_get(const IdIndex *x, i64 id) {
    i64 slot;
    const ChunkVec *dense = &x->dense[id_region(id, &slot)];
    if (slot >= 0 && slot < chunk_cap(dense)) return *(int32_t *)chunk_at(dense, slot) - 1;
    i64 value;
    return map_get(&x->sparse, id, &value) ? (int32_t)value : -1;
}
/* Set id -> value (value >= 0). */
static inline int id_index_set(IdIndex *x, i64 id, int32_t value) {
    i64 slot;
    ChunkVec *dense = &x->dense[id_region(id, &slot)];
    if (id_dense_fits(slot, chunk_cap(dense), x->n)) {
        if (chunk_reserve(dense, slot + 1)) return -1;
        int32_t *at = chunk_at(dense, slot);
        x->n += *at == 0;
        *at = value + 1;
        return 0;
    }
    x->n += map_find(&x->sparse, id) < 0;
    return map_set(&x->sparse, id, value);
}
/* Drop id (absent already: nothing). */
static inline void id_index_clear_one(IdIndex *x, i64 id) {
    i64 slot;
    ChunkVec *dense = &x->dense[id_region(id, &slot)];
    if (slot >= 0 && slot < chunk_cap(dense)) {
        int32_t *at = chunk_at(dense, slot);
        x->n -= *at != 0;
        *at = 0;
        return;
    }
    Py_ssize_t i = map_find(&x->sparse, id);
    if (i >= 0) {
        map_del_at(&x->sparse, (size_t)i);
        x->n--;
    }
}
static inline void id_index_clear(IdIndex *x) {
    for (int r = 0; r < 2; r++) chunk_free(&x->dense[r]);
    map_clear(&x->sparse);
    x->n = 0;
}

typedef struct { ChunkVec dense[2]; i64 n; Map sparse; } IdSet;  /* dense: bits, 64 a word */

static inline void id_set_init(IdSet *x, Spill *spill) {
    memset(x, 0, sizeof(*x));
    for (int r = 0; r < 2; r++) chunk_init(&x->dense[r], sizeof(uint64_t), spill);
}
static inline int id_set_has(const IdSet *x, i64 id) {
    i64 slot;
    const ChunkVec *dense = &x->dense[id_region(id, &slot)];
    if (slot >= 0 && slot < 64 * chunk_cap(dense))
        return (*(uint64_t *)chunk_at(dense, slot >> 6) >> (slot & 63)) & 1;
    return map_find(&x->sparse, id) >= 0;
}
static inline int id_set_add(IdSet *x, i64 id) {
    i64 slot;
    ChunkVec *dense = &x->dense[id_region(id, &slot)];
    if (id_dense_fits(slot, 64 * chunk_cap(dense), x->n)) {
        if (chunk_reserve(dense, (slot >> 6) + 1)) return -1;
        uint64_t *word = chunk_at(dense, slot >> 6), bit = (uint64_t)1 << (slot & 63);
        x->n += !(*word & bit);
        *word |= bit;
        return 0;
    }
    if (map_find(&x->sparse, id) >= 0) return 0;
    x->n++;
    return map_set(&x->sparse, id, 1);
}
static inline void id_set_clear(IdSet *x) {
    for (int r = 0; r < 2; r++) chunk_free(&x->dense[r]);
    map_clear(&x->sparse);
    x->n = 0;
}

#endif
