-- name: checkpoint_publications
-- summary: Internal prefill checkpoints recorded, published and suppressed, by position class.
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   group_id: the Mamba/KDA KV-cache group
--   position_class: TRANSIENT, PROMPT_END or JUNCTION (NULL: no CheckpointRecorded matched)
--   recorded: CheckpointRecorded records
--   published: BlockStored records of kind CHECKPOINT
--   suppressed: CheckpointSuppressed records (kept request-local by the #56794 gate)
--   stripped_hashes: sum of num_stripped over the suppressions
--   hits_on_published: hits on the published entries (cache_entries.hits)
--   published_evicted_by_lru: published entries later removed with reason LRU_REUSE
-- A published or suppressed checkpoint takes the class of the request's latest
-- CheckpointRecorded at the same group and position before it.
WITH facts AS (
    SELECT run, group_id, position_class, 'recorded' AS fact, 0 AS stripped, 0 AS hits,
           false AS evicted
    FROM checkpoint_recorded
    UNION ALL
    SELECT e.run, e.group_id, e.position_class, 'published', 0, e.hits,
           coalesce(e.removed_reason = 'LRU_REUSE', false)
    FROM cache_entries e
    WHERE e.kind = 'CHECKPOINT'
    UNION ALL
    SELECT s.run, s.group_id, c.position_class, 'suppressed', s.num_stripped, 0, false
    FROM checkpoint_suppressed s
    ASOF LEFT JOIN checkpoint_recorded c
        ON s.run = c.run AND s.req = c.req AND s.group_id = c.group_id
           AND s.position = c.position AND c.seq < s.seq)
SELECT f.run, r.variant, f.group_id, f.position_class,
       count(*) FILTER (WHERE fact = 'recorded') AS recorded,
       count(*) FILTER (WHERE fact = 'published') AS published,
       count(*) FILTER (WHERE fact = 'suppressed') AS suppressed,
       sum(stripped) AS stripped_hashes,
       sum(hits) AS hits_on_published,
       count(*) FILTER (WHERE evicted) AS published_evicted_by_lru
FROM facts f
JOIN runs r ON r.run = f.run
GROUP BY ALL
ORDER BY f.run, f.group_id, f.position_class
