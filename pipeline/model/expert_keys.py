"""Fused expert weights: which adapter tensors adapt them, and which stored tensors hold them.

Transformers 5 keeps a layer's experts fused in 3-D parameters
(`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I); GPT-OSS
transposed, (E, H, 2I)), which an adapter adapts through peft's `ParamWrapper`
(`target_parameters`). Two questions the merge must answer without loading the
model, both asked of the libraries themselves on the base's skeleton on the meta
device (nothing read, nothing allocated):

* `param_wrappers`: for each ParamWrapper of the adapter, the module name its
  saved keys carry (several fused weights of one module nest, so one is
  `experts.lora_A`, the next `experts.base_layer.lora_A`), the weight it adapts,
  the number of experts and the weight's layout -- from peft's own wrappers,
  injected into the skeleton as `PeftModel.from_pretrained` would.
* `ExpertLayout`: where the base dir stores that weight. Either under its own
  name, fused (GPT-OSS), or one tensor per expert and projection
  (`mlp.experts.{e}.gate_proj.weight` and `.up_proj.weight`; Mixtral
  `block_sparse_moe.experts.{e}.w1.weight` / `w3`), which transformers
  converts on load and back on save (`conversion_mapping`). The layout is what
  transformers' own reverse conversion (`revert_weight_conversion`, what
  `save_pretrained` runs) makes of the fused weight: run once on a meta tensor of
  the whole shape (the stored keys and shapes, all experts), and on one expert's
  slice (shape (1, ...)) to learn which stored key holds which part of an expert
  (the expert index is the one field of the key that differs between experts).
  `split(param, delta)` then cuts one expert's delta the same way, so the merge
  adds to each stored tensor exactly the part transformers would have written
  there. Every stored key and shape is checked against the base's.
  A converter may store several fused weights in one list of experts (ERNIE 4.5
  VL: its text experts, then its vision experts, `mlp.experts.{e}`); the reverse
  conversion of one of them then needs the others (`_siblings`), given empty (no
  experts: the weight's own keys as if alone) or whole (its keys where they are
  stored, after the others').
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.model.base_keys import BaseKeys, _meta_model

LAYOUTS = ("out_in", "in_out", "2d")  # (E, out, in) | (E, in, out), e.g. GPT-OSS | a 2-D (out, in) weight


@dataclass(frozen=True)
class Wrapped:
    """One ParamWrapper of an adapter: the fused weight it adapts."""

    param: str  # the live parameter, e.g. model.layers.0.mlp.experts.gate_up_proj
    experts: int  # E (1 for a 2-D weight, e.g. a router's)
    layout: str  # one of LAYOUTS
    shape: tuple[int, ...]


def param_wrappers(base: Path, adapter_config: dict) -> dict[str, Wrapped]:
    """adapter module name (as its saved keys name it, after `base_model.model.`) -> the weight its
    ParamWrapper adapts, from peft's wrappers injected into the base's meta skeleton."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora.layer import ParamWrapper

    model = _meta_model(base)
    config = LoraConfig(r=int(adapter_config["r"]), lora_alpha=adapter_config.get("lora_alpha", 8), target_modules=[],
                        target_parameters=list(adapter_config["target_parameters"]), lora_dropout=0.0)
    inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, ParamWrapper):
            continue
        param = module.get_param()
        owner = ".".join(part for part in name.split(".") if part != "base_layer")
        if param.ndim == 2:
            layout = "2d"
        else:  # as the wrapper reads the weight: peft 0.19+ takes (E, out, in) unless the experts say they are
            # transposed (it swaps its in/out features and says so); 0.18 always takes (E, in, out)
            layout = "out_in" if getattr(module, "_did_swap_in_out_features", False) else "in_out"
        found[name] = Wrapped(f"{owner}.{module.parameter_name}", int(getattr(module, "num_experts", 1)), layout,
                              tuple(param.shape))
    return found


@dataclass(frozen=True)
class StoredSlice:
    """A stored tensor that holds (part of) a fused weight: all of it (`expert` None), or the part
    `piece` (the key transformers' reverse conversion gives it for expert 0) of one expert's slice."""

    key: str
    expert: int | None
    piece: str | None


