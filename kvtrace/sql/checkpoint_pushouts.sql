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
-- A prefix held by several blocks, or evicted again, has one row per eviction here, and a
-- missed lookup counts for every eviction whose window it falls in: `pushed_out_prefixes`
-- ranks each prefix once.
SELECT run, variant, hash_id, group_id, num_tokens AS depth_tokens, block_id,
       removed_seq AS evicted_seq, removed_step AS evicted_step,
       hits AS hits_before_eviction, cached_transient AS transient_checkpoints_cached,
       count(lookup_seq) AS later_missed_lookups,
       coalesce(sum(num_tokens - num_hit_tokens), 0) AS regret_tokens
FROM checkpoint_pushout_lookups($min_hits, $min_transient)
GROUP BY ALL
ORDER BY regret_tokens DESC, hits_before_eviction DESC, run, evicted_seq
