"""The sizes of a model that its memory depends on: from config.json alone (`Shapes`), and counted
on the model's skeleton on the meta device where it can be built (`Counts`, `model_shapes`).

`Shapes.from_config` reads a decoder-only transformer's sizes (a mixture of
experts': its experts, the top-k a token runs through, their and a shared expert's
widths) and counts its parameters by the Llama-shaped formula. `model_shapes`
adds the model's own `Counts`, built on the meta device (nothing read, nothing
allocated): every parameter, the experts' (all E of them), the parameters a
token runs through (top-k of E: what throughput and MFU count), and the LoRA
parameters of the targets `pipeline.model.targets` resolves. The plan and every
stage read them through `model_shapes`, so both estimate from the same counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counts:
    """Parameter counts of the model as its class builds it (`counts_of`), where the formula would guess."""

    total: int  # every parameter
    lora: int  # LoRA parameters of the resolved targets (0: full fine-tuning)
    experts: int  # parameters of the experts' weights, all of them
    active: int  # parameters one token runs through: the experts' top-k of E, the rest whole
    expert_layer: int  # one MoE layer's expert weights (the largest)
    moe_layers: int
    fused_adapted: bool  # LoRA on fused expert weights (peft ParamWrapper: see the module docstring)


@dataclass(frozen=True)
class Shapes:
    """The sizes of a decoder-only transformer that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 0  # experts per MoE layer (0: dense)
    top_k: int = 0  # experts per token
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # a shared expert's (or several's) intermediate size
    counts: Counts | None = None
    # its class can checkpoint activations (transformers' `supports_gradient_checkpointing`; JetMoe's cannot)
    checkpointable: bool = True

    @classmethod
    def from_config(cls, config: dict) -> Shapes:
        """From a Hugging Face config dict (a vision-language model's `text_config`)."""
        c = {k: _widest(v) for k, v in (config.get("text_config") or config).items()}
        for overrides in (c.get("per_layer_config") or {}).values():  # transformers >= 5.17 (Gemma 4's head_dim)
            c.update({k: v if c[k] is None else _widest([c[k], v]) for k, v in overrides.items() if k in c})
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
        intermediate = c.get("intermediate_size") or c.get("moe_intermediate_size") or 4 * hidden
        shared = (c.get("shared_expert_intermediate_size") or 0) + (
            (c.get("moe_shared_expert_intermediate_size") or 0) * (c.get("n_shared_experts") or 1))
        layers = c.get("num_hidden_layers") or len(c.get("layers_block_type") or c.get("layer_types") or [])
        return cls(hidden=hidden, layers=layers, heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads, head_dim=c.get("head_dim") or hidden // heads,
                   intermediate=intermediate, vocab=c["vocab_size"],
                   tied=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False))),
                   experts=experts, top_k=int(c.get("num_experts_per_tok") or 0) if experts else 0,
                   expert_intermediate=int(c.get("moe_intermediate_size") or intermediate) if experts else 0,
                   shared_intermediate=int(shared) if experts else 0)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each Llama-style projection of a layer (the LoRA targets)."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_projections(self) -> dict[str, tuple[int, int]]:
        """The projections of a layer that are Linear layers (what bitsandbytes quantizes): all of a dense
        model's; of a mixture of experts the attention and a shared expert, not the fused experts."""
        proj = self.projections()
        if not self.experts:
            return proj
        h, s = self.hidden, self.shared_intermediate
        attention = {k: v for k, v in proj.items() if k in ("q_proj", "k_proj", "v_proj", "o_proj")}
        shared = {"shared gate_proj": (h, s), "shared up_proj": (h, s), "shared down_proj": (s, h)} if s else {}
        return {**attention, **shared}

    @property
    def layer_params(self) -> int:
        if self.counts is not None:
            return (self.counts.total - self._root_formula) // max(self.layers, 1)
        if self.experts:  # attention, E gated experts and their router, a shared expert
            attention = sum(a * b for k, (a, b) in self.projections().items() if k.endswith(("q_proj", "k_proj",
                                                                                          "v_proj", "o_proj")))
            return (attention + 3 * self.hidden * (self.experts * self.expert_intermediate + self.shared_intermediate)
                    + self.experts * self.hidden + 2 * self.hidden)
        return sum(a * b for a, b in self.projections().values()) + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """Outside the decoder layers: embeddings, final norm, an untied head."""
        return self._root_formula

    @property
    def _root_formula(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        if self.counts is not None:
            return self.counts.total
        return self.layers * self.layer_params + self.root_params

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (throughput, MFU): of a mixture of experts, top-k of E."""
        if self.counts is not None:
            return self.counts.active
        if not self.experts:
            return self.params
        idle = 3 * self.hidden * self.expert_intermediate * (self.experts - self.top_k)
        return self.params - self.layers * idle


def _widest(value):
    """A size that may be given per layer (Gemma 3n's intermediate_size is a list): the largest, which
    bounds the memory; anything else as it is."""
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return max(value)
    return value


def counts_of(model, lora_params: int, fused_adapted: bool) -> Counts:
    """`Counts` of a model (a meta-device skeleton will do): every parameter, the experts' (3-D fused
    weights, or Linear layers in an `experts` list), the active ones per token (top-k of E)."""
    import torch

    config = model.config.get_text_config()
    experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                  or getattr(config, "n_routed_experts", None) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", None) or 0)
    from pipeline.model.targets import fused_expert_weights

    per_layer: dict[str, int] = {}
    for name, param in fused_expert_weights(model):
        layer = name.rsplit(".", 1)[0]
        per_layer[layer] = per_layer.get(layer, 0) + param.numel()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(module, torch.nn.ModuleList):
            per_layer[name] = sum(p.numel() for p in module.parameters())
    total = sum(p.numel() for p in model.parameters())
    in_experts = sum(per_layer.values())
    active = total - (in_experts * (experts - top_k) // experts if experts and top_k else 0)
    return Counts(total=total, lora=lora_params, experts=in_experts, active=active,
                  expert_layer=max(per_layer.values(), default=0), moe_layers=len(per_layer),
                  fused_adapted=fused_adapted)


def model_shapes(cfg: TrainConfig) -> Shapes | None:
    """`read_shapes` with the model's own `Counts` (its skeleton on the meta device, the LoRA targets
    resolved on it); the formula's shapes alone where the skeleton cannot be built. The plan and
    every stage estimate from this one function."""
    shapes = read_shapes(cfg.model.path, cfg.model.trust_remote_code)
    if shapes is None:
        return None
    from pipeline.errors import UserError
    from pipeline.model import base, targets

    try:
        skeleton = base.meta_model(cfg.model)
    except Exception as err:  # remote code, an architecture this transformers lacks: the formula stands
        log.warning("memory estimate from config.json's shapes only (%s cannot be built on the meta device: %s)",
                    cfg.model.path, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return shapes
    shapes = replace(shapes, checkpointable=bool(getattr(skeleton, "supports_gradient_checkpointing", True)))
    lora, fused = 0, False
    if cfg.lora.enabled:
        try:
            resolved = targets.resolve(skeleton, cfg.lora, cfg.moe, tower=cfg.vision.train_tower)
            lora, fused = resolved.lora_params, bool(resolved.parameters)
        except UserError:  # the plan reports it (`pipeline.model.loading.plan_model`)
            return shapes
    return replace(shapes, counts=counts_of(skeleton, lora, fused))


def read_shapes(model_path: str, trust_remote_code: bool = False) -> Shapes | None:
    """The shapes from the model's config.json (a local dir or a hub id); None when unavailable."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).to_dict()
        return Shapes.from_config(config)
    except (OSError, ValueError, KeyError) as err:
        where = str(err).splitlines()[0] if Path(model_path).is_dir() else "not a model dir (yet), nor a hub id in reach"
        log.warning("no memory estimate: cannot read the config of %s (%s)", model_path, where)
        return None
