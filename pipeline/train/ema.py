"""Exponential moving averages of the trained weights, several rates at once.

    shadow <- beta**k * shadow + (1 - beta**k) * param,   every k-th update

- Shadows are fp32 whatever the parameter dtype, so a bf16/fp16 model does not
  lose the small (1 - beta) increments to rounding.
- Only the trained parameters are averaged: the LoRA matrices under LoRA (the
  frozen base is identical in every average anyway), all of them in full FT.
- One fused `torch._foreach_lerp_` per rate per update: no Python loop over
  parameters on the hot path (the seeds' per-parameter loop cost 67%).
- `swapped_in(rate)` puts a shadow into the live parameters for evaluation and
  restores the raw weights on exit, leaving no copy behind.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pipeline.layout import ema_tag


class EMA:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], rates: list[float], every: int = 1):
        """`named_params`: the trained parameters, in a fixed order (names are the keys)."""
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.rates = list(rates)
        self.every = every
        self._fp32 = all(p.dtype == torch.float32 for p in self.params)
        with torch.no_grad():
            self.shadows = {
                rate: [p.detach().to(torch.float32, copy=True) for p in self.params] for rate in self.rates
            }

    @property
    def tags(self) -> list[str]:
        return [ema_tag(r) for r in self.rates]

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Call after optimizer update number `step` (0-based); True if averaged."""
        if not self.rates or (step + 1) % self.every:
            return False
        # Half-precision params are upcast once per update, shared by all rates.
        current = self.params if self._fp32 else [p.detach().float() for p in self.params]
        for rate, shadow in self.shadows.items():
            # lerp: shadow + w * (param - shadow) with w = 1 - beta**k
            torch._foreach_lerp_(shadow, current, 1.0 - rate**self.every)
        return True

    def state(self, rate: float) -> dict[str, torch.Tensor]:
        """CPU copies of one shadow, keyed by parameter name (for checkpoints)."""
        return {n: s.detach().to("cpu", copy=True) for n, s in zip(self.names, self.shadows[rate])}

    @torch.no_grad()
    def load(self, rate: float, tensors: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise KeyError(f"EMA {ema_tag(rate)}: checkpoint lacks {missing[:3]} (of {len(missing)})")
        for name, shadow in zip(self.names, self.shadows[rate]):
            shadow.copy_(tensors[name].to(torch.float32))

    @contextlib.contextmanager
    def swapped_in(self, rate: float) -> Iterator[None]:
        """Evaluate with the `rate` shadow in place of the live weights."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, [s.to(p.dtype) for s, p in zip(self.shadows[rate], self.params)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, backup)
            del backup
