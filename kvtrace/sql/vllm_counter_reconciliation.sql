-- name: vllm_counter_reconciliation
-- summary: Per run, vLLM's own prefix-cache counters, scraped beside its capture, against what the trace says they counted: at admission (vLLM 0.30-0.33) or at every lookup (vllm #43736).
-- param: lag_ms DOUBLE = 500 -- how long a scheduler step's counts may take to reach vLLM's /metrics: the scrapes' edge uncertainty
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   scrapes: scrapes of vLLM's /metrics inside the window (NULL: none recorded beside the trace)
--   window_s: seconds from the window's first scrape to its last; kvtrace's columns count the lookups between them (with fewer than two scrapes, the whole trace)
--   vllm_query_tokens: the increase of vllm:prefix_cache_queries_total over the window
--   vllm_hit_tokens: the increase of vllm:prefix_cache_hits_total
--   vllm_hit_rate: vllm_hit_tokens / vllm_query_tokens, what a dashboard shows
--   admitted_lookups: admitted lookups of requests never preempted (first admissions) in the window
--   admitted_query_tokens: their query tokens, what a counter at admission adds
--   admitted_hit_tokens: their hit tokens
--   hit_rate: admitted_hit_tokens / admitted_query_tokens, kvtrace's hit rate
--   retried_lookups: lookups of requests never preempted whose admission failed, which a counter at the lookup adds too
--   retried_query_tokens: their query tokens
--   retried_hit_tokens: their hit tokens
--   edge_query_tokens: query tokens admitted within lag_ms before the window's first or last scrape, which those scrapes may or may not hold
--   overcounted_query_tokens: vllm_query_tokens - admitted_query_tokens, what vLLM counted beyond kvtrace's admitted lookups
--   overcounted_hit_tokens: vllm_hit_tokens - admitted_hit_tokens
--   overcounted_lookups: lookups vLLM counted again: retried_lookups when it counted at the lookup, 0 at admission, NULL when that cannot be told
--   counting: the rule vLLM's counters followed: 'admission', 'lookup', 'either' (too few retried tokens to tell), 'neither', NULL without two scrapes
--   vllm_preemptions: the increase of vllm:num_preemptions_total
--   preemptions: requests preempted in the window (request_preempted)
--   vllm_finished_requests: the increase of vllm:request_success_total, every finish reason
--   finished_requests: requests finished or aborted in the window (request_finished)
-- Definitions (docs/vllm-counters.md). The counters are vllm_counters' rows, loaded from the
-- sidecar kvtrace capture --vllm-metrics writes beside the trace. vLLM counts a request's query
-- tokens and hits while it has never been preempted (PrefixCacheStats.record): vLLM 0.30-0.33
-- once, when its allocation succeeds (vllm PR #48860: admitted lookups), a release without #48860
-- at every lookup, a retry after a failed allocation included (#43736). A lookup is timed by its
-- scheduler step's start (created_ns + step_started.ts_ns), the wall clock the scrapes carry. A
-- scrape holds the counts of the steps that started before it, but may lack those of the last
-- lag_ms; so the window starts at the first scrape lag_ms into the trace and ends at the last one
-- before its last step starts, and a rule fits when the counters' increase lies between its count
-- over the window less what it counts in the lag_ms before the last scrape, and its count plus
-- what it counts in the lag_ms before the first, for query and hit tokens alike. Ordered by run.
WITH spans AS (
    SELECT r.run, r.variant, r.created_ns, r.created_ns + max(s.ts_ns) AS last_step_ns
    FROM runs r
    LEFT JOIN step_started s ON s.run = r.run
    GROUP BY r.run, r.variant, r.created_ns),
recorded AS (
    SELECT DISTINCT run, ts_ns FROM vllm_counters),
windows AS (
    SELECT p.run, p.variant, p.created_ns,
           CASE WHEN count(c.run) > 0 THEN count(c.ts_ns) FILTER (
               WHERE c.ts_ns >= p.created_ns + $lag_ms * 1e6 AND c.ts_ns <= p.last_step_ns) END
               AS scrapes,
           min(c.ts_ns) FILTER (WHERE c.ts_ns >= p.created_ns + $lag_ms * 1e6) AS first_ns,
           max(c.ts_ns) FILTER (WHERE c.ts_ns <= p.last_step_ns) AS last_ns
    FROM spans p
    LEFT JOIN recorded c ON c.run = p.run
    GROUP BY p.run, p.variant, p.created_ns),
increases AS (
    SELECT c.run, c.name, c.labels,
           coalesce(max(c.value) FILTER (WHERE c.ts_ns = w.last_ns), 0)
               - coalesce(max(c.value) FILTER (WHERE c.ts_ns = w.first_ns), 0) AS increase
    FROM vllm_counters c
    JOIN windows w ON w.run = c.run AND w.scrapes >= 2
    WHERE c.ts_ns = w.first_ns OR c.ts_ns = w.last_ns
    GROUP BY c.run, c.name, c.labels),
measured AS (
    SELECT run,
           sum(increase) FILTER (WHERE name = 'vllm:prefix_cache_queries_total') AS queries,
           sum(increase) FILTER (WHERE name = 'vllm:prefix_cache_hits_total') AS hits,
           sum(increase) FILTER (WHERE name = 'vllm:num_preemptions_total') AS vllm_preemptions,
           sum(increase) FILTER (WHERE name = 'vllm:request_success_total') AS vllm_finished
    FROM increases
    GROUP BY run),
events AS (  -- what the window counts, each at its step's start
    SELECT l.run, l.step, 'lookup' AS kind, l.admitted, l.num_query_tokens AS query,
           l.num_hit_tokens AS hit
    FROM lookups l
    WHERE NOT EXISTS (SELECT 1 FROM request_preempted p
                      WHERE p.run = l.run AND p.req = l.req AND p.seq < l.seq)
      AND NOT EXISTS (SELECT 1 FROM request_state q
                      WHERE q.run = l.run AND q.req = l.req AND q.num_preemptions > 0)
    UNION ALL SELECT run, step, 'preempted', NULL, 0, 0 FROM request_preempted
    UNION ALL SELECT run, step, 'finished', NULL, 0, 0 FROM request_finished),
timed AS (
    SELECT e.*, w.created_ns + coalesce(s.ts_ns, 0) AS at_ns, coalesce(w.scrapes, 0) >= 2
               AS windowed, w.first_ns, w.last_ns
    FROM events e
    JOIN windows w ON w.run = e.run
    LEFT JOIN step_started s ON s.run = e.run AND s.step = e.step),
placed AS (
    SELECT *, NOT windowed OR (at_ns > first_ns AND at_ns <= last_ns) AS inside,
           at_ns > first_ns - $lag_ms * 1e6 AND at_ns <= first_ns AS near_first,
           at_ns > last_ns - $lag_ms * 1e6 AND at_ns <= last_ns AS near_last
    FROM timed),
counted AS (
    SELECT run,
           count(*) FILTER (WHERE kind = 'lookup' AND admitted AND inside) AS admitted_lookups,
           coalesce(sum(query) FILTER (WHERE admitted AND inside), 0) AS admitted_query,
           coalesce(sum(hit) FILTER (WHERE admitted AND inside), 0) AS admitted_hit,
           count(*) FILTER (WHERE kind = 'lookup' AND NOT admitted AND inside) AS retried_lookups,
           coalesce(sum(query) FILTER (WHERE NOT admitted AND inside), 0) AS retried_query,
           coalesce(sum(hit) FILTER (WHERE NOT admitted AND inside), 0) AS retried_hit,
           -- each rule's count in the lag before the first scrape (f) and the last (l)
           coalesce(sum(query) FILTER (WHERE admitted AND near_first), 0) AS a_query_f,
           coalesce(sum(query) FILTER (WHERE admitted AND near_last), 0) AS a_query_l,
           coalesce(sum(hit) FILTER (WHERE admitted AND near_first), 0) AS a_hit_f,
           coalesce(sum(hit) FILTER (WHERE admitted AND near_last), 0) AS a_hit_l,
           coalesce(sum(query) FILTER (WHERE near_first), 0) AS l_query_f,
           coalesce(sum(query) FILTER (WHERE near_last), 0) AS l_query_l,
           coalesce(sum(hit) FILTER (WHERE near_first), 0) AS l_hit_f,
           coalesce(sum(hit) FILTER (WHERE near_last), 0) AS l_hit_l,
           count(*) FILTER (WHERE kind = 'preempted' AND inside) AS preemptions,
           count(*) FILTER (WHERE kind = 'finished' AND inside) AS finished
    FROM placed
    GROUP BY run),
judged AS (
    SELECT w.run, w.variant, w.scrapes, w.first_ns, w.last_ns, m.* EXCLUDE (run),
           c.* EXCLUDE (run),
           m.queries BETWEEN c.admitted_query - c.a_query_l AND c.admitted_query + c.a_query_f
           AND m.hits BETWEEN c.admitted_hit - c.a_hit_l AND c.admitted_hit + c.a_hit_f
               AS fits_admission,
           m.queries BETWEEN c.admitted_query + c.retried_query - c.l_query_l
                         AND c.admitted_query + c.retried_query + c.l_query_f
           AND m.hits BETWEEN c.admitted_hit + c.retried_hit - c.l_hit_l
                      AND c.admitted_hit + c.retried_hit + c.l_hit_f AS fits_lookup
    FROM windows w
    LEFT JOIN measured m ON m.run = w.run
    LEFT JOIN counted c ON c.run = w.run),
named AS (
    SELECT *, CASE WHEN queries IS NULL THEN NULL
                   WHEN fits_admission AND fits_lookup THEN 'either'
                   WHEN fits_admission THEN 'admission'
                   WHEN fits_lookup THEN 'lookup'
                   ELSE 'neither' END AS counting
    FROM judged)
SELECT run, variant, scrapes,
       CASE WHEN scrapes >= 2 THEN (last_ns - first_ns) / 1e9 END AS window_s,
       queries::BIGINT AS vllm_query_tokens, hits::BIGINT AS vllm_hit_tokens,
       hits / nullif(queries, 0) AS vllm_hit_rate,
       coalesce(admitted_lookups, 0) AS admitted_lookups,
       coalesce(admitted_query, 0) AS admitted_query_tokens,
       coalesce(admitted_hit, 0) AS admitted_hit_tokens,
       admitted_hit / nullif(admitted_query, 0) AS hit_rate,
       coalesce(retried_lookups, 0) AS retried_lookups,
       coalesce(retried_query, 0) AS retried_query_tokens,
       coalesce(retried_hit, 0) AS retried_hit_tokens,
       CASE WHEN scrapes >= 2 THEN a_query_f + a_query_l END AS edge_query_tokens,
       (queries - admitted_query)::BIGINT AS overcounted_query_tokens,
       (hits - admitted_hit)::BIGINT AS overcounted_hit_tokens,
       CASE counting WHEN 'lookup' THEN retried_lookups WHEN 'admission' THEN 0
                     WHEN 'either' THEN CASE WHEN retried_lookups = 0 THEN 0 END END
           AS overcounted_lookups,
       counting,
       vllm_preemptions::BIGINT AS vllm_preemptions, coalesce(preemptions, 0) AS preemptions,
       vllm_finished::BIGINT AS vllm_finished_requests,
       coalesce(finished, 0) AS finished_requests
FROM named
ORDER BY run
