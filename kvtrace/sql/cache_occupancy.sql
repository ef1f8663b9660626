-- name: cache_occupancy
-- summary: Who holds the block pool over time: running requests, hot prefixes, transient checkpoints, free.
-- param: min_hits INTEGER = 2 -- a cached block is a hot prefix once its newest key has this many hits
-- param: bucket_steps INTEGER = 1 -- report the state at the end of every this many steps
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   step_start: first step of the bucket; counts are the state after its last event
--   pool_blocks: usable blocks (num_gpu_blocks - 1: block 0 is vLLM's null block)
--   running: blocks with ref_cnt > 0 (held by running requests)
--   hot_prefix: free-queue blocks whose newest key has >= $min_hits hits
--   transient_checkpoint: free-queue blocks whose newest key is a TRANSIENT checkpoint
--   other_cached: other free-queue blocks with a key
--   free: pool_blocks minus the above (unhashed free blocks, never-used ones included)
-- The share of the pool is each count / pool_blocks. A block's state after each of its events
-- comes from the block_states view; buckets in which no block changed are absent.
WITH with_hits AS (
    SELECT *, sum(is_touch) OVER (PARTITION BY run, block_id, key_epoch ORDER BY seq
                                  ROWS UNBOUNDED PRECEDING) AS epoch_hits
    FROM block_states),
categorized AS (
    SELECT run, seq, step, block_id,
           CASE WHEN in_use THEN 'running'
                WHEN num_keys > 0 AND transient THEN 'transient_checkpoint'
                WHEN num_keys > 0 AND epoch_hits >= $min_hits THEN 'hot_prefix'
                WHEN num_keys > 0 THEN 'other_cached' END AS category
    FROM with_hits),
changes AS (
    SELECT run, step, category,
           lag(category) OVER (PARTITION BY run, block_id ORDER BY seq) AS previous
    FROM categorized),
deltas AS (
    SELECT run, step, category, 1 AS delta FROM changes
    WHERE category IS NOT NULL AND category IS DISTINCT FROM previous
    UNION ALL
    SELECT run, step, previous, -1 FROM changes
    WHERE previous IS NOT NULL AND category IS DISTINCT FROM previous),
per_bucket AS (
    SELECT run, step // $bucket_steps * $bucket_steps AS step_start,
           sum(delta) FILTER (WHERE category = 'running') AS running,
           sum(delta) FILTER (WHERE category = 'hot_prefix') AS hot_prefix,
           sum(delta) FILTER (WHERE category = 'transient_checkpoint') AS transient_checkpoint,
           sum(delta) FILTER (WHERE category = 'other_cached') AS other_cached
    FROM deltas
    GROUP BY run, step_start),
cumulative AS (
    SELECT b.run, r.variant, b.step_start, r.num_gpu_blocks - 1 AS pool_blocks,
           sum(coalesce(running, 0)) OVER w AS running,
           sum(coalesce(hot_prefix, 0)) OVER w AS hot_prefix,
           sum(coalesce(transient_checkpoint, 0)) OVER w AS transient_checkpoint,
           sum(coalesce(other_cached, 0)) OVER w AS other_cached
    FROM per_bucket b
    JOIN runs r ON r.run = b.run
    WINDOW w AS (PARTITION BY b.run ORDER BY b.step_start ROWS UNBOUNDED PRECEDING))
SELECT run, variant, step_start, pool_blocks, running::BIGINT AS running,
       hot_prefix::BIGINT AS hot_prefix, transient_checkpoint::BIGINT AS transient_checkpoint,
       other_cached::BIGINT AS other_cached,
       (pool_blocks - running - hot_prefix - transient_checkpoint - other_cached)::BIGINT AS free
FROM cumulative
ORDER BY run, step_start
