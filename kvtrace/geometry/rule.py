"""vLLM 0.33's hybrid block-size rule and its CUDA backend choice, reproduced in plain Python.

``vllm/platforms/interface.py`` ``Platform._align_hybrid_block_size`` needs the model's built
layers (``_find_non_ssm_backends``, ``get_mamba_prefill_checkpoint_alignment`` walk the forward
context), so it cannot run without a GPU; ``hybrid_block_size`` is the same arithmetic on its
inputs. ``tests/test_geometry.py`` checks it against the real classmethod, called on a
``VllmConfig`` built on CPU with only those two layer walks replaced.
Nothing here imports vLLM.
"""

from __future__ import annotations

from math import lcm

# _align_hybrid_block_size: "TRTLLM/FlashInfer MLA decode kernels require the physical number
# of kernel blocks to be aligned to 128 / kernel_block_size" -> MLA blocks are multiples of 128.
MLA_BLOCK_ALIGNMENT = 128

# The attention backend vLLM 0.33 picks on an H200 (compute capability 9.0):
# vllm/platforms/cuda.py _get_backend_priorities lists, for SM90, FLASH_ATTN_MLA first for MLA
# and FLASH_ATTN first otherwise; on the CUDA wheel both validate for these models (FA3 is
# built in: fa_utils.flash_attn_supports_mla() on SM90). The value is the backend's smallest
# kernel block size, from its get_supported_kernel_block_sizes(): MultipleOf(16) for both
# (flashattn_mla.py FlashAttnMLABackend; flash_attn.py FlashAttentionBackend, whose 64- and
# 128-token variants apply only to FP8 head-512 KV and FA4 head-256 kernels, SM90 uses FA3).
SM90_BACKENDS = {True: "FLASH_ATTN_MLA", False: "FLASH_ATTN"}
SM90_KERNEL_BLOCK = {"FLASH_ATTN_MLA": 16, "FLASH_ATTN": 16}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hybrid_block_size(*, attn_page_per_token: int, mamba_page: int, block_size: int,
                      kernel_block: int, backend_kernel_blocks: list[int], use_mla: bool,
                      checkpoint_alignment: int | None) -> int:
    """The block size ``_align_hybrid_block_size`` leaves in ``cache_config.block_size`` in
    ``align`` mode (where ``mamba_block_size`` is then set equal to it).

    ``block_size``: the block size chosen before (phase 1 of ``update_block_size_for_backend``);
    ``kernel_block``: the first backend's smallest kernel block; ``backend_kernel_blocks``:
    every non-SSM backend's smallest kernel block; ``checkpoint_alignment``:
    ``get_mamba_prefill_checkpoint_alignment`` (the lcm of the Mamba layers' declared
    alignments, None unless all declare one).
    """
    if mamba_page == 0:
        return block_size
    alignment = max(kernel_block, block_size)
    if use_mla:
        alignment = max(alignment, MLA_BLOCK_ALIGNMENT)
    alignment = lcm(alignment, checkpoint_alignment or 1)
    backend_alignment = lcm(*backend_kernel_blocks)
    aligned = alignment * cdiv(mamba_page, alignment * attn_page_per_token)
    aligned = backend_alignment * cdiv(aligned, backend_alignment)
    return max(block_size, aligned)
