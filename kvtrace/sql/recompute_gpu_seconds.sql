-- name: recompute_gpu_seconds
-- summary: Per variant and prefix, GPU-seconds spent recomputing hits the other variant kept.
-- param: fixed VARCHAR = fixed -- one variant of the pair
-- param: unfixed VARCHAR = unfixed -- the other variant of the pair
-- param: flops_per_token DOUBLE = 5531926528 -- FLOPs a token costs besides attention (runs without --execute)
-- param: flops_per_position DOUBLE = 143360 -- attention FLOPs per position a token attends to (likewise)
-- param: gpu_flops_per_s DOUBLE = 395760000000000 -- effective GPU FLOP/s (likewise; H200 x 40%)
-- returns:
--   source: the source trace both variants replayed (runs.source_key)
--   backend: the replay backend of both runs
--   variant: the run that recomputed
--   other_variant: the run whose twin lookup kept the hit
--   prefix_hash_id: hash unit id of the prefix the other variant hit (from the request's hash ids)
--   depth_tokens: tokens that prefix covers
--   lookups: paired lookups where variant hit fewer tokens than other_variant's hit of this prefix
--   tokens_recomputed: sum over those lookups of depth_tokens - the variant's own hit tokens
--   gpu_seconds: the prefill FLOPs of those tokens at the variant's GPU throughput
--   cost_source: execute (figures from the run's header: replay --execute) or default (the params)
-- Definitions. Runs pair as in lost_hits_by_prefix (same source_key, backend and mode; variants
-- $fixed and $unfixed), each in both roles, and so do their admitted lookups (by request and
-- admission number). A lookup whose hit h is shorter than its twin's hit d recomputed tokens
-- [h, d); the token at depth t costs flops_per_token + flops_per_position * (t + 1) FLOPs
-- (docs/execute.md: Kimi-Linear's projections, KDA and MoE layers, causal MLA attention), so
-- the lookup costs flops_per_token * (d - h) + flops_per_position * (d(d+1) - h(h+1)) / 2.
-- The defaults are Kimi-Linear-48B-A3B on an H200 (989.4 TFLOP/s dense BF16 x 40%).
-- A run replayed with --execute carries its own figures in its header
-- (params execute.flops_per_token, execute.flops_per_token_per_position,
-- execute.gpu_flops_per_s); the parameters price the others. Ranked by gpu_seconds.
WITH run_pairs AS (
    SELECT a.run, b.run AS other_run, a.variant, b.variant AS other_variant, a.source_key,
           a.backend, a.hash_block_size
    FROM runs a
    JOIN runs b ON b.source_key = a.source_key AND b.backend = a.backend AND b.mode = a.mode
    WHERE (a.variant = $fixed AND b.variant = $unfixed)
       OR (a.variant = $unfixed AND b.variant = $fixed)),
figures AS (
    SELECT run,
           TRY_CAST(json_extract_string(header_json, '$.params."execute.flops_per_token"')
                    AS DOUBLE) AS per_token,
           TRY_CAST(json_extract_string(
                        header_json, '$.params."execute.flops_per_token_per_position"')
                    AS DOUBLE) AS per_position,
           TRY_CAST(json_extract_string(header_json, '$.params."execute.gpu_flops_per_s"')
                    AS DOUBLE) AS per_second
    FROM runs),
costs AS (
    SELECT run,
           CASE WHEN per_token IS NULL OR per_position IS NULL OR per_second IS NULL
                THEN 'default' ELSE 'execute' END AS cost_source,
           coalesce(per_token, $flops_per_token) AS per_token,
           coalesce(per_position, $flops_per_position) AS per_position,
           coalesce(per_second, $gpu_flops_per_s) AS per_second
    FROM figures),
kept AS (
    SELECT p.*, own.req, own.num_hit_tokens AS own_hit, twin.num_hit_tokens AS depth
    FROM run_pairs p
    JOIN lookups own ON own.run = p.run AND own.admitted
    JOIN lookups twin
        ON twin.run = p.other_run AND twin.admitted AND twin.req = own.req
           AND twin.admission = own.admission
    WHERE twin.num_hit_tokens > own.num_hit_tokens)
SELECT k.source_key AS source, k.backend, k.variant, k.other_variant,
       h.hash_id AS prefix_hash_id, k.depth AS depth_tokens, count(*) AS lookups,
       sum(k.depth - k.own_hit) AS tokens_recomputed,
       sum((c.per_token * (k.depth - k.own_hit)
            + c.per_position * (k.depth * (k.depth + 1) - k.own_hit * (k.own_hit + 1)) / 2)
           / c.per_second) AS gpu_seconds,
       c.cost_source
FROM kept k
JOIN costs c ON c.run = k.run
JOIN request_hashes h
    ON h.run = k.other_run AND h.req = k.req AND h.unit = k.depth // k.hash_block_size - 1
GROUP BY ALL
ORDER BY gpu_seconds DESC, source, variant, prefix_hash_id
