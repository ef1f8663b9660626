-- Each run's admitted lookups and the prefill they recomputed, in FLOPs where the run is
-- priced (variant_verdict, fleet: over a GPU's FLOP/s, GPU-seconds).
CREATE OR REPLACE TEMP MACRO run_prefill(flops_per_token, flops_per_position) AS TABLE
SELECT l.run,
       count(*) FILTER (WHERE l.admission = 1) AS lookups,
       sum(l.num_query_tokens) FILTER (WHERE l.admission = 1) AS query_tokens,
       sum(l.num_hit_tokens) FILTER (WHERE l.admission = 1) AS hit_tokens,
       sum(l.num_query_tokens - l.num_hit_tokens) AS prefill_tokens,
       sum(c.per_token * (l.num_query_tokens - l.num_hit_tokens)
           + c.per_position * (l.num_query_tokens * (l.num_query_tokens + 1)
                               - l.num_hit_tokens * (l.num_hit_tokens + 1)) / 2)
           AS prefill_flops,
       any_value(c.cost_model) AS cost_model
FROM lookups l
JOIN run_costs(flops_per_token, flops_per_position) c ON c.run = l.run
WHERE l.admitted
GROUP BY l.run
