-- name: eviction_causes
-- summary: Hash removals per run by reason, group and the kind of entry removed.
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   reason: BlockRemoved.reason (LRU_REUSE = evicted when the block was reused, STALE_CHECKPOINT, REKEY, CONNECTOR, RESET, UNKNOWN)
--   group_id: KV-cache group
--   entry_kind: kind of the BlockStored that put the hash there (NULL: stored before the trace began)
--   position_class: for CHECKPOINT entries, the CheckpointRecorded class (TRANSIENT, PROMPT_END, JUNCTION)
--   removals: BlockRemoved records
--   share_of_run: removals / all removals of the run
-- Every BlockRemoved counts once; its entry is the latest BlockStored of the same block, hash
-- and group before it.
SELECT r.run, r.variant, r.reason, r.group_id, e.kind AS entry_kind, e.position_class,
       count(*) AS removals,
       count(*) / sum(count(*)) OVER (PARTITION BY r.run) AS share_of_run
FROM block_removed r
ASOF LEFT JOIN cache_entries e
    ON r.run = e.run AND r.block_id = e.block_id AND r.hash_id = e.hash_id
       AND r.group_id = e.group_id AND e.stored_seq < r.seq
GROUP BY r.run, r.variant, r.reason, r.group_id, e.kind, e.position_class
ORDER BY r.run, removals DESC, reason, group_id
