-- What prices each run's recomputed tokens (recompute_gpu_seconds, variant_verdict): the
-- model's figures in the run's header (cost.*, written by kvtrace replay; execute.* by older
-- versions), else the query's flops parameters when positive, else nothing (NULL).
CREATE OR REPLACE TEMP MACRO run_costs(flops_per_token, flops_per_position) AS TABLE
WITH figures AS (
    SELECT run,
           coalesce(json_extract_string(header_json, '$.params."cost.model"'),
                    json_extract_string(header_json, '$.params."execute.model"')) AS model,
           TRY_CAST(coalesce(
               json_extract_string(header_json, '$.params."cost.flops_per_token"'),
               json_extract_string(header_json, '$.params."execute.flops_per_token"'))
               AS DOUBLE) AS per_token,
           TRY_CAST(coalesce(
               json_extract_string(header_json,
                                   '$.params."cost.flops_per_token_per_position"'),
               json_extract_string(header_json,
                                   '$.params."execute.flops_per_token_per_position"'))
               AS DOUBLE) AS per_position
    FROM runs)
SELECT run,
       CASE WHEN per_token IS NOT NULL AND per_position IS NOT NULL THEN model
            WHEN flops_per_token > 0 THEN '(parameters)' END AS cost_model,
       CASE WHEN per_token IS NOT NULL AND per_position IS NOT NULL THEN per_token
            WHEN flops_per_token > 0 THEN flops_per_token END AS per_token,
       CASE WHEN per_token IS NOT NULL AND per_position IS NOT NULL THEN per_position
            WHEN flops_per_token > 0 THEN flops_per_position END AS per_position
FROM figures
