-- One row per loaded trace: its provenance, engine configuration and content digest (sha256
-- of the file). The load inserts the columns in this order (load_trace._insert_run_row).
CREATE TABLE runs (
    run INTEGER PRIMARY KEY, path VARCHAR, source VARCHAR, variant VARCHAR,
    backend VARCHAR, mode VARCHAR, source_key VARCHAR, kvtrace_version VARCHAR,
    vllm_version VARCHAR, created_ns BIGINT, hash_block_size BIGINT,
    num_gpu_blocks BIGINT, retention_interval BIGINT, block_sizes BIGINT[],
    group_kinds VARCHAR[], num_records BIGINT, truncated BOOLEAN, num_dropped BIGINT,
    header_json VARCHAR, digest VARCHAR)
