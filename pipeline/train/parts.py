"""The model side of a training stage, as its checkpoints save and restore it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainingParts:
    """Everything a checkpoint holds of the model side of a stage.

    `model` is the unwrapped model (no DDP wrapper; FSDP shards it in place);
    `named` its trained parameters in a fixed order, whose names key every
    saved state.
    """

    model: torch.nn.Module
    named: list[tuple[str, torch.nn.Parameter]]
    ema: object  # pipeline.train.ema.EMA
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.named]

    @property
    def lora(self) -> bool:
        return hasattr(self.model, "peft_config")
