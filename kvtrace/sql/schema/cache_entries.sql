-- The cache entries: their figures (cache_entry_figures.sql, once for each kind of store) with
-- their stores' fields: cache_entries_derived.sql's columns.
SELECT s.run, s.variant, s.backend, f.stored_seq, s.step AS stored_step, f.block_id,
       s.hash_id, s.group_id, s.num_tokens, s.kind, s.req, {stored_figures},
       false AS from_snapshot
FROM cache_entry_figures f
JOIN block_stored s ON s.run = f.run AND s.seq = f.stored_seq
UNION ALL
SELECT k.run, k.variant, k.backend, f.stored_seq, k.step, f.block_id, k.hash_id,
       k.group_id, k.num_tokens, NULL, NULL, {snapshot_figures}, true
FROM cache_entry_figures f
JOIN (SELECT *, NULL::VARCHAR AS kind FROM key_cached) k
    ON k.run = f.run AND k.seq = f.stored_seq
