-- The state of a block after each event that changes it, given the relation of its cache
-- entries (the placeholder entries): in_use (ref_cnt > 0: allocated or touched, until freed to 0; a start
-- snapshot says so too), num_keys (hashes on it), transient (its newest key is a TRANSIENT
-- checkpoint); key_epoch counts the keys stored on it so far and is_touch marks hits, so
-- that hits since the newest key are a sum over (block_id, key_epoch).
WITH events AS (
    SELECT run, seq, step, block_id, true AS in_use, 0 AS key_delta,
           NULL::BOOLEAN AS transient, 0 AS is_store, 0 AS is_touch
    FROM block_allocated
    UNION ALL SELECT run, seq, step, block_id, true, 0, NULL, 0, 1 FROM block_touched
    UNION ALL SELECT run, seq, step, block_id, ref_cnt > 0, 0, NULL, 0, 0 FROM block_freed
    UNION ALL SELECT run, seq, step, block_id, ref_cnt > 0, 0, NULL, 0, 0 FROM block_state
    UNION ALL SELECT run, stored_seq, stored_step, block_id, NULL, 1, transient, 1, 0
              FROM {entries}
    UNION ALL SELECT run, seq, step, block_id, NULL, -1, NULL, 0, 0 FROM block_removed),
running AS (
    SELECT run, seq, step, block_id, is_touch,
           coalesce(last_value(in_use IGNORE NULLS) OVER w, false) AS in_use,
           sum(key_delta) OVER w AS num_keys,
           coalesce(last_value(transient IGNORE NULLS) OVER w, false) AS transient,
           sum(is_store) OVER w AS key_epoch
    FROM events
    WINDOW w AS (PARTITION BY run, block_id ORDER BY seq ROWS UNBOUNDED PRECEDING))
SELECT run, seq, step, block_id, in_use, num_keys, transient AND num_keys > 0 AS transient,
       key_epoch, is_touch
FROM running
