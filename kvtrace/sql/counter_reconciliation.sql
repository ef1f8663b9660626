-- name: counter_reconciliation
-- summary: Per run, from the trace alone, what a prefix-cache counter at every lookup reads (vllm #43736; releases before PR #48860) against kvtrace's hit rate (each request's first admitted lookup once, as vLLM 0.30-0.33 count).
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   lookups: every prefix lookup (get_computed_blocks), in requests
--   admitted_first_lookups: the lookups of first admissions, each request's once
--   retried_lookups: lookups whose admission failed, so that the request was looked up again
--   counter_query_tokens: query tokens over every lookup (a counter at the lookup's vllm:prefix_cache_queries)
--   counter_hit_tokens: hit tokens over every lookup (its vllm:prefix_cache_hits)
--   query_tokens: query tokens of the first admitted lookups (what kvtrace's hit rate divides by, and what vLLM 0.30-0.33 count)
--   hit_tokens: their hit tokens
--   counter_hit_rate: counter_hit_tokens / counter_query_tokens
--   hit_rate: hit_tokens / query_tokens
--   overcounted_hit_tokens: hit tokens of the retried lookups, which a counter at the lookup adds again
-- Definitions. A release that records prefix-cache stats at the lookup, before the request is
-- scheduled (vllm #43736), counts a lookup whose admission fails and is retried again, and a
-- resumed lookup after a preemption too; vLLM 0.30-0.33 record them at admission (PR #48860)
-- and leave out a preempted request's lookups, as kvtrace counts: a request's first admitted
-- lookup once (the `lookups` view: admitted = its next allocate_slots succeeded). vLLM's own
-- counters, recorded beside a capture, are reconciled by vllm_counter_reconciliation. Ordered
-- by run.
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
