"""After a restore, the first update checks that gradients reach the trained weights.

A restore that silently disconnects the trained parameters from the loss (the
optimizer holding tensors the wrapped model no longer uses, a lost
`requires_grad`, an adapter loaded into modules the forward never calls) would
otherwise train nothing for a whole stage while the loss still looks plausible.
The check runs once per process, on the first update after loading a
checkpoint (a resume or `--init`), and reuses the update's total grad norm; the
LoRA split below costs one extra fused norm per half, once.

On a fresh adapter lora_B is zero, so lora_A gets no gradient at update 0 and a
fresh start is not checked; after a restore lora_B has been trained, so both
halves should get one.
"""

from __future__ import annotations

import logging
import math

import torch

from pipeline.errors import UserError

log = logging.getLogger("pipeline.train")

_LORA_HALVES = ("lora_A", "lora_B")


def _norm(grads: list[torch.Tensor]) -> float:
    from torch.distributed.tensor import DTensor

    if not grads:
        return math.nan
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    # FSDP: a DTensor over the shards; full_tensor() reduces it (a collective: all ranks get here).
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def check_gradients_flow(named: list[tuple[str, torch.nn.Parameter]], grad_norm: float, where: str,
                         log_it: bool = True) -> dict:
    """Raise UserError if no trained parameter received a gradient; log the gradient's norms.

    `named`: the trained parameters (what the optimizer holds); `grad_norm`: the
    update's total norm before clipping (the same on every rank). All ranks must
    call this together (the LoRA norms reduce over FSDP shards). Returns the
    numbers it logged.
    """
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    report = {"grad_norm": grad_norm, "with_grad": len(with_grad), "trained": len(named)}
    if not with_grad or grad_norm == 0.0:
        raise UserError(
            f"no trained parameter received a gradient in the first update after restoring from {where} "
            f"({len(named) - len(with_grad)} of {len(named)} have no gradient, total norm {grad_norm}): "
            "the trained weights are not connected to the loss. Check lora.target_modules, that the "
            "restored adapter matches the model, and that the optimizer holds the wrapped model's parameters."
        )
    for half in _LORA_HALVES:
        grads = [g for n, g in with_grad if f".{half}." in n]
        if grads:
            report[half] = _norm(grads)
    if log_it:
        halves = ", ".join(f"{h} {report[h]:.3e}" for h in _LORA_HALVES if h in report)
        log.info("gradient check after restoring from %s: total norm %.3e over %d of %d trained tensors%s",
                 where, grad_norm, len(with_grad), len(named), f" ({halves})" if halves else "")
        if report.get("lora_A") == 0.0:
            log.warning("lora_A receives no gradient after restoring from %s: the restored lora_B is all zero "
                        "(an adapter that never trained?)", where)
        if report.get("lora_B") == 0.0:
            log.warning("lora_B receives no gradient after restoring from %s", where)
    return report
