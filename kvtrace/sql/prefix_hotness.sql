-- name: prefix_hotness
-- summary: The most-hit prefixes of each run: hits, how often stored and evicted, depth.
-- param: min_hits INTEGER = 1 -- list only prefixes with at least this many hits
-- param: limit INTEGER = 20 -- rows per run
-- returns:
--   run: the run (see the runs table)
--   variant: the run's variant (or trace source)
--   hash_id: the prefix's dense hash id
--   group_id: its KV-cache group
--   depth_tokens: tokens the prefix covers (num_tokens of its BlockStored; the largest if several)
--   kind: how it was stored the last time (FULL, PARTIAL or CHECKPOINT)
--   times_stored: BlockStored records of the prefix (a prefix evicted and recomputed is stored again)
--   hits: BlockTouched on its block while it was cached (cache_entries.hits)
--   lru_evictions: its BlockRemoved records with reason LRU_REUSE
--   first_stored_step: step of its first BlockStored
--   last_hit_step: step of its last hit (NULL: never hit)
-- A prefix is (hash_id, group_id) within one run. Ranked by hits, then hash_id.
WITH per_prefix AS (
    SELECT e.run, any_value(e.variant) AS variant, e.hash_id, e.group_id,
           max(e.num_tokens) AS depth_tokens, arg_max(e.kind, e.stored_seq) AS kind,
           count(*) AS times_stored, sum(e.hits) AS hits,
           count(*) FILTER (WHERE e.removed_reason = 'LRU_REUSE') AS lru_evictions,
           min(e.stored_step) AS first_stored_step, max(e.last_hit_step) AS last_hit_step
    FROM cache_entries e
    GROUP BY e.run, e.hash_id, e.group_id)
SELECT run, variant, hash_id, group_id, depth_tokens, kind, times_stored, hits, lru_evictions,
       first_stored_step, last_hit_step
FROM per_prefix
WHERE hits >= $min_hits
QUALIFY row_number() OVER (PARTITION BY run ORDER BY hits DESC, hash_id) <= $limit
ORDER BY run, hits DESC, hash_id
