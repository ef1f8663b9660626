-- name: counter_reconciliation
-- summary: Per run, vLLM's prefix-cache counters (every lookup) against kvtrace's (each request's first admitted lookup once).
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   lookups: every prefix lookup (get_computed_blocks), as vLLM's prefix_cache_queries counts them (in requests)
--   admitted_first_lookups: the lookups of first admissions, each request's once
--   retried_lookups: lookups whose admission failed, so that the request was looked up again
--   counter_query_tokens: query tokens over every lookup (vllm:prefix_cache_queries)
--   counter_hit_tokens: hit tokens over every lookup (vllm:prefix_cache_hits)
--   query_tokens: query tokens of the first admitted lookups (what kvtrace's hit rate divides by)
--   hit_tokens: their hit tokens
--   counter_hit_rate: counter_hit_tokens / counter_query_tokens
--   hit_rate: hit_tokens / query_tokens
--   overcounted_hit_tokens: hit tokens of the retried lookups, which vLLM's counter adds again
-- Definitions. vLLM records prefix-cache stats at the lookup, before the request is scheduled
-- (vllm #43736), so a lookup whose admission fails and is retried counts again; kvtrace counts
-- a request's first admitted lookup once (the `lookups` view: admitted = its next
-- allocate_slots succeeded). Resumed lookups after a preemption count in the counter and not
-- in hit_rate. Ordered by run.
SELECT l.run, any_value(l.variant) AS variant, count(*) AS lookups,
       count(*) FILTER (WHERE l.admission = 1) AS admitted_first_lookups,
       count(*) FILTER (WHERE NOT l.admitted) AS retried_lookups,
       sum(l.num_query_tokens) AS counter_query_tokens,
       sum(l.num_hit_tokens) AS counter_hit_tokens,
       sum(l.num_query_tokens) FILTER (WHERE l.admission = 1) AS query_tokens,
       sum(l.num_hit_tokens) FILTER (WHERE l.admission = 1) AS hit_tokens,
       sum(l.num_hit_tokens) / nullif(sum(l.num_query_tokens), 0) AS counter_hit_rate,
       sum(l.num_hit_tokens) FILTER (WHERE l.admission = 1)
           / nullif(sum(l.num_query_tokens) FILTER (WHERE l.admission = 1), 0) AS hit_rate,
       coalesce(sum(l.num_hit_tokens) FILTER (WHERE NOT l.admitted), 0)
           AS overcounted_hit_tokens
FROM lookups l
GROUP BY l.run
ORDER BY l.run
