"""LoRA merge math over plain state dicts: W' = W + s * B @ A (DoRA: rescaled), computed in fp32.

Everything here is pure: functions take tensors and return new ones, never
modify their inputs, and give the same result when called again. The
streaming driver (`pipeline.export.merge`) feeds them one tensor at a time;
tests feed them whole state dicts.

What is merged, and how (mirroring peft's LoRA layers):

* adapter key `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`
  (Linear) -> base key `<module>.weight`, delta `s * B @ A`, transposed when
  the config says `fan_in_fan_out` (GPT-2 style Conv1D weights);
* `base_model.model.<module>.lora_embedding_A` / `_B` (Embedding)
  -> `<module>.weight`, delta `s * (B @ A).T`;
* `base_model.model.<module>.base_layer.weight` (peft saves the full layer
  when an embedding is targeted) replaces the base tensor before the delta is
  added, as loading the adapter into peft would; it must have the base's shape;
* `s = alpha / r`, or `alpha / sqrt(r)` with `use_rslora`, where r and alpha
  come from `rank_pattern` / `alpha_pattern` when a pattern matches the module
  name (peft's rule: the first pattern that matches the name's dotted suffix);
* DoRA (`use_dora`): `base_model.model.<module>.lora_magnitude_vector` (m, one
  value per output feature) goes with that module's LoRA pair, and the merged
  weight is V = W + s * B @ A rescaled to W' = m / ||V|| * V, the norm taken
  per output feature over the inputs (rows of a Linear weight; columns of a
  fan_in_fan_out Conv1D weight and of an Embedding, whose output features are
  its embedding dims), over the unmerged base W, as peft's `merge_and_unload`;
* a module the config lists in `modules_to_save` (trained in full, e.g. a
  vision-language projector) is saved whole: `base_model.model.<module>.<param>`
  replaces the base tensor `<module>.<param>` as it is (`Replacement`);
* `base_model.model.<module>.token_adapter.trainable_tokens_delta` (peft
  `trainable_token_indices`: rows of the embeddings, and of an untied output
  head, trained for special tokens the run added) holds the trained VALUES of
  the rows the config lists for that module (peft replaces those rows, it does
  not add to them): they replace the rows of `<module>.weight` (`TokenRows`).
  Rows beyond the base's (a grown vocabulary) must all be listed: the output
  then has the grown shape, and the merged config's `vocab_size` follows.

* a weight adapted through peft's `target_parameters` (`ParamWrapper`: fused
  expert weights, a router's weight) has keys like a Linear's
  (`<module>.lora_A.weight`), told apart by `fused`: the wrappers the adapter
  config makes in the base's architecture, and where the base stores each
  weight (`pipeline.model.expert_keys`); its delta is added per expert, in the
  layout peft uses (`pipeline.export.expert_math`, `ExpertTarget`).

Base keys: the adapter names modules as the live model does; `stored_key`
(default: the name itself) maps such a name to the key the base stores it
under, where the two differ (`pipeline.model.base_keys`). A Linear weight the
base stores as rows of another tensor (Sarvam-MoE's `query_key_value`) gets
its delta's rows added where `stored_rows` says they are
(`pipeline.export.row_math`, `StoredRowsTarget`).

The mapping is exact: every adapter tensor must land on a base tensor and
every LoRA pair must be complete (and carry its magnitude under DoRA, and only
then), otherwise `UserError`. Adapter kinds whose merge is neither W + s*B@A nor
DoRA's (LoRA bias, aLoRA, ...) are refused up front.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from pipeline.errors import UserError
from pipeline.export import expert_math, row_math
from pipeline.export.dora_math import check_magnitude, dora_rescale
from pipeline.export.expert_math import ExpertTarget, FusedWeight
from pipeline.export.row_math import StoredRowsTarget
from pipeline.export.token_math import TokenRows, token_indices, token_rows, token_rows_merged
from pipeline.storage import dtypes

ADAPTER_PREFIX = "base_model.model."

_LINEAR_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<half>lora_[AB])\.weight")
_EMBEDDING_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_embedding_(?P<half>[AB])")
_BASE_LAYER_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.base_layer\.weight")
_MAGNITUDE_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_magnitude_vector")
_TOKENS_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.token_adapter\.trainable_tokens_delta")

# Config fields that change what the adapter computes beyond W + s*B@A. Any
# truthy value is refused: silently merging them would give a different model.
_UNSUPPORTED = {
    "lora_bias": "the LoRA B bias would also have to be merged into the base bias",
    "alora_invocation_tokens": "activated LoRA acts only after its invocation tokens and cannot be merged",
    "use_qalora": "QALoRA targets quantized layers",
    "layer_replication": "layer replication changes the model's layer list",
    "megatron_config": "Megatron-parallel LoRA layers are not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow routing mixes several adapters at run time",
    "kasa_config": "KaSA adapters are not supported",
    "velora_config": "VeLoRA adapters are not supported",
    "monteclora_config": "MonteCLoRA adapters are not supported",
}

# Initializations that change the base weights too (an unconverted adapter only
# makes sense on top of that modified base, which we do not have).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


@dataclass(frozen=True)
class LoraSettings:
    """The parts of an adapter_config.json that decide the merge."""

    r: int
    alpha: float
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    use_rslora: bool
    fan_in_fan_out: bool
    use_dora: bool = False
    modules_to_save: tuple[str, ...] = ()
    # peft trainable_token_indices: {module name (or a dotted suffix) or "": row ids}; "" = the list form
    token_indices: tuple[tuple[str, tuple[int, ...]], ...] = ()
    target_parameters: tuple[str, ...] = ()  # weights adapted by peft's ParamWrapper (fused experts)

    def rows_for(self, module: str) -> tuple[int, ...] | None:
        """The trained rows of `module` (peft's rule: a key names the module or a dotted suffix of it)."""
        for key, rows in self.token_indices:
            if key == "" or module == key or module.endswith("." + key):
                return rows
        return None


@dataclass(frozen=True)
class Replacement:
    """A base tensor that a `modules_to_save` module's trained copy replaces as a whole."""

    base_key: str
    adapter_key: str


@dataclass(frozen=True)
class LoraTarget:
    """One base tensor and the LoRA pair that modifies it."""

    module: str
    base_key: str
    a_key: str
    b_key: str
    kind: str  # "linear" | "embedding"
    rank: int
    scaling: float
    fan_in_fan_out: bool
    base_layer_key: str | None = None  # adapter tensor replacing the base weight, if saved
    magnitude_key: str | None = None  # DoRA: the module's lora_magnitude_vector

    @property
    def transposed(self) -> bool:
        """Does the weight store B @ A transposed (output features along dim 1)? Embedding and
        fan_in_fan_out (Conv1D) weights do."""
        return self.kind == "embedding" or self.fan_in_fan_out


def parse_adapter_config(config: Mapping) -> LoraSettings:
    """Validate an adapter_config.json (as a dict) and keep what the merge needs."""
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise UserError(f"adapter peft_type is {config.get('peft_type')!r}; only LORA adapters can be merged")
    for field, why in _UNSUPPORTED.items():
        if config.get(field):
            raise UserError(f"adapter config sets {field}={config[field]!r}: {why}; refusing to merge")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_BASE_MODIFYING_INITS):
        raise UserError(f"adapter was initialized with {config['init_lora_weights']!r}, which also rewrites the base "
                        "weights; convert it to a plain LoRA adapter first (peft: save_pretrained("
                        "path_initial_model_for_weight_conversion=...))")
    if config.get("bias", "none") != "none":
        raise UserError(f"adapter config sets bias={config['bias']!r}: trained biases are not supported")
    try:
        return LoraSettings(
            r=int(config["r"]),
            alpha=float(config["lora_alpha"]),
            rank_pattern={str(k): int(v) for k, v in (config.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
            use_rslora=bool(config.get("use_rslora", False)),
            fan_in_fan_out=bool(config.get("fan_in_fan_out", False)),
            use_dora=bool(config.get("use_dora", False)),
            modules_to_save=tuple(config.get("modules_to_save") or ()),
            token_indices=token_indices(config.get("trainable_token_indices")),
            target_parameters=tuple(config.get("target_parameters") or ()),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"adapter config lacks a valid r / lora_alpha: {err}") from None


def output_shape(target, base_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The merged tensor's shape: the base's, with a grown vocabulary's rows for `TokenRows`."""
    return (target.rows, *base_shape[1:]) if isinstance(target, TokenRows) else tuple(base_shape)


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    # peft (get_pattern_key): a pattern is a regex for a dotted suffix of the
    # module name; the first matching pattern in config order wins.
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def scaling_for(settings: LoraSettings, module: str) -> tuple[int, float]:
    """(rank, scaling) of one module, as peft computes them."""
    rank = int(_pattern_value(settings.rank_pattern, module, settings.r))
    alpha = _pattern_value(settings.alpha_pattern, module, settings.alpha)
    if rank <= 0:
        raise UserError(f"adapter rank for {module} is {rank}")
    return rank, (alpha / math.sqrt(rank) if settings.use_rslora else alpha / rank)


def _saved_module(key: str, modules: tuple[str, ...]) -> bool:
    """Is the adapter key a tensor of a `modules_to_save` module? (peft: the module name ends with an entry)"""
    if not key.startswith(ADAPTER_PREFIX) or not modules:
        return False
    parts = key[len(ADAPTER_PREFIX):].split(".")
    prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
    return any(p == m or p.endswith("." + m) for p in prefixes for m in modules)


Target = LoraTarget | Replacement | TokenRows | ExpertTarget | StoredRowsTarget


def plan_targets(
    adapter_shapes: Mapping[str, tuple[int, ...]],
    base_shapes: Mapping[str, tuple[int, ...]],
    settings: LoraSettings,
    stored_key: Callable[[str], str] = lambda name: name,
    fused: Mapping[str, FusedWeight] | None = None,
    stored_rows: Callable[[str], tuple | None] | None = None,
) -> dict[str, Target]:
    """Map every adapter tensor to the base tensor it modifies (keyed by base key).

    Checks, each a UserError naming the keys: every adapter key is a LoRA
    A/B tensor or a tensor of a `modules_to_save` module, each module has both
    halves, the base stores `<module>.weight` (a tied, unstored weight such as
    `lm_head.weight` counts as missing), the shapes fit, and the rank agrees
    with the config. `stored_key`: live name -> the base's key for it. `fused`: the adapter's
    ParamWrapper modules (adapter module name -> `FusedWeight`), which an adapter config with
    `target_parameters` needs (`pipeline.model.expert_keys`). `stored_rows`: live weight name -> where
    the base stores its rows, when not under a key of its own (`BaseKeys.rows`).
    """
    if settings.target_parameters and not fused:
        raise UserError(f"adapter adapts target_parameters {list(settings.target_parameters)} (fused expert "
                        "weights): merging it needs the base's architecture (pipeline.export.merge.merge_dirs)")
    planner = _Planner(adapter_shapes, base_shapes, settings, stored_key, dict(fused or {}), stored_rows)
    for (module, kind), pair in sorted(planner.sort_keys().items()):
        planner.add_pair(module, kind, pair)
    planner.check_nothing_left()
    return planner.plan


@dataclass
class _Planner:
    """`plan_targets`' state: the plan so far, and the DoRA magnitudes, saved base layers and fused weights
    not yet claimed by a LoRA pair (each must be, by the end)."""

    adapter_shapes: Mapping[str, tuple[int, ...]]
    base_shapes: Mapping[str, tuple[int, ...]]
    settings: LoraSettings
    stored_key: Callable[[str], str]
    fused: dict[str, FusedWeight]
    stored_rows: Callable[[str], tuple | None] | None
    plan: dict[str, Target] = field(default_factory=dict)
    base_layers: dict[str, str] = field(default_factory=dict)
    magnitudes: dict[str, str] = field(default_factory=dict)

    def sort_keys(self) -> dict[tuple[str, str], dict[str, str]]:
        """Plan the whole-tensor replacements and token rows; collect saved base layers and magnitudes; return
        the LoRA halves by (module, "linear" | "embedding") -> {"A": key, "B": key}."""
        halves: dict[tuple[str, str], dict[str, str]] = {}
        unknown = []
        for key in self.adapter_shapes:
            if _saved_module(key, self.settings.modules_to_save) and not _LINEAR_KEY.fullmatch(key):
                self._replace(key)
            elif match := _BASE_LAYER_KEY.fullmatch(key):
                self.base_layers[match["module"]] = key
            elif match := _MAGNITUDE_KEY.fullmatch(key):
                self.magnitudes[match["module"]] = key
            elif match := _TOKENS_KEY.fullmatch(key):
                target = token_rows(key, match["module"], tuple(self.adapter_shapes[key]), self.base_shapes,
                                    self.settings.rows_for(match["module"]), self.stored_key)
                self.plan[target.base_key] = target
            elif match := _LINEAR_KEY.fullmatch(key):
                halves.setdefault((match["module"], "linear"), {})[match["half"][-1]] = key
            elif match := _EMBEDDING_KEY.fullmatch(key):
                halves.setdefault((match["module"], "embedding"), {})[match["half"][-1]] = key
            else:
                unknown.append(key)
        if unknown:
            raise UserError(f"adapter has {len(unknown)} tensor(s) that are not LoRA A/B weights, e.g. "
                            f"{', '.join(sorted(unknown)[:3])}; they would be silently dropped")
        return halves

    def _replace(self, key: str) -> None:
        """A tensor of a `modules_to_save` module: it replaces the base's tensor of that name."""
        base_key = self.stored_key(key[len(ADAPTER_PREFIX):])
        if base_key not in self.base_shapes:
            raise UserError(f"adapter saves {key} (modules_to_save), but the base stores no tensor {base_key!r}")
        if tuple(self.adapter_shapes[key]) != tuple(self.base_shapes[base_key]):
            raise UserError(f"adapter's {key} is {tuple(self.adapter_shapes[key])}, the base's {base_key} "
                            f"{tuple(self.base_shapes[base_key])}")
        self.plan[base_key] = Replacement(base_key, key)

    def add_pair(self, module: str, kind: str, pair: dict[str, str]) -> None:
        """Plan one module's LoRA pair: onto a fused weight's stored tensors, onto rows the base stores inside
        another tensor, or onto `<module>.weight`."""
        if set(pair) != {"A", "B"}:
            raise UserError(f"adapter module {module} has only its lora_{''.join(pair)} tensor")
        if module in self.fused:  # a ParamWrapper: the stored tensors holding its weight
            for target in expert_math.targets(module, pair, self.fused.pop(module), self.adapter_shapes,
                                              *scaling_for(self.settings, module)):
                if target.base_key in self.plan:
                    raise UserError(f"base tensor {target.base_key} is targeted twice")
                self.plan[target.base_key] = target
            return
        base_key = self.stored_key(f"{module}.weight")
        placed = (self.stored_rows(f"{module}.weight") if self.stored_rows is not None and kind == "linear"
                  and base_key not in self.base_shapes else None)
        if placed:
            unsplittable = [what for what, there in (("a saved base layer", module in self.base_layers),
                                                     ("fan_in_fan_out", self.settings.fan_in_fan_out)) if there]
            magnitude = self.magnitudes.pop(module, None)
            check_magnitude(module, pair["B"], magnitude, self.settings.use_dora, self.adapter_shapes)
            row_math.add_part(self.plan, module, pair, placed, self.adapter_shapes, self.base_shapes,
                              *scaling_for(self.settings, module), unsplittable=unsplittable, magnitude_key=magnitude)
            return
        self.plan[base_key] = self._weight_target(module, kind, pair, base_key)

    def _weight_target(self, module: str, kind: str, pair: dict[str, str], base_key: str) -> LoraTarget:
        """The pair's target on the base's `base_key`, its shapes, rank and DoRA magnitude checked."""
        if base_key not in self.base_shapes:
            raise UserError(f"adapter targets {module}, but the base stores no tensor {base_key!r} "
                            "(different architecture, or a tied weight that is not stored)")
        if base_key in self.plan:
            raise UserError(f"base tensor {base_key} is targeted twice (LoRA and trainable tokens?)")
        rank, scaling = scaling_for(self.settings, module)
        target = LoraTarget(module, base_key, pair["A"], pair["B"], kind, rank, scaling,
                            self.settings.fan_in_fan_out and kind == "linear", self.base_layers.pop(module, None),
                            self.magnitudes.pop(module, None))
        base_shape = self.base_shapes[base_key]
        _check_shapes(target, self.adapter_shapes[target.a_key], self.adapter_shapes[target.b_key], base_shape)
        check_magnitude(module, target.b_key, target.magnitude_key, self.settings.use_dora, self.adapter_shapes)
        if target.base_layer_key and tuple(self.adapter_shapes[target.base_layer_key]) != tuple(base_shape):
            raise UserError(f"adapter's saved {module} is {tuple(self.adapter_shapes[target.base_layer_key])}, the "
                            f"base's {tuple(base_shape)}: a resized vocabulary is not supported")
        return target

    def check_nothing_left(self) -> None:
        """Every saved base layer, DoRA magnitude and fused weight went with a LoRA pair."""
        if self.base_layers:
            raise UserError("adapter saves full base layers of non-LoRA modules: "
                            f"{', '.join(sorted(self.base_layers))}")
        if self.magnitudes:
            raise UserError("adapter has DoRA magnitudes of modules without a LoRA pair: "
                            f"{', '.join(sorted(self.magnitudes))}")
        if self.fused:
            adapted = ", ".join(f.param for f in self.fused.values())
            raise UserError(f"adapter config's target_parameters adapt {adapted}, but the adapter has no LoRA pair "
                            "for them")


def _check_shapes(target: LoraTarget, a: tuple, b: tuple, w: tuple) -> None:
    if len(a) != 2 or len(b) != 2 or len(w) != 2:
        raise UserError(f"{target.module}: only Linear / Embedding LoRA layers can be merged "
                        f"(A {a}, B {b}, weight {w})")
    if a[0] != target.rank or b[1] != target.rank:
        raise UserError(f"{target.module}: lora_A {a} / lora_B {b} disagree with the config's rank {target.rank}")
    # Delta B @ A is (b[0], a[1]); Embedding and fan_in_fan_out weights store it transposed.
    expected = (a[1], b[0]) if target.transposed else (b[0], a[1])
    if tuple(w) != expected:
        raise UserError(f"{target.module}: base weight {tuple(w)} does not fit the LoRA delta {expected}")


def merged(target: Target, base_weight: torch.Tensor,
           adapter: Mapping[str, torch.Tensor], out_dtype: torch.dtype | None = None,
           pieces: expert_math.Pieces | None = None) -> torch.Tensor:
    """The merged tensor of one planned base key: W + s * B @ A, the saved module's copy, the base
    with the trained token rows put in (grown when the vocabulary grew), or a fused weight's stored
    tensor with its experts' deltas (`pieces`: `expert_math.merged`); cast, checked finite."""
    if isinstance(target, ExpertTarget):
        return expert_math.merged(target, base_weight, adapter, out_dtype, pieces)
    if isinstance(target, StoredRowsTarget):
        return row_math.merged(target, base_weight, adapter, out_dtype)
    if isinstance(target, TokenRows):
        return token_rows_merged(target, base_weight, adapter[target.adapter_key], out_dtype)
    if isinstance(target, Replacement):
        tensor = adapter[target.adapter_key]
        out_dtype = out_dtype or base_weight.dtype
        if not dtypes.fits(tensor.to(torch.float32), out_dtype):
            raise UserError(f"{target.adapter_key} has values that are not finite in {out_dtype}")
        return tensor.to(out_dtype, copy=True)
    magnitude = adapter[target.magnitude_key] if target.magnitude_key else None
    return merge_weight(source_weight(target, base_weight, adapter), adapter[target.a_key], adapter[target.b_key],
                        target, out_dtype, magnitude)


def source_weight(target: LoraTarget, base_weight: torch.Tensor, adapter: Mapping[str, torch.Tensor]):
    """The weight the delta is added to: the adapter's saved copy of the layer if any, else the base's."""
    return adapter[target.base_layer_key] if target.base_layer_key else base_weight


def merge_weight(
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    target: LoraTarget,
    out_dtype: torch.dtype | None = None,
    magnitude: torch.Tensor | None = None,
) -> torch.Tensor:
    """W + s * B @ A, summed in fp32, cast to `out_dtype` (default: W's dtype); with a DoRA
    `magnitude` m, that sum V rescaled per output feature to m / ||V|| * V (`dora_math.dora_rescale`).

    Raises UserError if the result holds inf/nan (an overflowing cast or a
    broken adapter): writing such a model would fail much later and obscurely.
    """
    # Our own fp32 copy, updated in place: one full-size fp32 buffer instead of two,
    # and the input is never touched (it may even be a read-only file mapping).
    merged = weight.to(torch.float32, copy=True)
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if target.transposed:
        merged.addmm_(a32.T, b32.T, alpha=target.scaling)
    else:
        merged.addmm_(b32, a32, alpha=target.scaling)
    if magnitude is not None:
        dora_rescale(merged, magnitude, target)
    out_dtype = out_dtype or weight.dtype
    if not dtypes.fits(merged, out_dtype):
        raise UserError(f"merging {target.module} gives values that are not finite in {out_dtype}")
    return merged.to(out_dtype)


def merge_state_dict(
    base: Mapping[str, torch.Tensor],
    adapter: Mapping[str, torch.Tensor],
    adapter_config: Mapping,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Merged copy of a whole base state dict; `dtype` None keeps each tensor's dtype.

    Floating tensors that are not LoRA targets are only cast (the same tensor
    object when no cast is needed); integer tensors are never cast.
    """
    settings = parse_adapter_config(adapter_config)
    plan = plan_targets({k: tuple(v.shape) for k, v in adapter.items()},
                        {k: tuple(v.shape) for k, v in base.items()}, settings)
    out = {}
    for key, weight in base.items():
        out_dtype = dtypes.output_dtype(weight.dtype, dtype)
        target = plan.get(key)
        out[key] = weight.to(out_dtype) if target is None else merged(target, weight, adapter, out_dtype)
    return out
