"""``kvtrace geometry``: the KV-cache geometry vLLM 0.33 builds for a real hybrid model."""

from __future__ import annotations

import click

from kvtrace.cli.model_options import hf_overrides_option

GIB = 1 << 30


@click.command("geometry")
@click.option("--model", "model", required=True, metavar="NAME|CONFIG.json",
              help="A preset (kimi-linear-48b-a3b, qwen3-next-80b-a3b, nemotron-h-8b, kimi-k3) "
                   "or a Hugging Face config.json (or its folder).")
@hf_overrides_option
@click.option("--gpu-memory-gib", type=float, default=None,
              help="Memory of one GPU, as CUDA reports it [default: this host's GPU as NVML "
                   "sees it, else an H200's 139.8].")
@click.option("--gpu-memory-utilization", type=float, default=0.9, show_default=True)
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True)
@click.option("--kv-cache-dtype", default="auto", show_default=True)
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="Scheduler token budget [default: 8192, vLLM's on H100/H200].")
@click.option("--non-kv-memory-gib", type=float, default=None,
              help="Per-GPU memory for activations, CUDA graphs and non-torch allocations, "
                   "which vLLM profiles at start-up [default: an assumed 6 GiB].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def command(model: str, gpu_memory_gib: float | None, gpu_memory_utilization: float,
            tensor_parallel_size: int, kv_cache_dtype: str, max_num_batched_tokens: int | None,
            non_kv_memory_gib: float | None, as_json: bool) -> None:
    """Show the KV-cache groups, block sizes, page bytes, checkpoint cost and num_gpu_blocks
    vLLM 0.33 builds for a hybrid model in align mode on CUDA (an H200 unless told otherwise).

    Computed on CPU, without weights, by vLLM's own code: the model class's Mamba state
    shapes, the attention page, the hybrid block-size rule, get_kv_cache_groups and the
    memory split (docs/commands/geometry.md). The first run for a model imports vLLM (tens of
    seconds); results are cached under ~/.cache/kvtrace/geometry.

    \b
    Example:
        kvtrace geometry --model kimi-linear-48b-a3b
        kvtrace geometry --model qwen3-next-80b-a3b --tensor-parallel-size 2 --json
        kvtrace geometry --model ./my-model/config.json --gpu-memory-gib 80
    """
    import json

    from kvtrace.geometry import compute_geometry

    geometry = compute_geometry(
        model, gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=max_num_batched_tokens, non_kv_memory_gib=non_kv_memory_gib)
    if as_json:
        click.echo(json.dumps(geometry.to_json(), indent=2))
    else:
        _print_text(geometry)


def _print_text(g) -> None:
    m = g.memory
    source = g.source.get("url") or g.model
    kinds = {}
    for group in g.groups:
        kinds.setdefault(group.kind, []).append(group.num_layers)
    click.echo(f"model:              {g.model} ({g.architecture}); config: {source}")
    click.echo(f"vLLM:               {g.vllm_version}, CUDA, attention backend "
               f"{g.attention_backend}, Mamba prefill {g.mamba_prefill_backend}, "
               f"TP {g.tensor_parallel_size}, kv_cache_dtype {g.kv_cache_dtype}")
    click.echo(f"KV-cache groups:    {len(g.groups)} ("
               + ", ".join(f"{len(sizes)} {kind} of {'/'.join(map(str, sizes))} layers"
                           for kind, sizes in kinds.items()) + ")")
    for i, group in enumerate(g.groups):
        checkpoint = (f", checkpoint {group.num_prefill_checkpoint_blocks} block at "
                      f"{group.prefill_checkpoint_alignment} tokens"
                      if group.num_prefill_checkpoint_blocks else "")
        click.echo(f"  group {i}: {group.kind:<14} {group.num_layers:>3} layers, block "
                   f"{group.block_size} tokens{checkpoint}")
    click.echo(f"block size:         {g.block_size} tokens per attention block "
               f"(Mamba block {g.mamba_block_size}; hash unit {g.hash_block_size})")
    click.echo(f"page:               {g.page_bytes:,} bytes per layer per block "
               f"({g.attention_page_bytes_per_token:,} attention bytes/token; Mamba state "
               f"{g.mamba_state_bytes:,} bytes, padded)")
    alignment = (f"{g.checkpoint_alignment} tokens" if g.checkpoint_alignment is not None
                 else "none (no mid-prefill checkpoints; block-aligned split)")
    click.echo(f"checkpoint:         alignment {alignment}; one checkpoint holds "
               f"{g.checkpoint_blocks} blocks = {g.checkpoint_bytes / GIB:.3f} GiB")
    click.echo(f"block pool:         {g.num_gpu_blocks:,} blocks of {g.bytes_per_block:,} bytes "
               f"= {g.num_gpu_blocks * g.block_size:,} tokens of attention KV")
    assumed = " (assumed; --non-kv-memory-gib)" if m.non_kv_assumed else ""
    click.echo(f"memory per GPU:     {m.gpu_memory_bytes / GIB:.1f} GiB x "
               f"{m.gpu_memory_utilization} - weights {m.weight_bytes / GIB:.2f} GiB "
               f"({m.weight_parameters / 1e9:.2f} B parameters / TP) - activations etc. "
               f"{m.non_kv_bytes / GIB:.2f} GiB{assumed} = KV cache "
               f"{m.kv_cache_bytes / GIB:.2f} GiB")
