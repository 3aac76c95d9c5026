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
    config = LoraConfig(r=int(adapter_config["r"]), lora_alpha=adapter_config.get("lora_alpha", 8),
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

    @property
    def model(self):
        if self._model is None:
            self._model = _meta_model(self.base)
        return self._model

    def _reverted(self, param: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, {param: tensor})

    def slices(self, param: str, shape: tuple[int, ...]) -> list[StoredSlice]:
        """The stored tensors that hold the fused weight `param` of `shape`; UserError when the
        base's keys or shapes do not fit what transformers would store."""
        own = self.keys(param)
        if self.stored.get(own) == tuple(shape):
            return [StoredSlice(own, None, None)]
        full = self._reverted(param, torch.empty(shape, device="meta"))
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
    """The stored key of `piece` (named for expert 0) for `expert`: the one field of the key that,
    set to each expert's index in turn, names a key of the whole weight's reverse conversion."""
    parts = piece.split(".")
    fields = [i for i, p in enumerate(parts) if p == "0"
              and all(".".join([*parts[:i], str(e), *parts[i + 1:]]) in full for e in range(experts))]
    if len(fields) != 1:
        raise UserError(f"cannot tell which field of {piece} is the expert index ({len(fields)} candidates)")
    i = fields[0]
    return ".".join([*parts[:i], str(expert), *parts[i + 1:]])


def stored_apart(base: Path, names: list[str]) -> list[str]:
    """The fused weights among `names` that the base dir does not store under their own key (but one
    tensor per expert)."""
    from pipeline.storage import hf_dir

    stored = set(hf_dir.find_weights(Path(base), "the base").all_specs)
    keys = BaseKeys(base, stored)
    return [n for n in names if keys(n) not in stored]
