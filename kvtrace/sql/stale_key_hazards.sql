-- name: stale_key_hazards
-- summary: Keys left on checkpoint slots that hold a different state, and the hits that read them.
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   seq: seq of the StaleKeyLeft record
--   step: its step
--   req: the request whose checkpoint slot kept the key
--   group_id: KV-cache group
--   block_id: the slot
--   hash_id: the stale key
--   key_num_tokens: tokens the key claims
--   state_num_tokens: tokens of the state the slot holds
--   key_removed_seq: seq of the key's removal (NULL: still there when the trace ended)
--   wrong_state_hits: BlockTouched on the slot after the hazard while the key was still on it
-- A hit counted in wrong_state_hits would load the state at state_num_tokens for a prefix of
-- key_num_tokens: a correctness failure, not just a lost hit (the `naive` variant's hazard).
SELECT k.run, k.variant, k.seq, k.step, k.req, k.group_id, k.block_id, k.hash_id,
       k.key_num_tokens, k.state_num_tokens, r.seq AS key_removed_seq,
       (SELECT count(*) FROM block_touched t
        WHERE t.run = k.run AND t.block_id = k.block_id AND t.seq > k.seq
          AND t.seq < coalesce(r.seq, 9223372036854775807)) AS wrong_state_hits
FROM stale_key_left k
ASOF LEFT JOIN block_removed r
    ON k.run = r.run AND k.block_id = r.block_id AND k.hash_id = r.hash_id
       AND k.group_id = r.group_id AND r.seq > k.seq
ORDER BY wrong_state_hits DESC, k.run, k.seq
