-- name: lost_hits_by_prefix
-- summary: Per prefix, prefix-cache hits the fixed variant got and the unfixed one lost (lookups, tokens).
-- param: fixed VARCHAR = fixed -- variant name of the fixed run
-- param: unfixed VARCHAR = unfixed -- variant name of the unfixed run
-- returns:
--   source: the source trace both variants replayed (runs.source_key)
--   backend: the replay backend of both runs
--   fixed_run: the run of the fixed variant (runs.run)
--   unfixed_run: the run of the unfixed variant it is paired with
--   prefix_hash_id: hash unit id of the prefix (from the request's hash ids)
--   depth_tokens: tokens the prefix covers
--   fixed_hits: paired lookups whose hit in the fixed run ended at this prefix
--   unfixed_hits: paired lookups whose hit in the unfixed run ended at this prefix
--   lost_lookups: fixed_hits whose unfixed twin hit fewer tokens
--   tokens_lost: sum over lost_lookups of depth_tokens - the unfixed twin's hit tokens
--   gained_lookups: unfixed_hits whose fixed twin hit fewer tokens
--   tokens_gained: sum over gained_lookups of depth_tokens - the fixed twin's hit tokens
--   net_tokens_lost: tokens_lost - tokens_gained (prefill the unfixed run recomputed)
-- Definitions. Two runs are paired when their variants are $fixed and $unfixed and they share
-- source_key, backend, mode and engine: the same engine config in their headers (pool size,
-- retention, groups, hash unit, scheduler limits) and the same scheduler settings (header
-- params). Runs of one source under different engines are never paired: their difference is
-- the engine's, not the variant's. Each pair gives its own rows. Their admitted lookups
-- (lookups view) are paired by request and admission number. A lookup's hit "ends at" the
-- prefix named by its request's hash unit at num_hit_tokens / hash_block_size - 1, with depth
-- num_hit_tokens; no hit, no prefix. Summed over a pair's prefixes, net_tokens_lost = hit
-- tokens(fixed) - hit tokens(unfixed) over its paired lookups. Ranked by tokens_lost.
WITH engines AS (
    SELECT *, json_extract(header_json, '$.config')::VARCHAR
              || json_extract(header_json, '$.params')::VARCHAR AS engine
    FROM runs),
run_pairs AS (
    SELECT f.run AS fixed_run, u.run AS unfixed_run, f.source_key, f.backend, f.hash_block_size
    FROM engines f
    JOIN engines u ON u.source_key = f.source_key AND u.backend = f.backend AND u.mode = f.mode
                      AND u.engine = f.engine
    WHERE f.variant = $fixed AND u.variant = $unfixed),
paired AS (
    SELECT p.fixed_run, p.unfixed_run, p.source_key, p.backend, p.hash_block_size, lf.req,
           lf.num_hit_tokens AS fixed_hit, lu.num_hit_tokens AS unfixed_hit
    FROM run_pairs p
    JOIN lookups lf ON lf.run = p.fixed_run AND lf.admitted
    JOIN lookups lu
        ON lu.run = p.unfixed_run AND lu.admitted AND lu.req = lf.req
           AND lu.admission = lf.admission),
hit_ends AS (
    SELECT *, fixed_hit AS depth, unfixed_hit AS twin_hit, 'fixed' AS side
    FROM paired WHERE fixed_hit > 0
    UNION ALL
    SELECT *, unfixed_hit, fixed_hit, 'unfixed'
    FROM paired WHERE unfixed_hit > 0),
per_prefix AS (
    SELECT e.source_key AS source, e.backend, e.fixed_run, e.unfixed_run,
           h.hash_id AS prefix_hash_id, e.depth AS depth_tokens,
           count(*) FILTER (WHERE side = 'fixed') AS fixed_hits,
           count(*) FILTER (WHERE side = 'unfixed') AS unfixed_hits,
           count(*) FILTER (WHERE side = 'fixed' AND twin_hit < depth) AS lost_lookups,
           coalesce(sum(depth - twin_hit) FILTER (WHERE side = 'fixed' AND twin_hit < depth), 0)
               AS tokens_lost,
           count(*) FILTER (WHERE side = 'unfixed' AND twin_hit < depth) AS gained_lookups,
           coalesce(sum(depth - twin_hit) FILTER (WHERE side = 'unfixed' AND twin_hit < depth), 0)
               AS tokens_gained
    FROM hit_ends e
    JOIN request_hashes h
        ON h.run = e.fixed_run AND h.req = e.req AND h.unit = e.depth // e.hash_block_size - 1
    GROUP BY ALL)
SELECT *, tokens_lost - tokens_gained AS net_tokens_lost
FROM per_prefix
ORDER BY tokens_lost DESC, net_tokens_lost DESC, source, fixed_run, prefix_hash_id
