"""A tiny random-weight hybrid model (Qwen3-Next: three Gated DeltaNet layers, one full
attention, four experts) and a BPE tokenizer, built locally with no model hub, for the real
``vllm serve`` the tests capture (``tests/real_server.py``). ``scripts/bootstrap`` runs it with
the Python of the vLLM CPU environment it makes, which has transformers and tokenizers:

    .venv-vllm-serve/bin/python scripts/tiny_hybrid_model.py DIR

vLLM's CPU attention takes head sizes of 64 and up, hence the sizes below.
"""

from __future__ import annotations

import sys
from pathlib import Path

LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"word{i}" for i in range(400)]
    bpe.train_from_iterator([" ".join(words[i:i + 20]) for i in range(0, len(words), 5)] * 20,
                            trainers.BpeTrainer(vocab_size=512,
                                                special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def model(directory: Path) -> None:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=len(LAYERS),
        layer_types=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer(out)
    model(out)
    print(f"wrote {out}")
