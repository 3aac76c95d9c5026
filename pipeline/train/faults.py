"""Fault injection for tests, at named hook points of a stage, read from SFT_FAULTS.

Faults are not hyperparameters: they live outside the trainer config so that
injecting one and removing it again does not change the config (which would
invalidate and retrain every stage). Example:

    SFT_FAULTS='{"stage": "chunk02", "fail_at_step": 160}'

The stage's parts call `Hooks` at fixed points; with no SFT_FAULTS (or another
stage named) every point does nothing. Points and the keys that act there:

    update_start(step)         fail_at_step: the stage fails (exit 1) when this global update starts
    gradients_ready(step, ..)  nan_grad_steps: a NaN in a gradient; zero_grad_steps: every gradient
                               zeroed (weights cut off from the loss, which the gradient check after a
                               restore must catch)
    reported_loss(step, loss)  loss_spike_steps: the logged loss is multiplied by 10 (training unchanged)
    update_end(step)           sleep_per_step: seconds of sleep, to widen timing windows in tests
    checkpoint_written(step)   sigkill_in_save_at: SIGKILL after the checkpoint of that update wrote its
                               files, before its MANIFEST (a crash in the middle of a save)
    eval_start(step, redo)     usr1_in_eval_at: SIGUSR1 to this process as the evaluation after that
                               update starts (a preemption in the middle of an eval; not on its redo)

Steps are global update indices; `stage` limits the faults to one stage,
`rank` to one rank (its RANK under torchrun: a fault one rank sees and the
others do not).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import torch

ENV = "SFT_FAULTS"

log = logging.getLogger("pipeline.train")


class InjectedFailure(Exception):
    """The failure `fail_at_step` asked for: the stage exits 1 like a crash, checkpoints intact."""


@dataclass(frozen=True)
class Hooks:
    fail_at_step: int = -1
    nan_grad_steps: frozenset[int] = field(default_factory=frozenset)
    zero_grad_steps: frozenset[int] = field(default_factory=frozenset)
    loss_spike_steps: frozenset[int] = field(default_factory=frozenset)
    sleep_per_step: float = 0.0
    sigkill_in_save_at: int = -1
    usr1_in_eval_at: int = -1

    @classmethod
    def from_env(cls, stage: str) -> Hooks:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return cls()
        spec = json.loads(raw)
        if spec.get("stage") not in (None, stage) or spec.get("rank") not in (None, int(os.environ.get("RANK", 0))):
            return cls()
        return cls(
            fail_at_step=int(spec.get("fail_at_step", -1)),
            nan_grad_steps=frozenset(spec.get("nan_grad_steps", [])),
            zero_grad_steps=frozenset(spec.get("zero_grad_steps", [])),
            loss_spike_steps=frozenset(spec.get("loss_spike_steps", [])),
            sleep_per_step=float(spec.get("sleep_per_step", 0.0)),
            sigkill_in_save_at=int(spec.get("sigkill_in_save_at", -1)),
            usr1_in_eval_at=int(spec.get("usr1_in_eval_at", -1)),
        )

    def update_start(self, step: int) -> None:
        if step == self.fail_at_step:
            raise InjectedFailure(f"injected failure at update {step} ({ENV})")

    @torch.no_grad()
    def gradients_ready(self, step: int, params: list[torch.Tensor]) -> None:
        if step in self.nan_grad_steps:
            params[0].grad.fill_(float("nan"))
        if step in self.zero_grad_steps:
            torch._foreach_zero_([p.grad for p in params if p.grad is not None])

    def reported_loss(self, step: int, loss: float) -> float:
        return loss * 10.0 if step in self.loss_spike_steps else loss

    def update_end(self, step: int) -> None:
        if self.sleep_per_step:
            time.sleep(self.sleep_per_step)

    def checkpoint_written(self, step: int) -> None:
        if step == self.sigkill_in_save_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def eval_start(self, step: int, redo: bool) -> None:
        if step == self.usr1_in_eval_at and not redo:
            os.kill(os.getpid(), signal.SIGUSR1)
