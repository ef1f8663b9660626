-- Entries that were hit (the figures are cache_entries' own; kept for older queries).
SELECT run, stored_seq, block_id, hits, last_hit_seq, last_hit_step
FROM cache_entries WHERE hits > 0
