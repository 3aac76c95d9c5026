"""A mixture-of-experts model's load-balancing loss, added to the training loss.

Transformers' MoE causal LMs (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, Qwen3-Next,
...) define an auxiliary loss that keeps the routers spreading tokens over the
experts: `load_balancing_loss_func` of the family's modeling module, over every
router's logits of the forward (Switch Transformer eq. 4-6: E * sum_i f_i P_i,
padding masked out), weighted by `router_aux_loss_coef`; their own forward adds
it when `config.output_router_logits` is set. Our loss runs the decoder alone
(`pipeline.model.loss.TokenLoss`), so it adds the same term itself:

    micro-batch loss = sum of its supervised tokens' cross-entropy + coef * aux * (its supervised tokens)

The trainer divides the update's sum by the global batch's supervised tokens,
so an update minimizes mean cross-entropy + coef * (the supervised-token-weighted
mean of the micro-batches' aux): with one micro-batch, exactly the model's own
`loss` with labels. (The aux of a batch is not a sum over its tokens, so no split
of the batch gives the same value; the weighting only makes micro-batches count by
their share.) A frozen router still gets the term's gradient through the hidden
states that reach it, which the adapters change.

`moe.router_aux_loss` (default on) turns it on (`enable_router_loss`), with
`moe.router_aux_loss_coef` or the model's own coefficient; the training metrics
log `router_loss` (the weighted mean aux, before the coefficient) per update,
and `loss` is the whole training loss. Validation losses never include it.
A family without the function or the coefficient (Nemotron-H balances its
experts without an auxiliary loss; dense models) trains on cross-entropy alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from pipeline.config import MoeConfig


@dataclass(frozen=True)
class RouterLoss:
    """The model's own load-balancing function and its arguments (the causal LM's attributes)."""

    function: object  # load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)
    experts: int
    top_k: int
    coef: float

    def term(self, router_logits, attention_mask: torch.Tensor | None, supervised: int) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """(what the micro-batch adds to its loss sum, the aux weighted by its supervised tokens)."""
        aux = self.function(router_logits, self.experts, self.top_k, attention_mask).float()
        weighted = aux * supervised
        return self.coef * weighted, weighted.detach()


def defined(hf) -> RouterLoss | None:
    """The load-balancing loss `hf` (a transformers causal LM) defines and its config turns on, else None."""
    module = sys.modules.get(type(hf).__module__)
    function = getattr(module, "load_balancing_loss_func", None)
    values = [getattr(hf, k, None) for k in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if function is None or None in values or not getattr(hf.config, "output_router_logits", False) \
            or not records_router_logits(hf):
        return None
    experts, top_k, coef = values
    return RouterLoss(function, int(experts), int(top_k), float(coef))


def available(hf) -> bool:
    """Does the model define a load-balancing loss at all (whatever its config says), with router logits
    its decoder can return (`records_router_logits`)?"""
    return defines_loss(hf) and records_router_logits(hf)


def defines_loss(hf) -> bool:
    module = sys.modules.get(type(hf).__module__)
    return (getattr(module, "load_balancing_loss_func", None) is not None
            and getattr(hf, "router_aux_loss_coef", None) is not None)


def records_router_logits(hf) -> bool:
    """Do the model's decoder outputs carry its routers' logits? Transformers 5 collects them with an output
    recorder its classes declare (`_can_record_outputs["router_logits"]`), from the modules of one class.
    Transformers 5.17's Granite MoE families (GraniteMoE, -Shared, -Hybrid: Granite 4) and DBRX declare none:
    their outputs have no router logits, their own loss adds a load-balancing term of 0, and ours could not
    compute it. A model configured without expert layers has none (`has_experts`)."""
    recorded = _router_recorders(hf)
    return bool(recorded) and _routers_present(hf, recorded)


def has_experts(hf) -> bool:
    """Does the model hold its routers? False for a family of experts configured dense (a dense Doge, as
    SmallDoge ships; every layer in `mlp_only_layers`): none of the modules its router logits are recorded from
    exists, its outputs hold an empty tuple of them, on which its own load-balancing function fails. True where
    it cannot be told (no recorder declared)."""
    recorded = _router_recorders(hf)
    return not recorded or _routers_present(hf, recorded)


def _router_recorders(hf) -> list:
    """What the model's classes record router logits from (a module class, or a name)."""
    from transformers import PreTrainedModel

    specs = [(getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
             for m in hf.modules() if isinstance(m, PreTrainedModel)]
    return [getattr(spec, "target_class", spec) for spec in specs if spec is not None]


def _routers_present(hf, recorded: list) -> bool:
    classes = tuple(c for c in recorded if isinstance(c, type))
    if len(classes) < len(recorded):
        return True  # declared by name, not by class: taken at its word
    return any(isinstance(m, classes) for m in hf.modules())


def enable_router_loss(model, moe: MoeConfig) -> None:
    """Turn the model's load-balancing loss on or off for training as `moe` says (its config's
    `output_router_logits`, the coefficient `moe.router_aux_loss_coef` or its own); a model that
    defines none is left as it is."""
    if not available(model):
        return
    model.config.output_router_logits = bool(moe.router_aux_loss)
    if moe.router_aux_loss_coef is not None:
        model.router_aux_loss_coef = model.config.router_aux_loss_coef = float(moe.router_aux_loss_coef)


def describe(model, moe: MoeConfig) -> str | None:
    """The plan's line on the router loss (None for a model without experts)."""
    if not defines_loss(model) or not has_experts(model):
        return None
    if not records_router_logits(model):
        import transformers

        return (f"router loss: none: {type(model).__name__} in transformers {transformers.__version__} returns no "
                "router logits (its own loss adds no load-balancing term either); training on cross-entropy alone")
    if not moe.router_aux_loss:
        return "router loss: off (moe.router_aux_loss=false)"
    coef = moe.router_aux_loss_coef if moe.router_aux_loss_coef is not None else model.router_aux_loss_coef
    return (f"router loss: {type(model).__module__.rsplit('.', 1)[-1]}.load_balancing_loss_func x {coef:g} added to "
            "the training loss (moe.router_aux_loss; logged per update as router_loss)")
