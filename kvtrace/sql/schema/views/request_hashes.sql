-- Every hash unit a request is known to have: its prompt units (or, in flight when the
-- capture began, its units then), then those decode added. ``unit`` i covers tokens
-- [0, (i + 1) * hash_block_size).
WITH known AS (
    SELECT run, req, pos, hash_id FROM request_arrived_hash_ids
    UNION ALL
    SELECT run, req, pos, hash_id FROM request_state_hash_ids),
counts AS (
    SELECT run, req, num_hash_ids FROM request_arrived
    UNION ALL
    SELECT run, req, num_hash_ids FROM request_state)
SELECT run, req, pos AS unit, hash_id FROM known
UNION ALL
SELECT e.run, e.req,
       coalesce(a.num_hash_ids, 0)
         + row_number() OVER (PARTITION BY e.run, e.req ORDER BY e.seq, e.pos) - 1,
       e.hash_id
FROM hashes_extended_hash_ids e
LEFT JOIN counts a ON a.run = e.run AND a.req = e.req
