-- name: checkpoint_pushouts
-- summary: Hot prefixes evicted by LRU reuse while transient checkpoints sat cached in the free queue.
-- param: min_hits INTEGER = 2 -- a prefix is hot once it has had this many hits before its eviction
-- param: min_transient INTEGER = 1 -- report evictions with at least this many transient checkpoints cached
-- returns:
--   run: the run (one trace; no replay needed)
--   variant: the run's variant (or trace source)
--   hash_id: the evicted prefix's dense hash id
--   group_id: its KV-cache group
--   depth_tokens: tokens the prefix covers (num_tokens of its BlockStored)
--   block_id: the block it was evicted from
--   evicted_seq: seq of the BlockRemoved (reason LRU_REUSE)
--   evicted_step: step of that eviction
--   hits_before_eviction: hits on the entry between its BlockStored and the eviction
--   transient_checkpoints_cached: cached TRANSIENT checkpoint entries in the free queue at that moment
--   later_missed_lookups: admitted lookups after the eviction that needed the prefix and hit less
--   regret_tokens: sum over those lookups of depth_tokens - num_hit_tokens (prefill recomputed)
-- Definitions. The free queue pops from its head; every other free block is behind the one
-- popped. A transient checkpoint entry is a CHECKPOINT BlockStored whose CheckpointRecorded says
-- TRANSIENT; it is "cached in the free queue" while its key is on the block and the block's
-- ref_cnt is 0 (block_states view). Unpublished, those blocks would have been freed unhashed to
-- the queue's head and reused before the hot prefix. A later lookup "needed" the prefix when its
-- request has, at unit depth_tokens / hash_block_size - 1, the same hash unit as the request that
-- stored the prefix (hashes are chained, so the whole prefix matches); it is counted from the
-- eviction until the prefix is stored again, when num_hit_tokens < depth_tokens. Regret is an
-- upper bound: the joint hit also needs the other groups' blocks. Ranked by regret, then hits.
WITH hot_evictions AS (
    SELECT e.*, h.hits
    FROM cache_entries e
    JOIN entry_hits h ON h.run = e.run AND h.stored_seq = e.stored_seq
    WHERE e.removed_reason = 'LRU_REUSE' AND h.hits >= $min_hits),
transient_flags AS (
    SELECT run, seq, block_id, (NOT in_use AND transient)::INTEGER AS evictable_transient
    FROM block_states),
transient_deltas AS (
    SELECT run, seq, evictable_transient - coalesce(lag(evictable_transient)
               OVER (PARTITION BY run, block_id ORDER BY seq), 0) AS delta
    FROM transient_flags),
transient_series AS (
    SELECT run, seq, sum(delta) OVER (PARTITION BY run ORDER BY seq ROWS UNBOUNDED PRECEDING)
               AS cached_transient
    FROM transient_deltas
    WHERE delta <> 0),
pushouts AS (
    SELECT * FROM (
        SELECT v.*, coalesce(s.cached_transient, 0) AS cached_transient,
               coalesce(n.seq, 9223372036854775807) AS restored_seq
        FROM hot_evictions v
        ASOF LEFT JOIN transient_series s ON v.run = s.run AND s.seq < v.removed_seq
        ASOF LEFT JOIN block_stored n
            ON v.run = n.run AND v.hash_id = n.hash_id AND v.group_id = n.group_id
               AND n.seq > v.removed_seq)
    WHERE cached_transient >= $min_transient),
missed AS (
    SELECT p.run, p.removed_seq, l.num_hit_tokens, p.num_tokens
    FROM pushouts p
    JOIN runs r ON r.run = p.run
    JOIN request_hashes owner
        ON owner.run = p.run AND owner.req = p.req
           AND owner.unit = p.num_tokens // r.hash_block_size - 1
    JOIN request_hashes other
        ON other.run = p.run AND other.unit = owner.unit AND other.hash_id = owner.hash_id
    JOIN lookups l
        ON l.run = p.run AND l.req = other.req AND l.admitted
           AND l.seq > p.removed_seq AND l.seq < p.restored_seq
    WHERE l.num_hit_tokens < p.num_tokens)
SELECT p.run, p.variant, p.hash_id, p.group_id, p.num_tokens AS depth_tokens, p.block_id,
       p.removed_seq AS evicted_seq, p.removed_step AS evicted_step,
       p.hits AS hits_before_eviction, p.cached_transient AS transient_checkpoints_cached,
       count(m.run) AS later_missed_lookups,
       coalesce(sum(m.num_tokens - m.num_hit_tokens), 0) AS regret_tokens
FROM pushouts p
LEFT JOIN missed m ON m.run = p.run AND m.removed_seq = p.removed_seq
GROUP BY ALL
ORDER BY regret_tokens DESC, hits_before_eviction DESC, run, evicted_seq
