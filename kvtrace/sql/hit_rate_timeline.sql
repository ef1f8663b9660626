-- name: hit_rate_timeline
-- summary: Prefix-cache hit rate per run over time, in buckets of scheduler steps.
-- param: bucket_steps INTEGER = 10 -- steps per bucket
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   backend: its backend
--   step_start: first step of the bucket
--   lookups: first admissions in the bucket (lookups view, admission = 1)
--   query_tokens: sum of the request's num_tokens at that allocate_slots (its prompt)
--   hit_tokens: sum of num_hit_tokens
--   hit_rate: hit_tokens / query_tokens in the bucket
--   cumulative_hit_rate: the same from the run's start to the bucket's end
-- Only a request's first admitted lookup counts, as in `kvtrace replay`'s hit rate: a request
-- that could not be allocated is looked up again, and one resumed after a preemption mostly
-- re-reads its own blocks, which would credit the cache for the preemption.
-- Buckets without a first admission are absent.
WITH buckets AS (
    SELECT run, any_value(variant) AS variant, any_value(backend) AS backend,
           step // $bucket_steps * $bucket_steps AS step_start, count(*) AS lookups,
           sum(num_query_tokens) AS query_tokens, sum(num_hit_tokens) AS hit_tokens
    FROM lookups
    WHERE admission = 1
    GROUP BY run, step_start)
SELECT run, variant, backend, step_start, lookups, query_tokens, hit_tokens,
       hit_tokens / nullif(query_tokens, 0) AS hit_rate,
       sum(hit_tokens) OVER running / nullif(sum(query_tokens) OVER running, 0)
           AS cumulative_hit_rate
FROM buckets
WINDOW running AS (PARTITION BY run ORDER BY step_start ROWS UNBOUNDED PRECEDING)
ORDER BY run, step_start
