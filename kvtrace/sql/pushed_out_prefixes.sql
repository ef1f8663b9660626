-- name: pushed_out_prefixes
-- summary: Each prefix transient checkpoints pushed out, once: its evictions and what its later misses cost.
-- param: min_hits INTEGER = 2 -- a prefix entry is hot once it has had this many hits before its eviction
-- param: min_transient INTEGER = 1 -- count evictions with at least this many transient checkpoints cached
-- returns:
--   run: the run (one trace; no replay needed)
--   variant: the run's variant (or trace source)
--   hash_id: the prefix's dense hash id
--   depth_tokens: tokens the prefix covers
--   group_ids: the KV-cache groups whose entries for it were pushed out
--   evictions: pushouts of its entries (checkpoint_pushouts rows: one per block and eviction)
--   first_evicted_step: step of its first pushout
--   hits_before_evictions: hits its evicted entries had had, summed
--   later_missed_lookups: distinct admitted lookups after a pushout that needed it and hit less
--   regret_tokens: sum over those lookups, each once, of depth_tokens - num_hit_tokens
-- The per-prefix view of checkpoint_pushouts (same definitions): a prefix kept on several
-- blocks (two requests computed it at once) or evicted again appears there once per eviction,
-- and a missed lookup inside several eviction windows counts in each; here each lookup counts
-- once per prefix. Ranked by regret, then evictions.
WITH pushouts AS (
    SELECT * FROM checkpoint_pushout_lookups($min_hits, $min_transient)),
evicted AS (
    SELECT run, variant, hash_id, max(num_tokens) AS depth_tokens,
           list(DISTINCT group_id ORDER BY group_id) AS group_ids, count(*) AS evictions,
           min(removed_step) AS first_evicted_step, sum(hits) AS hits_before_evictions
    FROM (SELECT DISTINCT run, variant, hash_id, group_id, block_id, removed_seq, removed_step,
                          num_tokens, hits
          FROM pushouts)
    GROUP BY run, variant, hash_id),
missed AS (
    SELECT run, hash_id, count(*) AS later_missed_lookups, sum(regret) AS regret_tokens
    FROM (SELECT DISTINCT run, hash_id, lookup_seq, num_tokens - num_hit_tokens AS regret
          FROM pushouts
          WHERE lookup_seq IS NOT NULL)
    GROUP BY run, hash_id)
SELECT e.*, coalesce(m.later_missed_lookups, 0) AS later_missed_lookups,
       coalesce(m.regret_tokens, 0) AS regret_tokens
FROM evicted e
LEFT JOIN missed m USING (run, hash_id)
ORDER BY regret_tokens DESC, evictions DESC, run, hash_id