class ExpertLayout:
    """Where a base dir stores fused expert weights (see the module docstring). `stored`: the base's
    tensor shapes by key."""

    def __init__(self, base: Path, stored: dict[str, tuple[int, ...]], keys: BaseKeys | None = None):
        self.base, self.stored = Path(base), dict(stored)
        self.keys = keys or BaseKeys(base, set(stored))
        self._model = None
        self._converters = None  # transformers' converters with several fused targets, once asked

    @property
    def model(self):
        if self._model is None:
            self._model = _meta_model(self.base)
        return self._model

    def _reverted(self, param: str, tensor: torch.Tensor, *, whole: bool = False) -> dict[str, torch.Tensor]:
        """transformers' reverse conversion of `tensor`, the weight `param` or one expert's slice of it. Its
        `_siblings` go with it, empty, or with `whole` as the model has them, on the meta device in another dtype,
        by which their pieces are told apart and dropped (the reverse ops cut and regroup tensors, never mix them)."""
        from transformers.core_model_loading import revert_weight_conversion

        marker = torch.float64 if tensor.dtype != torch.float64 else torch.float32
        state = {param: tensor}
        for name, shape in self._siblings(param).items():
            state[name] = torch.empty(shape if whole else (0, *shape[1:]), dtype=marker, device="meta")
        out = revert_weight_conversion(self.model, state)
        return {k: v for k, v in out.items() if len(state) == 1 or v.dtype != marker}

    def _siblings(self, param: str) -> dict[str, tuple[int, ...]]:
        """The fused weights (name -> shape) that transformers' conversion stores with `param`: the other targets
        of a converter with several (ERNIE 4.5 VL's `text_moe.experts.gate_up_proj` and
        `vision_moe.experts.gate_up_proj`, one stored list of experts)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        if self._converters is None:
            self._converters = [c for c in get_model_conversion_mapping(self.model, add_legacy=False)
                                if isinstance(c, WeightConverter) and len(c.target_patterns) > 1]
        params = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        for converter in self._converters:
            own = [t for t in converter.target_patterns if t in param]
            if len(own) == 1:
                names = (param.replace(own[0], t) for t in converter.target_patterns if t != own[0])
                return {n: params[n] for n in names if n in params}
        return {}

    def slices(self, param: str, shape: tuple[int, ...]) -> list[StoredSlice]:
        """The stored tensors that hold the fused weight `param` of `shape`; UserError when the
        base's keys or shapes do not fit what transformers would store."""
        own = self.keys(param)
        if self.stored.get(own) == tuple(shape):
            return [StoredSlice(own, None, None)]
        full = self._reverted(param, torch.empty(shape, device="meta"), whole=True)
        one = self._reverted(param, torch.empty((1, *shape[1:]), device="meta"))
        if set(full) == {param} or not one:
            raise UserError(f"the base {self.base} stores no tensor {own!r} for the fused weight {param} "
                            f"{tuple(shape)}, and transformers knows no per-expert layout of it")
        experts = shape[0]
        out = []
        for piece in sorted(one):
            for e in range(experts):
                key = _expert_key(piece, e, experts, full)
                out.append(StoredSlice(key, e, piece))
        problems = [f"{s.key} (expected {tuple(full[s.key].shape)}, stored {self.stored.get(s.key)})"
                    for s in out if self.stored.get(s.key) != tuple(full[s.key].shape)]
        if problems or len(out) != len(full):
            raise UserError(f"the base {self.base} does not store the fused weight {param} {tuple(shape)} as "
                            f"transformers would: {', '.join(problems[:3]) or 'other keys'}")
        return out

    def split(self, param: str, delta: torch.Tensor) -> dict[str, torch.Tensor]:
        """One expert's slice of `param` (shape (1, ...)) cut into the stored pieces, keyed as `StoredSlice.piece`."""
        return self._reverted(param, delta)


def _expert_key(piece: str, expert: int, experts: int, full: dict) -> str:
    """The stored key of `piece` (named for expert 0) for `expert`: the one field of the key that, set to
    `experts` consecutive numbers (from 0, or after the experts of weights stored before it in the same list),
    names the keys of the whole weight's reverse conversion."""
    parts = piece.split(".")
    firsts = {}
    for i, field in enumerate(parts):
        numbers = sorted(int(k.split(".")[i]) for k in full if _differs_only_at(k.split("."), parts, i))
        if field == "0" and numbers and numbers == list(range(numbers[0], numbers[0] + experts)):
            firsts[i] = numbers[0]
    if len(firsts) != 1:
        raise UserError(f"cannot tell which field of {piece} is the expert index ({len(firsts)} candidates)")
    (i, first), = firsts.items()
    return ".".join([*parts[:i], str(first + expert), *parts[i + 1:]])


def _differs_only_at(parts: list[str], others: list[str], i: int) -> bool:
    """Whether the dotted keys `parts` and `others` agree but for field `i`, a number in `parts`."""
    return (len(parts) == len(others) and parts[i].isdigit() and parts[:i] == others[:i]
            and parts[i + 1:] == others[i + 1:])


def stored_apart(base: Path, names: list[str]) -> list[str]:
    """The fused weights among `names` that the base dir does not store under their own key (but one
    tensor per expert)."""
    from pipeline.storage import hf_dir, packed

    weights = hf_dir.find_weights(Path(base), "the base")
    stored = set((packed.packed_if_stored(weights) or weights).all_specs)  # MXFP4, FP8: each pair as one
    keys = BaseKeys(base, stored)
    return [n for n in names if keys(n) not in stored]
