"""The optimizer of a stage: AdamW over the trained parameters, in one group or LoRA+'s two.

LoRA+ (Hayou et al. 2024, `optim.lora_plus_ratio`): B of each LoRA pair learns
at lr x ratio, A at lr. As peft's `create_loraplus_optimizer`, DoRA's magnitude
vectors go with B (peft puts every 1-D adapter parameter there). Unlike peft,
which gives LoRA on embeddings a fixed lr of 1e-6, adapters on embeddings
(`lora_embedding_A/B`), trainable token rows and modules trained in full keep
lr: the ratio is only ever applied where the paper's argument (B starts at zero,
A random, inputs of width n) holds.

The parameters come back in group order: checkpoints key the optimizer's state
by the i-th parameter of its groups (`pipeline.checkpoint.state.optimizer_state`),
so the names the stage saves must list them in that order. Without LoRA+ there
is one group in the trained parameters' own order, as before the setting existed.
"""

from __future__ import annotations

import torch

from pipeline.config import OptimConfig

# Name parts of the parameters LoRA+ speeds up (peft's names: `<module>.lora_B.<adapter>.weight`, ...).
FAST_PARTS = (".lora_B.", ".lora_magnitude_vector.")


def is_fast(name: str) -> bool:
    """Does LoRA+ give this trained parameter lr x ratio?"""
    return any(part in name for part in FAST_PARTS)


def adamw(named: list[tuple[str, torch.nn.Parameter]], cfg: OptimConfig, device: torch.device
          ) -> tuple[list[tuple[str, torch.nn.Parameter]], torch.optim.Optimizer]:
    """(the trained parameters in param-group order, AdamW over them). The LR schedule
    (a LambdaLR) scales every group's own lr by the same factor."""
    if cfg.lora_plus_ratio is None:
        groups = [{"params": [p for _, p in named]}]
    else:
        slow = [(n, p) for n, p in named if not is_fast(n)]
        fast = [(n, p) for n, p in named if is_fast(n)]
        named = slow + fast
        groups = [{"params": [p for _, p in slow], "lr": cfg.lr},
                  {"params": [p for _, p in fast], "lr": cfg.lr * cfg.lora_plus_ratio}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, **_kernel(device))
    return named, optimizer


def _kernel(device: torch.device) -> dict:
    # One fused kernel for the whole update on a GPU; on a CPU the foreach
    # implementation, which the CPU figures and tests were made with.
    return {"fused": True} if device.type == "cuda" else {"foreach": True}
