"""Fault injection for tests, read from the SFT_FAULTS environment variable.

Faults are not hyperparameters: they live outside the trainer config so that
injecting one and removing it again does not change the config (which would
invalidate and retrain every stage). Example:

    SFT_FAULTS='{"stage": "chunk02", "fail_at_step": 160}'

Keys: stage (only this stage is affected; default all), fail_at_step (exit 1
when this global update is reached), nan_grad_steps (a NaN in a gradient), loss_spike_steps (the
reported loss is multiplied by 10; training is unchanged) -- lists of global
update indices, sleep_per_step (seconds, to widen timing windows),
sigkill_in_save_at (SIGKILL this process after the checkpoint for that update
has written its files but before its MANIFEST: a crash in the middle of a save),
zero_grad_steps (every gradient of those updates is zeroed: weights cut off
from the loss, which the gradient check after a restore must catch),
usr1_in_eval_at (SIGUSR1 to this process as the evaluation after that update
starts: a preemption in the middle of an eval).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

ENV = "SFT_FAULTS"


@dataclass(frozen=True)
class Faults:
    fail_at_step: int = -1
    nan_grad_steps: frozenset[int] = field(default_factory=frozenset)
    loss_spike_steps: frozenset[int] = field(default_factory=frozenset)
    sleep_per_step: float = 0.0
    sigkill_in_save_at: int = -1
    zero_grad_steps: frozenset[int] = field(default_factory=frozenset)
    usr1_in_eval_at: int = -1


def from_env(stage: str) -> Faults:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return Faults()
    spec = json.loads(raw)
    if spec.get("stage") not in (None, stage):
        return Faults()
    return Faults(
        fail_at_step=int(spec.get("fail_at_step", -1)),
        nan_grad_steps=frozenset(spec.get("nan_grad_steps", [])),
        loss_spike_steps=frozenset(spec.get("loss_spike_steps", [])),
        sleep_per_step=float(spec.get("sleep_per_step", 0.0)),
        sigkill_in_save_at=int(spec.get("sigkill_in_save_at", -1)),
        zero_grad_steps=frozenset(spec.get("zero_grad_steps", [])),
        usr1_in_eval_at=int(spec.get("usr1_in_eval_at", -1)),
    )
