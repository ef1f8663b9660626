-- Every prefix lookup (get_computed_blocks). ``admitted``: the next allocate_slots of the
-- request, before its next lookup, succeeded (a failed admission is looked up again later,
-- and only the admitted lookup decides what gets prefilled). ``admission`` numbers a
-- request's admitted lookups (a preempted request is admitted again) for pairing variants;
-- a request in flight when the capture began (``in_flight``: in its start snapshot) counts
-- on from the admissions it had had (its first, one per preemption, none while waiting).
WITH found AS (
    SELECT c.*, lead(c.seq) OVER (PARTITION BY c.run, c.req ORDER BY c.seq) AS next_lookup_seq
    FROM computed_blocks_found c),
judged AS (
    SELECT f.run, f.variant, f.backend, f.seq, f.step, f.req, f.num_hit_tokens,
           f.shared_prefix_boundary, s.num_tokens AS num_query_tokens,
           coalesce(s.success AND s.seq < coalesce(f.next_lookup_seq, 9223372036854775807),
                    false) AS admitted
    FROM found f ASOF LEFT JOIN slots_allocated s
        ON f.run = s.run AND f.req = s.req AND s.seq > f.seq),
prior AS (
    SELECT run, req, max(num_preemptions + (queue = 'RUNNING')::INTEGER) AS admissions
    FROM request_state
    GROUP BY run, req)
SELECT j.*, CASE WHEN admitted THEN row_number() OVER (
                PARTITION BY j.run, j.req, admitted ORDER BY j.seq)
                + coalesce(p.admissions, 0) END AS admission,
       p.req IS NOT NULL AS in_flight
FROM judged j
LEFT JOIN prior p ON p.run = j.run AND p.req = j.req
