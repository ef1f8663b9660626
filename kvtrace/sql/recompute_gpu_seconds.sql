-- name: recompute_gpu_seconds
-- summary: Per variant and prefix, GPU-seconds spent recomputing hits the other variant kept.
-- param: fixed VARCHAR = fixed -- one variant of the pair
-- param: unfixed VARCHAR = unfixed -- the other variant of the pair
-- param: gpu_flops_per_s DOUBLE = 395760000000000 -- effective GPU FLOP/s (default: an H200's 989.4 TFLOP/s dense BF16 peak x 40%)
-- param: flops_per_token DOUBLE = 0 -- for runs whose header names no model: FLOPs a token costs besides attention (0: leave them unpriced)
-- param: flops_per_position DOUBLE = 0 -- likewise: attention FLOPs per position a token attends to
-- returns:
--   source: the source trace both variants replayed (runs.source_key)
--   backend: the replay backend of both runs
--   variant: the run that recomputed
--   other_variant: the run whose twin lookup kept the hit
--   prefix_hash_id: hash unit id of the prefix the other variant hit (from the request's hash ids)
--   depth_tokens: tokens that prefix covers
--   lookups: paired lookups where variant hit fewer tokens than other_variant's hit of this prefix
--   tokens_recomputed: sum over those lookups of depth_tokens - the variant's own hit tokens
--   gpu_seconds: the prefill FLOPs of those tokens at gpu_flops_per_s (NULL: unpriced)
--   cost_model: the model whose FLOPs priced them (the run's header), '(parameters)' when the flops parameters did, NULL when neither
-- Definitions. Runs pair as in lost_hits_by_prefix (same source_key, backend and mode; variants
-- $fixed and $unfixed), each in both roles, and so do their admitted lookups (by request and
-- admission number). A lookup whose hit h is shorter than its twin's hit d recomputed tokens
-- [h, d); the token at depth t costs flops_per_token + flops_per_position * (t + 1) FLOPs
-- (docs/cost-model.md: the model's own blocks, causal attention), so the lookup costs
-- flops_per_token * (d - h) + flops_per_position * (d(d+1) - h(h+1)) / 2, over its
-- tensor-parallel group. A replay names its model and carries its figures in its header
-- (params cost.model, cost.flops_per_token, cost.flops_per_token_per_position, written by
-- `kvtrace replay` for the model the source was written for or its --model; execute.* in
-- traces of older kvtrace versions); the parameters price the runs that carry none (a capture
-- replayed without --model). Ranked by gpu_seconds.
WITH run_pairs AS (
    SELECT a.run, b.run AS other_run, a.variant, b.variant AS other_variant, a.source_key,
           a.backend, a.hash_block_size
    FROM runs a
    JOIN runs b ON b.source_key = a.source_key AND b.backend = a.backend AND b.mode = a.mode
    WHERE (a.variant = $fixed AND b.variant = $unfixed)
       OR (a.variant = $unfixed AND b.variant = $fixed)),
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
           / $gpu_flops_per_s) AS gpu_seconds,
       c.cost_model
FROM kept k
JOIN run_costs($flops_per_token, $flops_per_position) c ON c.run = k.run
JOIN request_hashes h
    ON h.run = k.other_run AND h.req = k.req AND h.unit = k.depth // k.hash_block_size - 1
GROUP BY ALL
ORDER BY gpu_seconds DESC NULLS LAST, tokens_recomputed DESC, source, variant, prefix_hash_id
