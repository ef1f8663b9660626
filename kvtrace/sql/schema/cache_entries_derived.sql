-- The cache entries: one row per key put on a block (a BlockStored, or a key a start snapshot
-- found cached on it), until it was removed (NULL: still cached when the trace ended). What an
-- entry adds to its store is kept in ``cache_entry_figures`` (database.ENTRY_FIGURE_COLUMNS),
-- filled while each trace loads by the C core of the streaming pass (kvtrace/analysis/stream.py),
-- or, without it, once every trace is in, by this SQL (database.CACHE_ENTRIES_SQL): its twin,
-- and the definition. The ``cache_entries`` view (cache_entries.sql) joins the figures to their
-- stores. The placeholder block_states: block_states.sql over this SQL's entries.
-- ``position_class`` of a CHECKPOINT entry: the storing request's latest CheckpointRecorded at
-- that position and group (``transient``: it says TRANSIENT). ``hits``: BlockTouched on its block
-- while it was the block's newest entry and still there (a block rarely holds two keys; then the
-- newer is credited). ``transient_cached``, for a removed entry: the transient checkpoint entries
-- cached in the free queue just before the removal - blocks whose newest key is a TRANSIENT
-- checkpoint, that hold a key and that no request holds (ref_cnt 0), the removed one included.
-- ``from_snapshot``: cached when the capture began (no kind or request: the snapshot says none).
WITH stored AS (
    SELECT run, variant, backend, seq AS stored_seq, step AS stored_step, block_id, hash_id,
           group_id, num_tokens, kind, req, false AS from_snapshot
    FROM block_stored
    UNION ALL
    SELECT k.run, k.variant, k.backend, k.seq, k.step, b.block_id, k.hash_id, k.group_id,
           k.num_tokens, NULL, NULL, true
    FROM key_cached k JOIN key_cached_block_ids b ON b.run = k.run AND b.seq = k.seq),
entries AS (
    SELECT s.*, r.seq AS removed_seq, r.step AS removed_step, r.reason AS removed_reason,
           CASE WHEN s.kind = 'CHECKPOINT' THEN c.position_class END AS position_class,
           coalesce(s.kind = 'CHECKPOINT' AND c.position_class = 'TRANSIENT', false)
               AS transient
    FROM stored s
    ASOF LEFT JOIN block_removed r
        ON s.run = r.run AND s.block_id = r.block_id AND s.hash_id = r.hash_id
           AND s.group_id = r.group_id AND r.seq > s.stored_seq
    ASOF LEFT JOIN checkpoint_recorded c
        ON s.run = c.run AND s.req = c.req AND s.group_id = c.group_id
           AND s.num_tokens = c.position AND c.seq < s.stored_seq),
hits AS (
    SELECT e.run, e.stored_seq, e.block_id, count(*) AS hits, max(t.seq) AS last_hit_seq,
           max(t.step) AS last_hit_step
    FROM block_touched t
    ASOF JOIN entries e
        ON t.run = e.run AND t.block_id = e.block_id AND e.stored_seq < t.seq
    WHERE e.removed_seq IS NULL OR e.removed_seq > t.seq
    GROUP BY e.run, e.stored_seq, e.block_id),
states AS ({block_states}),
changes AS (
    SELECT run, seq, sum(delta) AS delta
    FROM (SELECT run, seq, flag - coalesce(lag(flag) OVER (
              PARTITION BY run, block_id ORDER BY seq), 0) AS delta
          FROM (SELECT run, seq, block_id, (NOT in_use AND transient)::INTEGER AS flag
                FROM states))
    WHERE delta <> 0
    GROUP BY run, seq),
series AS (
    SELECT run, seq, sum(delta) OVER (PARTITION BY run ORDER BY seq
                                      ROWS UNBOUNDED PRECEDING) AS cached
    FROM changes)
SELECT e.run, e.variant, e.backend, e.stored_seq, e.stored_step, e.block_id, e.hash_id,
       e.group_id, e.num_tokens, e.kind, e.req, e.removed_seq, e.removed_step,
       e.removed_reason, e.position_class, e.transient, coalesce(h.hits, 0) AS hits,
       h.last_hit_seq, h.last_hit_step,
       CASE WHEN e.removed_seq IS NOT NULL THEN coalesce(s.cached, 0) END AS transient_cached,
       e.from_snapshot
FROM entries e
LEFT JOIN hits h
    ON h.run = e.run AND h.stored_seq = e.stored_seq AND h.block_id = e.block_id
ASOF LEFT JOIN series s ON s.run = e.run AND s.seq < e.removed_seq
