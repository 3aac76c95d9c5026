"""What LoRA adapts in a model: `lora.target_modules` resolved for that model, by module kind.

    targets = resolve(model, cfg.lora, cfg.moe, tower=cfg.vision.train_tower, where=cfg.model.path)

`resolve` runs on the model as the stage builds it and, at plan time, on its
skeleton on the meta device (`pipeline.model.loading.plan_model`: nothing read, nothing
allocated), so a run whose targets peft would refuse fails at plan, naming the
setting. It gives peft two lists:

* `modules` (peft `target_modules`): name suffixes of Linear / GPT-2 Conv1D
  layers (or any layer named explicitly), never the output head; a Linear in a
  ModuleList goes by its list's name and index (Gemma 3n's `altup_projections.0`:
  "0" alone would name every first layer of every list, decoder layers included);
* `parameters` (peft `target_parameters`, adapted by peft's `ParamWrapper`):
  fused expert weights, the 3-D parameters transformers 5 keeps a layer's
  experts in (`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj`),
  as `<module>.<parameter>` suffixes; with `moe.train_router` also each router's
  weight (a 2-D parameter of a router module that is not a Linear). A Linear
  subclass with a forward of its own (DeepSeek V4's grouped output projection,
  Llama 4's and PhiMoE's routers, which return tuples) is adapted here too,
  through its weight: peft's LoRA layer would add `B(A(x))` to what that forward
  returns, which is not `x @ W.T`.

`[all-linear]` (the default) means every Linear / Conv1D layer and, on a
mixture-of-experts model, every expert's projections (each fused expert
parameter, or per-expert Linear layers where a family keeps those); the routers
stay frozen unless `moe.train_router`. On hybrids it covers the attention, the
MLP / expert projections, and the Mamba / linear-attention projections that peft
adapts: peft refuses `out_proj` (and `conv1d`) of Mamba-based families
(falcon_h1, nemotron_h), so `all-linear` leaves those out, and a list naming one
fails (`pipeline.compat.peft_refuses_target` asks peft itself); Mamba's,
FalconMamba's and Jamba's `dt_proj`, whose weight their forward reads itself
(`pipeline.compat.WEIGHT_READ_PAST_LAYER`), likewise. A named list
selects the layers and fused expert parameters of those names (`down_proj` names
both the dense / shared expert's Linear and the experts' fused `down_proj`).

Refused here, each naming the setting: a list that matches nothing;
`lora.dropout` other than 0 with fused parameters (`ParamWrapper` adapts a weight,
not a layer's input, so there is no input to drop out of); `lora.use_dora`
with fused parameters (peft has no DoRA for them), and with a layer kind DoRA
does not support.

The kind of each layer (attention, linear attention, mamba, mlp, experts,
router, other) is read from the class names of the modules around it
(`_KINDS`), for the plan's table of what is adapted.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace

import torch

from pipeline.compat import WEIGHT_READ_PAST_LAYER, peft_refuses_target, peft_remapped_targets
from pipeline.config import ALL_LINEAR, LoraConfig, MoeConfig
from pipeline.errors import UserError

log = logging.getLogger(__name__)

KINDS = ("attention", "linear attention", "mamba", "mlp", "experts", "router", "other")
# A layer's kind: the first rule that matches the class name of one of its enclosing modules, nearest
# first (experts are found anywhere up the chain first: a per-expert Linear sits in an expert MLP).
_KINDS = (
    ("mamba", re.compile(r"Mamba|Mixer$")),
    ("linear attention", re.compile(r"GatedDeltaNet|LinearAttention|Linear[A-Z]?\w*Attn")),
    ("attention", re.compile(r"Attention")),
    ("mlp", re.compile(r"MLP|FeedForward|FFN|Expert")),
)
_EXPERTS_NAME = "experts"
_ROUTER_LEAF = re.compile(r"(^|_)(gate|router)$")


@dataclass
class KindCount:
    """One module kind of the model: the names adapted, their base parameters and the LoRA parameters."""

    names: set[str] = field(default_factory=set)
    params: int = 0  # base parameters of the kind (adapted or not)
    adapted: int = 0  # base parameters of the adapted layers / fused weights
    lora: int = 0  # LoRA parameters on them


@dataclass
class Targets:
    """`lora.target_modules` resolved for one model (see the module docstring)."""

    modules: list[str]
    parameters: list[str]
    kinds: dict[str, KindCount]
    left_out: list[str]  # lines: what all-linear leaves out and why
    total: int  # parameters of the model
    experts: int = 0  # experts per MoE layer (0: a dense model)

    @property
    def lora_params(self) -> int:
        return sum(k.lora for k in self.kinds.values())

    def lines(self, where: str) -> list[str]:
        """What the plan prints: per module kind the names adapted and the parameter counts."""
        moe = f", mixture of experts ({self.experts} per MoE layer)" if self.experts else ""
        out = [f"lora: what is adapted in {where}{moe}:"]
        for kind in KINDS:
            count = self.kinds.get(kind)
            if count is None or not count.params:
                continue
            names = ", ".join(sorted(count.names)) or "-"
            state = "frozen" if not count.adapted else f"{count.adapted:,} adapted by {count.lora:,} LoRA parameters"
            out.append(f"  {kind:<17} {count.params:>14,} parameters  {state}  [{names}]")
        out += [f"  left out: {line}" for line in self.left_out]
        share = self.lora_params / max(self.total, 1)
        out.append(f"  trainable {self.lora_params:,} of {self.total:,} parameters ({100 * share:.3g}%)")
        return out


def lora_scope(model, tower: bool) -> list[tuple[str, torch.nn.Module]]:
    """The modules LoRA may adapt: all of a text model's; a vision-language model's language
    model only (and its vision tower with `tower`), never the projector."""
    from pipeline.model import vision
    from pipeline.model.base import is_vision_language

    if not is_vision_language(model):
        return list(model.named_modules())
    parts = vision.find_parts(model)
    return [(n, m) for n, m in model.named_modules() if vision.in_lora_scope(parts, n, tower=tower)]


def _linear_kinds() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return torch.nn.Linear, Conv1D


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _own_forward(module: torch.nn.Module) -> bool:
    """A Linear subclass with a forward of its own (DeepSeek V4's grouped output projection, Llama 4's and
    PhiMoE's routers, which return tuples): peft's LoRA layer would add `B(A(x))` to whatever it returns, so
    LoRA adapts its weight instead (peft's ParamWrapper), which is exact whatever the forward does with it.
    Only a model's own classes (transformers' or remote code's): a quantized Linear (bitsandbytes' Linear4bit)
    has a forward of its own too, and is what peft's LoRA layers wrap."""
    cls = type(module)
    return (isinstance(module, torch.nn.Linear) and cls.forward is not torch.nn.Linear.forward
            and cls.__module__.startswith(("transformers.models.", "transformers_modules.")))


def _holds_experts(name: str, module: torch.nn.Module) -> bool:
    """Is this the module of a layer's experts (whose 3-D parameters are their fused weights)?"""
    return _leaf(name) == _EXPERTS_NAME or type(module).__name__.endswith("Experts")


def fused_expert_weights(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every fused expert weight of `model`: the 3-D parameters of its experts modules."""
    return [(f"{name}.{p_name}", p) for name, module in model.named_modules() if _holds_experts(name, module)
            for p_name, p in module.named_parameters(recurse=False) if p.ndim == 3]


def _is_moe_block(module: torch.nn.Module) -> bool:
    return any(name == _EXPERTS_NAME or type(child).__name__.endswith("Experts")
               for name, child in module.named_children())


def _is_router(name: str, by_name: dict[str, torch.nn.Module]) -> bool:
    parent = name.rpartition(".")[0]
    return bool(_ROUTER_LEAF.search(_leaf(name))) and parent in by_name and _is_moe_block(by_name[parent])


def _kind(name: str, by_name: dict[str, torch.nn.Module]) -> str:
    """The kind of the layer `name` (`_KINDS`; experts and routers first)."""
    parts = name.split(".")
    chain = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]  # enclosing modules, nearest first
    if any(_leaf(c) == _EXPERTS_NAME or type(by_name[c]).__name__.endswith("Experts") for c in chain if c in by_name):
        return "experts"
    if _is_router(name, by_name) or any(_is_router(c, by_name) for c in chain):
        return "router"
    for c in chain:
        cls = type(by_name[c]).__name__ if c in by_name else ""
        for kind, pattern in _KINDS:
            if pattern.search(cls):
                return kind
    return "other"


@dataclass(frozen=True)
class _Candidate:
    """One thing LoRA could adapt: a layer (`module` True) or a fused weight."""

    key: str  # the name peft matches: a layer's leaf name, or `<module leaf>.<parameter>`
    name: str  # what a named list calls it: the layer's / the parameter's own name
    kind: str
    module: bool
    params: int
    lora_per_rank: int  # LoRA parameters per unit of rank
    via_weight: bool = False  # a layer adapted through its weight (a ParamWrapper): peft moves its name

    @property
    def peft_key(self) -> str:
        return f"{self.key}.weight" if self.via_weight else self.key


def _candidates(model, scope: list[tuple[str, torch.nn.Module]]) -> tuple[list[_Candidate], list[_Candidate], int]:
    """(adaptable layers and fused weights, every other parameter-holding layer, experts per MoE layer)."""
    by_name = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found, others, experts = [], [], 0
    for name, module in scope:
        if not name:
            continue
        leaf = _leaf(name)
        own = [(p_name, p) for p_name, p in module.named_parameters(recurse=False)]
        if isinstance(module, _linear_kinds()) and module is not head:
            weight = module.weight
            key, named = leaf, leaf
            if leaf.isdigit():  # a Linear in a ModuleList (Gemma 3n's altup_projections.0): "0" alone is any layer's
                parts = name.split(".")
                at = max(i for i, part in enumerate(parts) if not part.isdigit())  # Zamba2's adapter_list.0.1 too
                named, key = parts[at], ".".join(parts[at:])
            found.append(_Candidate(key, named, _kind(name, by_name), True, sum(p.numel() for _, p in own),
                                    sum(weight.shape), via_weight=_own_forward(module)))
            continue
        if leaf == _EXPERTS_NAME and isinstance(module, torch.nn.ModuleList):  # experts kept as Linear layers
            experts = max(experts, len(module))
        router = _is_router(name, by_name)
        fused = _holds_experts(name, module)
        for p_name, param in own:
            if fused and param.ndim == 3:  # a layer's experts, fused: (experts, out, in) or (experts, in, out)
                experts = max(experts, param.shape[0])
                found.append(_Candidate(f"{leaf}.{p_name}", p_name, "experts", False, param.numel(),
                                        param.shape[0] * (param.shape[1] + param.shape[2])))
            elif router and p_name == "weight" and param.ndim == 2:
                found.append(_Candidate(f"{leaf}.{p_name}", leaf, "router", False, param.numel(), sum(param.shape)))
            elif module is not head:
                others.append(_Candidate(leaf, leaf, "router" if router else _kind(name + ".x", by_name), True,
                                         param.numel(), 0))
    return found, others, experts


def resolve(model, lora: LoraConfig, moe: MoeConfig, *, tower: bool = False, where: str = "the model") -> Targets:
    """`lora.target_modules` resolved in `model` (see the module docstring); UserError naming the setting
    when nothing matches or peft would refuse what was asked."""
    requested = list(lora.target_modules)
    scope = lora_scope(model, tower)
    found, others, experts = _candidates(model, scope)
    left_out = []
    if requested == [ALL_LINEAR]:
        chosen = [c for c in found if c.kind != "router" or moe.train_router]
        if any(c.kind == "router" for c in found) and not moe.train_router:
            left_out.append("the routers (frozen; moe.train_router=true adapts them)")
    else:
        present = {_leaf(n) for n, _ in scope}
        names = {c.name for c in found}
        routers = sorted({c.name for c in found if c.kind == "router" and not c.module and c.name in requested})
        if routers and not moe.train_router:
            raise UserError(f"lora.target_modules={requested} names the router(s) {', '.join(routers)} of {where}, "
                            "which are frozen unless moe.train_router=true (set it to adapt them)")
        chosen = [c for c in found if c.name in requested]
        chosen += [c for c in found if c.kind == "router" and moe.train_router and c not in chosen]
        # Any other layer named explicitly (an Embedding, say) goes to peft as asked, as it always did.
        extra = sorted({n for n in requested if n in present and n not in names and n not in {c.key for c in chosen}})
        chosen += [_Candidate(n, n, "other", True, 0, 0) for n in extra]
        missing = [t for t in requested if t not in present and t not in names]
        if missing and chosen:
            log.warning("lora.target_modules not found in the model (ignored): %s", missing)
    if lora.use_dora:  # first: its message names the layer kinds, whatever peft says of the names
        _check_dora_layers(scope, [c.key for c in chosen if c.module], requested)
    refusals = {key: why for key in sorted({c.key for c in found + chosen if c.module})
                if (why := peft_refuses_target(model, key))}
    refused = {c.key: refusals[c.key] for c in chosen if c.key in refusals}
    if refused and requested == [ALL_LINEAR]:
        chosen = [c for c in chosen if c.key not in refused]
        left_out += [f"{key} ({_kind_of(found, key)}): peft refuses it for {_family(model)}" for key in sorted(refused)]
    elif refused:
        takes = sorted({c.name for c in found if c.key not in refusals and c.kind != "router"})
        raise UserError(f"lora.target_modules={requested}: peft refuses {', '.join(sorted(refused))} in {where} "
                        f"({next(iter(refused.values())).splitlines()[0]}); it may take: {', '.join(takes)}")
    family = _family(model)
    read = sorted({c.key for c in chosen if c.module and c.key in WEIGHT_READ_PAST_LAYER.get(family, ())})
    if read and requested == [ALL_LINEAR]:
        chosen = [c for c in chosen if c.key not in read]
        left_out += [f"{key} ({_kind_of(found, key)}): {family}'s forward reads its weight itself, past the layer, "
                     "where no adapter acts" for key in read]
    elif read:
        takes = sorted({c.name for c in found if c.kind != "router" and c.key not in {*read, *refusals}})
        raise UserError(f"lora.target_modules={requested}: {family}'s forward in {where} reads the weight of "
                        f"{', '.join(read)} itself ({read[0]}.weight @ x), past the layer, so an adapter there would "
                        f"never train; it may take: {', '.join(takes)}")
    # peft moves some layer names of these families onto the fused experts (`peft_remapped_targets`):
    # such a layer is adapted through its weight instead, which peft leaves alone (the same LoRA pair).
    moved = peft_remapped_targets(model, sorted({c.key for c in chosen if c.module}))
    chosen = [replace(c, via_weight=True) if c.module and c.key in moved else c for c in chosen]
    if not chosen:
        takes = sorted({c.name for c in found if c.kind != "router"})
        raise UserError(
            f"lora.target_modules={requested} match no layer of {where}; the layers and fused expert weights LoRA "
            f"can adapt there (Linear / Conv1D, output head left out) are: {', '.join(takes) or 'none'}. "
            f"Use lora.target_modules=[{ALL_LINEAR}] or some of these names.")
    targets = _counted(chosen, found + others, lora.r, model, experts, left_out)
    _check_wrappers(targets, lora, where)
    if tower:
        _check_tower(model, scope, targets.modules, requested)
    return targets


def _kind_of(found: list[_Candidate], key: str) -> str:
    return next((c.kind for c in found if c.key == key), "other")


def _family(model) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def _counted(chosen: list[_Candidate], every: list[_Candidate], rank: int, model, experts: int,
             left_out: list[str]) -> Targets:
    """The peft lists of `chosen`, and the counts per kind of every candidate."""
    keys = {c.key: c.peft_key for c in chosen}
    kinds: dict[str, KindCount] = {}
    for c in every:
        count = kinds.setdefault(c.kind, KindCount())
        count.params += c.params
        if c.key in keys:
            count.names.add(keys[c.key])
            count.adapted += c.params
            count.lora += rank * c.lora_per_rank
    total = sum(p.numel() for p in model.parameters())
    return Targets(modules=sorted({c.key for c in chosen if c.module and not c.via_weight}),
                   parameters=sorted({c.peft_key for c in chosen if not c.module or c.via_weight}),
                   kinds=kinds, left_out=left_out, total=total, experts=experts)


def _check_wrappers(targets: Targets, lora: LoraConfig, where: str) -> None:
    """peft's `ParamWrapper` (fused weights) takes neither dropout nor DoRA: say so at plan, naming the setting."""
    if not targets.parameters:
        return
    fused = ", ".join(targets.parameters)
    if lora.dropout:
        raise UserError(f"lora.dropout={lora.dropout}: the weights {fused} of {where} (fused experts, routers, or "
                        "layers peft maps onto them) are adapted by peft's ParamWrapper (target_parameters), which "
                        "adapts a weight, not a layer's input, and takes no dropout; set lora.dropout=0 (or leave "
                        "them out of lora.target_modules)")
    if lora.use_dora:
        raise UserError(f"lora.use_dora=true: the weights {fused} of {where} are adapted by peft's ParamWrapper, "
                        "which has no DoRA; set lora.use_dora=false, or leave them out of lora.target_modules")


def _check_tower(model, scope: list[tuple[str, torch.nn.Module]], chosen: list[str], requested: list[str]) -> None:
    """vision.train_tower needs a target name that is a linear layer of the vision tower."""
    from pipeline.model import vision

    parts = vision.find_parts(model)
    tower = {_leaf(n) for n, m in scope  # (a projector inside it is not the tower)
             if n.startswith(parts.tower + ".") and isinstance(m, torch.nn.Linear)}
    if not tower & set(chosen):
        raise UserError(f"vision.train_tower=true, but no name of lora.target_modules={requested} "
                        f"is a linear layer of the vision tower {parts.tower}; its linear layers: {sorted(tower)}")


def _dora_kinds() -> tuple[type, ...]:
    """Layer kinds DoRA trains and the streaming merge folds (peft 0.21: Linear, GPT-2 Conv1D as a
    Linear with fan_in_fan_out, Embedding; its Conv and MultiheadAttention are left out: the
    merge handles 2-D weights only, and peft has no DoRA for MultiheadAttention)."""
    return *_linear_kinds(), torch.nn.Embedding


def _check_dora_layers(scope: list[tuple[str, torch.nn.Module]], chosen: list[str], requested: list[str]) -> None:
    """UserError naming lora.use_dora, lora.target_modules and the layers when a chosen name
    selects a layer kind DoRA does not support."""
    kinds = _dora_kinds()
    bad = sorted({f"{_leaf(n)} ({type(m).__name__})" for n, m in scope
                  if _leaf(n) in chosen and not isinstance(m, kinds)})
    if bad:
        raise UserError(f"lora.use_dora=true, but lora.target_modules={requested} selects layers DoRA is not "
                        f"supported on here: {', '.join(bad)}; DoRA adapts {' / '.join(k.__name__ for k in kinds)} "
                        "layers. Leave those out of lora.target_modules, or set lora.use_dora=false")
