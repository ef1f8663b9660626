-- name: diagnosis
-- summary: Per run, kind of lookup and cause: the tokens it cost, their prefill GPU-seconds, and the requests that lost most to it (what kvtrace doctor ranks).
-- param: gpu_flops_per_s DOUBLE = 395760000000000 -- effective GPU FLOP/s (default: an H200's 989.4 TFLOP/s dense BF16 peak x 40%)
-- param: flops_per_token DOUBLE = 0 -- for runs whose header names no model: FLOPs a token costs besides attention (0: leave them unpriced)
-- param: flops_per_position DOUBLE = 0 -- likewise: attention FLOPs per position a token attends to
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   lookups: 'first' (a request's first admission) or 'resumed' (after a preemption)
--   num_lookups: admitted lookups of that kind
--   query_tokens: their query tokens
--   hit_tokens: their hits
--   cause: a cause of missed tokens (miss_attribution)
--   tokens: tokens that cause cost those lookups
--   gpu_seconds: the prefill FLOPs of those tokens at gpu_flops_per_s (NULL: unpriced)
--   cost_model: the model whose FLOPs priced them (as in recompute_gpu_seconds), NULL when unpriced
--   traffic_hours: hours from the run's first arrival to its last scheduler step (NULL: no steps)
--   examples: up to three requests that lost the most tokens to the cause, most first
-- Definitions (docs/miss-attribution.md, docs/commands/doctor.md). The tokens are
-- miss_attribution's; a segment [from, to) of a query costs flops_per_token * (to - from) +
-- flops_per_position * (to(to+1) - from(from+1)) / 2 FLOPs (docs/cost-model.md), with the run's
-- own figures where its header carries them (run_costs). Ordered by run, kind, then tokens.
WITH per_lookup AS (
    SELECT run, seq, any_value(resumed) AS resumed, any_value(query_tokens) AS query_tokens,
           any_value(hit_tokens) AS hit_tokens
    FROM miss_attribution
    GROUP BY run, seq),
totals AS (
    SELECT run, resumed, count(*) AS num_lookups, sum(query_tokens) AS query_tokens,
           sum(hit_tokens) AS hit_tokens
    FROM per_lookup
    GROUP BY run, resumed),
per_request AS (
    SELECT run, resumed, cause, req, sum(tokens) AS tokens,
           sum(to_tokens * (to_tokens + 1) - from_tokens * (from_tokens + 1)) AS positions
    FROM miss_attribution
    GROUP BY run, resumed, cause, req),
per_cause AS (
    -- Integer sums, priced once per cause: the same figures whatever order DuckDB adds in.
    SELECT p.run, p.resumed, p.cause, sum(p.tokens) AS tokens,
           (any_value(c.per_token) * sum(p.tokens)
            + any_value(c.per_position) * sum(p.positions) / 2) / $gpu_flops_per_s
               AS gpu_seconds,
           any_value(c.cost_model) AS cost_model,
           list(p.req ORDER BY p.tokens DESC, p.req)[1:3] AS examples
    FROM per_request p
    JOIN run_costs($flops_per_token, $flops_per_position) c ON c.run = p.run
    GROUP BY p.run, p.resumed, p.cause),
spans AS (SELECT * FROM run_hours())
SELECT t.run, r.variant, CASE WHEN t.resumed THEN 'resumed' ELSE 'first' END AS lookups,
       t.num_lookups, t.query_tokens, t.hit_tokens, c.cause, c.tokens, c.gpu_seconds,
       c.cost_model, nullif(s.hours, 0) AS traffic_hours, c.examples
FROM totals t
JOIN runs r ON r.run = t.run
JOIN per_cause c ON c.run = t.run AND c.resumed = t.resumed
LEFT JOIN spans s ON s.run = t.run
ORDER BY t.run, t.resumed, c.tokens DESC, c.cause
