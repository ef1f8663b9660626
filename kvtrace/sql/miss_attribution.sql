-- name: miss_attribution
-- summary: Per admitted lookup, where its query tokens went: the hit, and each cause of the rest.
-- returns:
--   run: the run
--   variant: its variant (or trace source)
--   req: the request
--   lookup: its admitted lookups in order: 1 = first admission, 2... = resumptions after preemption (a request in flight when a capture began counts on from the admissions it had)
--   step: scheduler step of the lookup (get_computed_blocks)
--   query_tokens: the request's num_tokens at the lookup (its prompt on the first admission)
--   ideal_tokens: the hit an unbounded cache under the same schedule would have given
--   hit_tokens: the joint hit the cache gave (num_hit_tokens)
--   attention_hit_tokens: full attention's own longest hit at the lookup, less EAGLE's dropped unit on a use_eagle engine (NULL: no such group)
--   mamba_hit_tokens: the deepest Mamba state below the last token at the lookup (NULL: none)
--   cause: why these tokens were not hit (see kvtrace/analysis/causes.py)
--   in_shortfall: true for causes of ideal - hit; false past it (cold, partial_unit, short_prompt)
--   tokens: tokens of the query this cause cost (to_tokens - from_tokens)
--   from_tokens: where in the query they start
--   to_tokens: where they end
--   key_group: KV-cache group of the decisive missing key (NULL for causes not about one key)
--   key_depth_tokens: the prefix length that key covers
--   removed_step: step the key's last copy was removed at (NULL: it was never stored)
--   removed_by_req: the request whose allocation evicted it (NULL: not evicted in an allocation)
--   transient_behind: transient checkpoints cached in the free queue when it was evicted
--   in_flight: the request was in flight when a capture began (in its start snapshot)
-- Definitions (docs/miss-attribution.md). Per lookup: hit_tokens + sum(tokens) = query_tokens, and
-- the in_shortfall rows sum to ideal_tokens - hit_tokens. The ideal is the longest prefix of the
-- request's hash units that successful allocations of any request had scheduled before the
-- lookup (at least the hit). The shortfall is split by a waterfall: restrictions of that ideal
-- cache applied in cause order (hit_cap, eagle_dropped_unit, block_quantisation,
-- mamba_not_reserved, mamba_not_retained, mamba_suppressed, rekeyed, invalidated,
-- checkpoint_pushout, evicted, mamba_evicted), each cause charged the tokens its restriction
-- took from the recomputed hit (eagle_dropped_unit: only on an engine built with use_eagle);
-- `other` is what vLLM's hit search over the keys really cached still does not explain. A cause
-- only gets tokens the causes before it left. No row for a cause that cost nothing.
SELECT run, variant, req, lookup, step, query_tokens, ideal_tokens, hit_tokens,
       attention_hit_tokens, mamba_hit_tokens, cause, in_shortfall, tokens, from_tokens, to_tokens,
       key_group, key_depth_tokens, removed_step, removed_by_req, transient_behind, in_flight
FROM miss_attribution
ORDER BY run, seq, from_tokens
