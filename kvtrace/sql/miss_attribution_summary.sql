-- name: miss_attribution_summary
-- summary: Per run and kind of lookup, where the query tokens went: hit, and tokens per cause.
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   backend: its backend
--   hash_unit: the run's hash unit in tokens (hash_block_size)
--   lookups: 'first' (a request's first admission, as replay's hit rate counts) or 'resumed'
--   num_lookups: admitted lookups of that kind
--   query_tokens: their query tokens
--   ideal_tokens: their ideal hits (an unbounded cache under the same schedule)
--   hit_tokens: their hits
--   cause: a cause of missed tokens (miss_attribution)
--   in_shortfall: whether the cause is part of ideal - hit (else it lies beyond the ideal)
--   tokens: tokens that cause cost those lookups
--   share_of_query: tokens / query_tokens
--   share_of_missed: tokens / (query_tokens - hit_tokens)
-- One row per run, kind and cause with tokens; hit_tokens + the sum of a kind's tokens =
-- query_tokens. Ordered by run, kind, then the cause order of the waterfall.
WITH per_lookup AS (
    SELECT run, seq, any_value(variant) AS variant, any_value(backend) AS backend,
           any_value(resumed) AS resumed, any_value(query_tokens) AS query_tokens,
           any_value(ideal_tokens) AS ideal_tokens, any_value(hit_tokens) AS hit_tokens
    FROM miss_attribution
    GROUP BY run, seq),
totals AS (
    SELECT run, resumed, any_value(variant) AS variant, any_value(backend) AS backend,
           count(*) AS num_lookups, sum(query_tokens) AS query_tokens,
           sum(ideal_tokens) AS ideal_tokens, sum(hit_tokens) AS hit_tokens
    FROM per_lookup
    GROUP BY run, resumed),
per_cause AS (
    SELECT run, resumed, cause, any_value(in_shortfall) AS in_shortfall, sum(tokens) AS tokens
    FROM miss_attribution
    GROUP BY run, resumed, cause)
SELECT t.run, t.variant, t.backend, r.hash_block_size AS hash_unit,
       CASE WHEN t.resumed THEN 'resumed' ELSE 'first' END AS lookups,
       t.num_lookups, t.query_tokens, t.ideal_tokens, t.hit_tokens, c.cause, c.in_shortfall,
       c.tokens, c.tokens / nullif(t.query_tokens, 0) AS share_of_query,
       c.tokens / nullif(t.query_tokens - t.hit_tokens, 0) AS share_of_missed
FROM totals t
JOIN runs r ON r.run = t.run
JOIN per_cause c ON c.run = t.run AND c.resumed = t.resumed
ORDER BY t.run, t.resumed, c.cause
