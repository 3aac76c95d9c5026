"""Tiny Llama bases and LoRA adapters for the export tests (nothing is downloaded).

Imported by the tests as `export_helpers` (pytest puts this dir on sys.path).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMALL_SHARD = "20KB"  # splits the tiny model into several shards + an index


def tiny_llama(*, tied: bool = False, seed: int = 0, vocab: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.demo.text import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config), tokenizer


def save_base(path: Path, *, tied: bool = False, shard: str | None = None, dtype=torch.float32, seed: int = 0):
    """Write a base model dir (with tokenizer); returns the model (still unwrapped)."""
    model, tokenizer = tiny_llama(tied=tied, seed=seed)
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    tokenizer.save_pretrained(path)
    return model


def lora_config(**overrides):
    from peft import LoraConfig

    # init_lora_weights=False: B is random too, so the merge actually changes the weights.
    kwargs = dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, init_lora_weights=False)
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def save_adapter(model, path: Path, *, seed: int = 1, **overrides):
    """Wrap `model` with a random LoRA, save it as a PEFT dir; returns the PeftModel."""
    from peft import get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, lora_config(**overrides))
    peft_model.save_pretrained(path)
    return peft_model


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file below root (relative path -> hex digest)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


def load_dir_tensors(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(root).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
