-- name: pushout_lookups
-- summary: Each pushed-out prefix's later lookups that needed it and hit less: who lost it, when, and how much.
-- param: min_hits INTEGER = 2 -- a prefix entry is hot once it has had this many hits before its eviction
-- param: min_transient INTEGER = 1 -- count evictions with at least this many transient checkpoints cached
-- returns:
--   run: the run
--   variant: the run's variant (or trace source)
--   hash_id: the pushed-out prefix (pushed_out_prefixes.hash_id)
--   depth_tokens: tokens the prefix covers
--   req: the request whose lookup needed it (kvtrace why SOURCE --request REQ)
--   lookup_seq: seq of that lookup (ComputedBlocksFound)
--   lookup_step: its scheduler step
--   hit_tokens: what the lookup hit
--   regret_tokens: depth_tokens - hit_tokens
--   evicted_step: the step of the latest pushout of the prefix before the lookup
-- The lookups that pushed_out_prefixes counts in later_missed_lookups and regret_tokens (the
-- definitions of checkpoint_pushouts), one row each, however many evictions' windows they fall
-- in. Ordered by run, prefix, then lookup.
SELECT p.run, any_value(p.variant) AS variant, p.hash_id, max(p.num_tokens) AS depth_tokens,
       p.lookup_req AS req, p.lookup_seq, any_value(l.step) AS lookup_step,
       any_value(p.num_hit_tokens) AS hit_tokens,
       max(p.num_tokens) - any_value(p.num_hit_tokens) AS regret_tokens,
       max(p.removed_step) AS evicted_step
FROM checkpoint_pushout_lookups($min_hits, $min_transient) p
JOIN lookups l ON l.run = p.run AND l.seq = p.lookup_seq
WHERE p.lookup_seq IS NOT NULL
GROUP BY p.run, p.hash_id, p.lookup_req, p.lookup_seq
ORDER BY p.run, p.hash_id, p.lookup_seq
