-- name: fleet
-- summary: One row per engine of a fleet (an engine core by host, pid and data-parallel rank; else a trace file): what it hit and missed, the prefill it recomputed per hour and in GPU-seconds, and its share of the fleet's.
-- param: gpu_flops_per_s DOUBLE = 395760000000000 -- effective GPU FLOP/s (default: an H200's 989.4 TFLOP/s dense BF16 peak x 40%)
-- param: flops_per_token DOUBLE = 0 -- for runs whose header names no model: FLOPs a token costs besides attention (0: leave them unpriced)
-- param: flops_per_position DOUBLE = 0 -- likewise: attention FLOPs per position a token attends to
-- returns:
--   engine: host:pid, with dpN for a data-parallel rank (process title VLLM::EngineCore_DPN); a trace that names no process: its file name
--   host: the engine's host (header host), '' when the trace names none
--   pid: its engine core's pid (header pid), NULL when the trace names none
--   rank: its data-parallel rank, NULL for a single engine core
--   runs: the runs that observed it: its captures (runs that are not replays) with admitted lookups; for an engine known only through replays, those of its oldest variant (release order: unfixed, naive, fixed, upstream)
--   replays: its other runs: replays of its traces
--   sources: the source keys of its runs (runs.source_key: what a variant_verdict pair of its replays names as its source)
--   lookups: first admissions over its runs
--   hit_rate: hit tokens / prompt tokens over those first admissions (as kvtrace replay counts)
--   missed_tokens: prefill tokens its runs' admitted lookups recomputed (each admission's tokens beyond its hit, resumptions included)
--   traffic_hours: hours of its runs' traffic (from a run's first arrival to its last scheduler step), summed over its runs
--   missed_tokens_per_hour: missed_tokens / traffic_hours
--   gpu_seconds: missed_tokens priced in GPU-seconds (NULL: unpriced)
--   gpu_seconds_per_hour: gpu_seconds / traffic_hours
--   cost_model: the model whose FLOPs priced them (as in recompute_gpu_seconds), NULL when unpriced
--   share_of_fleet_missed: missed_tokens / every engine's missed_tokens
-- Definitions. A run's engine is the process its header names (host, pid; the rank from its
-- process title), or its file when it names none; a replay's is its source's (the run whose
-- digest is the replay's source_key, else the source's file). Its figures are variant_verdict's
-- per run (the same admitted lookups, prices and traffic hours), summed over the engine's runs.
-- Ordered by GPU-seconds per hour (unpriced engines by missed tokens per hour), most first.
WITH own AS (
    SELECT run, variant, path, source, source_key, digest,
           coalesce(json_extract_string(header_json, '$.host'), '') AS host,
           nullif(TRY_CAST(json_extract_string(header_json, '$.pid') AS BIGINT), 0) AS pid,
           TRY_CAST(nullif(regexp_extract(
               json_extract_string(header_json, '$.process_title'), '_DP(\d+)$', 1), '')
               AS BIGINT) AS rank,
           json_extract_string(header_json, '$.replay.source_path') AS source_path,
           CASE variant WHEN 'unfixed' THEN 0 WHEN 'naive' THEN 1 WHEN 'fixed' THEN 2
                        WHEN 'upstream' THEN 3 ELSE 4 END AS release_order
    FROM runs),
labelled AS (
    SELECT run, source = 'replay' AS is_replay, variant, release_order, source_key,
           CASE WHEN pid IS NOT NULL
                THEN host || ':' || pid || coalesce(' dp' || rank, '')
                ELSE regexp_extract(path, '[^/]*$') END AS engine,
           host, pid, rank
    FROM own WHERE source <> 'replay'),
engines AS (
    SELECT run, is_replay, variant, release_order, source_key, engine, host, pid, rank
    FROM labelled
    UNION ALL
    SELECT r.run, true, r.variant, r.release_order, r.source_key,
           coalesce(s.engine, regexp_extract(r.source_path, '[^/]*$')), coalesce(s.host, ''),
           s.pid, s.rank
    FROM own r
    LEFT JOIN labelled s ON s.run = (SELECT min(o.run) FROM own o
                                     WHERE o.digest = r.source_key AND o.source <> 'replay')
    WHERE r.source = 'replay'),
per_run AS (
    SELECT * EXCLUDE (prefill_tokens, prefill_flops), prefill_tokens AS missed_tokens,
           prefill_flops / $gpu_flops_per_s AS gpu_seconds
    FROM run_prefill($flops_per_token, $flops_per_position)),
spans AS (SELECT * FROM run_hours()),
figures AS (
    SELECT e.*, p.lookups, p.query_tokens, p.hit_tokens, p.missed_tokens, p.gpu_seconds,
           p.cost_model, s.hours,
           bool_or(NOT e.is_replay AND p.run IS NOT NULL) OVER engine AS has_trace,
           min(e.release_order) FILTER (WHERE e.is_replay AND p.run IS NOT NULL) OVER engine
               AS oldest
    FROM engines e
    LEFT JOIN per_run p ON p.run = e.run
    LEFT JOIN spans s ON s.run = e.run
    WINDOW engine AS (PARTITION BY e.engine)),
observed AS (
    -- an engine's traces with lookups (its captures), else the replays of its oldest variant
    SELECT *, lookups IS NOT NULL AND (NOT is_replay OR (NOT has_trace
                                                          AND release_order = oldest))
                  AS observes
    FROM figures),
per_engine AS (
    SELECT engine, any_value(host) AS host, any_value(pid) AS pid, any_value(rank) AS rank,
           list(run ORDER BY run) FILTER (WHERE observes) AS runs,
           coalesce(list(run ORDER BY run) FILTER (WHERE NOT observes), []) AS replays,
           list(DISTINCT source_key ORDER BY source_key) AS sources,
           sum(lookups) FILTER (WHERE observes) AS lookups,
           sum(hit_tokens) FILTER (WHERE observes)
               / nullif(sum(query_tokens) FILTER (WHERE observes), 0) AS hit_rate,
           sum(missed_tokens) FILTER (WHERE observes) AS missed_tokens,
           nullif(sum(hours) FILTER (WHERE observes), 0) AS traffic_hours,
           sum(gpu_seconds) FILTER (WHERE observes) AS gpu_seconds,
           CASE WHEN count(DISTINCT coalesce(cost_model, '')) FILTER (WHERE observes) = 1
                THEN any_value(cost_model) FILTER (WHERE observes) END AS cost_model
    FROM observed
    GROUP BY engine
    HAVING bool_or(observes))
SELECT engine, host, pid, rank, runs, replays, sources, lookups, hit_rate, missed_tokens,
       traffic_hours, missed_tokens / traffic_hours AS missed_tokens_per_hour, gpu_seconds,
       gpu_seconds / traffic_hours AS gpu_seconds_per_hour, cost_model,
       missed_tokens / nullif(sum(missed_tokens) OVER (), 0) AS share_of_fleet_missed
FROM per_engine
ORDER BY gpu_seconds_per_hour DESC NULLS LAST, missed_tokens_per_hour DESC NULLS LAST,
         missed_tokens DESC, engine
