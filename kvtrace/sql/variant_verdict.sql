-- name: variant_verdict
-- summary: Per pair of variants replayed from one source: the hit-rate change, and the prefill tokens and GPU-seconds saved per hour of the traffic.
-- param: gpu_flops_per_s DOUBLE = 395760000000000 -- effective GPU FLOP/s (default: an H200's 989.4 TFLOP/s dense BF16 peak x 40%)
-- param: flops_per_token DOUBLE = 0 -- for runs whose header names no model: FLOPs a token costs besides attention (0: leave them unpriced)
-- param: flops_per_position DOUBLE = 0 -- likewise: attention FLOPs per position a token attends to
-- returns:
--   source: the source both runs replayed (runs.source_key)
--   backend: the replay backend of both runs
--   mode: reschedule or lockstep
--   from_variant: the variant moved from (the older release: unfixed, naive, fixed, upstream, then others by name)
--   from_run: its run
--   to_variant: the variant moved to
--   to_run: its run
--   lookups: first admissions of each run (the requests)
--   from_hit_rate: hit tokens / prompt tokens over from_run's first admissions (as kvtrace replay counts)
--   to_hit_rate: the same for to_run
--   hit_rate_change: to_hit_rate - from_hit_rate
--   traffic_hours: hours from the first request's arrival to the last scheduler step, the longer of the two runs (a rescheduled replay's clock is the scheduler model's)
--   from_prefill_tokens: tokens from_run's admitted lookups recomputed (each admission's tokens beyond its hit, resumptions included)
--   to_prefill_tokens: the same for to_run
--   prefill_tokens_saved_per_hour: (from_prefill_tokens - to_prefill_tokens) / traffic_hours (negative: to_variant recomputes more)
--   from_gpu_seconds: those tokens of from_run priced in GPU-seconds (NULL: unpriced)
--   to_gpu_seconds: the same for to_run
--   gpu_seconds_saved_per_hour: (from_gpu_seconds - to_gpu_seconds) / traffic_hours
--   cost_model: the model whose FLOPs priced both (as in recompute_gpu_seconds), NULL when unpriced
-- Definitions. Two runs pair when they replayed one source (source_key) on the same backend, in
-- the same mode and engine (header config and params, as lost_hits_by_prefix pairs them); each
-- pair gives one row. An admitted lookup with hit h and query T recomputes [h, T), which costs
-- flops_per_token * (T - h) + flops_per_position * (T(T+1) - h(h+1)) / 2 FLOPs with the run's
-- figures (run_costs: the header's cost.* of kvtrace replay, else the parameters), over the
-- model's tensor-parallel group, divided by gpu_flops_per_s. Summed over paired lookups,
-- recompute_gpu_seconds' per-prefix rows of both variants differ by the same amount when every
-- lookup pairs. Ordered by source, then the release order of the pair.
WITH ranked AS (
    SELECT run, variant, backend, mode, source_key,
           json_extract(header_json, '$.config')::VARCHAR
               || json_extract(header_json, '$.params')::VARCHAR AS engine,
           CASE variant WHEN 'unfixed' THEN 0 WHEN 'naive' THEN 1 WHEN 'fixed' THEN 2
                        WHEN 'upstream' THEN 3 ELSE 4 END AS release_order
    FROM runs),
pairs AS (
    SELECT a.source_key, a.backend, a.mode, a.variant AS from_variant, a.run AS from_run,
           b.variant AS to_variant, b.run AS to_run, a.release_order, b.release_order AS to_order
    FROM ranked a
    JOIN ranked b
        ON b.source_key = a.source_key AND b.backend = a.backend AND b.mode = a.mode
           AND b.engine = a.engine
           AND (a.release_order < b.release_order
                OR (a.release_order = b.release_order AND a.variant < b.variant))),
per_run AS (
    SELECT * EXCLUDE (prefill_flops), prefill_flops / $gpu_flops_per_s AS gpu_seconds
    FROM run_prefill($flops_per_token, $flops_per_position)),
spans AS (SELECT * FROM run_hours()),
joined AS (
    SELECT p.*, f.lookups, f.hit_tokens / nullif(f.query_tokens, 0) AS from_hit_rate,
           t.hit_tokens / nullif(t.query_tokens, 0) AS to_hit_rate,
           nullif(greatest(sf.hours, st.hours), 0) AS traffic_hours,
           f.prefill_tokens AS from_prefill_tokens, t.prefill_tokens AS to_prefill_tokens,
           f.gpu_seconds AS from_gpu_seconds, t.gpu_seconds AS to_gpu_seconds,
           CASE WHEN f.cost_model IS NOT DISTINCT FROM t.cost_model THEN f.cost_model END
               AS cost_model
    FROM pairs p
    JOIN per_run f ON f.run = p.from_run
    JOIN per_run t ON t.run = p.to_run
    LEFT JOIN spans sf ON sf.run = p.from_run
    LEFT JOIN spans st ON st.run = p.to_run)
SELECT source_key AS source, backend, mode, from_variant, from_run, to_variant, to_run, lookups,
       from_hit_rate, to_hit_rate, to_hit_rate - from_hit_rate AS hit_rate_change,
       traffic_hours, from_prefill_tokens, to_prefill_tokens,
       (from_prefill_tokens - to_prefill_tokens) / traffic_hours AS prefill_tokens_saved_per_hour,
       from_gpu_seconds, to_gpu_seconds,
       (from_gpu_seconds - to_gpu_seconds) / traffic_hours AS gpu_seconds_saved_per_hour,
       cost_model
FROM joined
ORDER BY source, release_order, to_order, from_variant, to_variant, from_run, to_run
