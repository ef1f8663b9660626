-- Every hot prefix entry evicted by LRU reuse while at least ``min_transient`` transient
-- checkpoints sat cached in the free queue (had they not been cached, they would have been
-- reused first), once with each later lookup that needed it and hit less, or once with NULL
-- lookup columns when none did. Definitions: kvtrace/sql/checkpoint_pushouts.sql. The
-- eviction-time figures (hits, transient_cached) are cache_entries' own, made while loading.
CREATE OR REPLACE TEMP MACRO checkpoint_pushout_lookups(min_hits, min_transient) AS TABLE
WITH hot_evictions AS (
    SELECT *, transient_cached AS cached_transient
    FROM cache_entries
    WHERE removed_reason = 'LRU_REUSE' AND hits > 0 AND hits >= min_hits
          AND transient_cached >= min_transient),
pushouts AS (
    SELECT v.*, coalesce(n.seq, 9223372036854775807) AS restored_seq
    FROM hot_evictions v
    ASOF LEFT JOIN (SELECT run, hash_id, group_id, seq FROM block_stored
                    SEMI JOIN hot_evictions USING (run, hash_id, group_id)) n
        ON v.run = n.run AND v.hash_id = n.hash_id AND v.group_id = n.group_id
           AND n.seq > v.removed_seq),
windows AS MATERIALIZED (
    SELECT p.run, p.removed_seq, p.restored_seq, p.num_tokens, owner.unit,
           owner.hash_id AS unit_hash
    FROM pushouts p
    JOIN runs r ON r.run = p.run
    JOIN request_hashes owner
        ON owner.run = p.run AND owner.req = p.req
           AND owner.unit = p.num_tokens // r.hash_block_size - 1),
-- each admitted lookup's units its hit did not reach (a prefix of depth d needs unit
-- d // unit - 1, and a hit below d leaves it missed): joined by key, not by time
missed_units AS MATERIALIZED (
    SELECT l.run, l.seq, l.req, l.num_hit_tokens, h.unit, h.hash_id
    FROM lookups l
    JOIN runs r ON r.run = l.run
    JOIN request_hashes h
        ON h.run = l.run AND h.req = l.req
           AND (h.unit + 2) * r.hash_block_size > l.num_hit_tokens
    WHERE l.admitted),
missed AS (
    SELECT w.run, w.removed_seq, m.seq AS lookup_seq, m.req AS lookup_req,
           m.num_hit_tokens
    FROM windows w
    JOIN missed_units m
        ON m.run = w.run AND m.unit = w.unit AND m.hash_id = w.unit_hash
           AND m.seq > w.removed_seq AND m.seq < w.restored_seq
           AND m.num_hit_tokens < w.num_tokens)
SELECT p.*, m.lookup_seq, m.lookup_req, m.num_hit_tokens
FROM pushouts p
LEFT JOIN missed m ON m.run = p.run AND m.removed_seq = p.removed_seq
