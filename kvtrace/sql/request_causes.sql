-- name: request_causes
-- summary: One request's admitted lookups in one run, with every range of missed tokens, its cause and the removal that took its key.
-- param: run INTEGER = 0 -- the run (runs.run)
-- param: req INTEGER = 0 -- the request: its number in the trace
-- returns:
--   run: the run
--   req: the request
--   lookup: 1 for its first admission, 2... for resumptions after preemption
--   seq: seq of the lookup (ComputedBlocksFound)
--   step: its scheduler step
--   query_tokens: the tokens it looked up (the prompt on the first admission)
--   ideal_tokens: what an unbounded cache under the same schedule would have hit
--   hit_tokens: what it hit
--   attention_hit_tokens: the full-attention groups' own longest hit (less EAGLE's dropped unit on a use_eagle engine)
--   mamba_hit_tokens: the Mamba groups' own deepest state below the last token
--   shared_prefix_boundary: the lookup's shared-prefix junction in tokens (0: none)
--   cause: a cause of missed tokens (miss_attribution)
--   from_tokens: first token of the range that cause cost
--   to_tokens: the token after its last
--   key_group: the KV-cache group of the decisive key
--   key_depth_tokens: tokens that key covers
--   key_hash_id: its hash id
--   removal_reason: the BlockRemoved reason that took the key's last copy (NULL: never stored)
--   removed_block_id: the block it was removed from
--   removed_seq: seq of that removal
--   removed_step: its step
--   removed_by_req: the request whose allocation evicted it (NULL: none)
--   transient_behind: transient checkpoints cached in the free queue behind it then
-- What `kvtrace why` says of the request, from the database: miss_attribution's rows (the
-- decisive key of each range) with the reason of the removal they name; `kvtrace why` reads
-- the trace again and adds every key of a range and examples of the checkpoints behind an
-- eviction. Ordered by lookup, then range.
SELECT m.run, m.req, m.lookup, m.seq, m.step, m.query_tokens, m.ideal_tokens, m.hit_tokens,
       m.attention_hit_tokens, m.mamba_hit_tokens,
       coalesce(c.shared_prefix_boundary, 0) AS shared_prefix_boundary, m.cause::VARCHAR AS cause,
       m.from_tokens, m.to_tokens, m.key_group, m.key_depth_tokens, m.key_hash_id,
       r.reason AS removal_reason, m.removed_block_id, m.removed_seq, m.removed_step,
       m.removed_by_req, m.transient_behind
FROM miss_attribution m
LEFT JOIN computed_blocks_found c ON c.run = m.run AND c.seq = m.seq
LEFT JOIN block_removed r ON r.run = m.run AND r.seq = m.removed_seq
WHERE m.run = $run AND m.req = $req
ORDER BY m.lookup, m.from_tokens
