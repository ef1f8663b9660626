-- name: sweep_break_even
-- summary: Per sweep and retention, the smallest pool size from which one variant hits at least as much as another at every larger size swept.
-- param: from_variant VARCHAR = unfixed -- the variant moved from
-- param: to_variant VARCHAR = fixed -- the variant moved to (the fix)
-- returns:
--   sweep_id: the sweep (sweep table)
--   source_path: the source it replayed
--   backend: its backend
--   retention_interval: the retention of both curves (NULL: the source's)
--   pool_sizes: pool sizes where both variants were swept
--   break_even_blocks: the smallest of them from which to_variant's hit rate >= from_variant's at every larger one (NULL: not within the sweep)
--   break_even_fraction: that pool as a share of the distinct attention blocks (sweep.pool_fraction)
--   hit_rate_change: to_variant's minus from_variant's hit rate at break_even_blocks
--   largest_gain: the largest hit-rate change over all pool sizes swept
--   largest_gain_blocks: the pool size of that largest change
-- Definitions. A point is a pool size (num_gpu_blocks) swept under both variants at the same
-- retention in one sweep; hit rates are the sweep's (prompt tokens hit / prompt tokens). The
-- fix "pays" from the break-even size on: from there to the largest pool swept it never hits
-- less than the variant it replaces. Ordered by sweep, then retention.
WITH points AS (
    SELECT f.sweep_id, f.source_path, f.backend, f.retention_interval, f.num_gpu_blocks,
           f.pool_fraction, t.hit_rate - f.hit_rate AS change
    FROM sweep f
    JOIN sweep t
        ON t.sweep_id = f.sweep_id AND t.num_gpu_blocks = f.num_gpu_blocks
           AND t.retention_interval IS NOT DISTINCT FROM f.retention_interval
    WHERE f.variant = $from_variant AND t.variant = $to_variant),
flagged AS (
    SELECT *, bool_and(change >= 0) OVER (
                  PARTITION BY sweep_id, retention_interval ORDER BY num_gpu_blocks DESC
                  ROWS UNBOUNDED PRECEDING) AS pays_from_here
    FROM points)
SELECT sweep_id, any_value(source_path) AS source_path, any_value(backend) AS backend,
       retention_interval, count(*) AS pool_sizes,
       min(num_gpu_blocks) FILTER (WHERE pays_from_here) AS break_even_blocks,
       arg_min(pool_fraction, num_gpu_blocks) FILTER (WHERE pays_from_here)
           AS break_even_fraction,
       arg_min(change, num_gpu_blocks) FILTER (WHERE pays_from_here) AS hit_rate_change,
       max(change) AS largest_gain, arg_max(num_gpu_blocks, change) AS largest_gain_blocks
FROM flagged
GROUP BY sweep_id, retention_interval
ORDER BY sweep_id, retention_interval NULLS FIRST
