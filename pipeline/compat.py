"""The library calls that differ between the torch / transformers versions we support, in one place.

Each is chosen by feature detection (does the method, class or keyword exist;
does the object behave), not by comparing version strings, so a backport or a
nightly is handled by what it does. The versions tested are those the README
names (CI installs the declared floors of transformers and peft in a second
environment, `.ci/run`); the GPU machines lent here carry torch 2.11 and
transformers 5.17, whose differences from the newest are the reason for most
entries:

  activation checkpointing  transformers 5.2x renamed `gradient_checkpointing_enable` to
                            `activation_checkpointing_enable` (the old name stays, deprecated);
                            5.17 has only the old one. peft (to 0.21) still reads the deprecated
                            `is_gradient_checkpointing` whenever it wraps a model: `peft_wrapping`
                            keeps that FutureWarning, peft's to act on, out of every stage's log
  DCP async-save stagers    `DefaultStager` exists from torch 2.9; in 2.11 one instance cannot stage
                            twice (its `_stage` closes itself; fixed later, pytorch#183413), so there
                            each save gets a new one
  mask-free attention       transformers' causal-mask builder reads the position ids back to the host
                            (`.all()`: a device sync) in every forward to look for packed sequences;
                            a forward that needs no mask skips the builder (`skip_mask_builder`)
  peft's target rules       peft refuses some target names per family (Mamba's out_proj / conv1d) and,
                            from 0.19 under transformers 5, moves the transformers-4 expert names
                            (gate_proj, up_proj, down_proj, w1..w3) of MoE families onto the fused
                            experts (`peft_refuses_target`, `peft_remapped_targets`: asked of peft
                            itself, nothing where the check or the conversion is missing)
  layers read past forward  Mamba's `dt_proj.weight @ x` (Jamba's and FalconMamba's too, unless the
                            model is quantized): `WEIGHT_READ_PAST_LAYER`, left out of LoRA and of
                            bitsandbytes
  per-layer config values   from 5.17 a config may set an attribute per layer (Gemma 4: head_dim 512 in
                            its full-attention layers, 256 elsewhere), and reading its one global value
                            then raises `AmbiguousGlobalPerLayerAttributeError`; `per_layer` reads
                            every layer's, or the global where the config has one

Imports of torch and transformers happen inside the functions: this module is
imported by code that must stay light (`pipeline.config`'s neighbours do not
import it, but keeping it lazy costs nothing).
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import contextmanager

log = logging.getLogger(__name__)

# The attention implementation a mask-free forward runs under (`skip_mask_builder`): SDPA's own
# function under a name transformers' mask builder does not know, so it returns no mask at once.
MASK_FREE_SDPA = "sdpa_without_mask_builder"


# --- activation checkpointing ---------------------------------------------------------------------


def enable_activation_checkpointing(model, **checkpoint_kwargs) -> None:
    """Turn activation checkpointing on in every checkpointable layer of a transformers `model`
    (its `GradientCheckpointingLayer`s, whose `gradient_checkpointing` flag then says which
    recompute); `checkpoint_kwargs` go to `torch.utils.checkpoint.checkpoint`.

    transformers >= 5.2x: `activation_checkpointing_enable`; earlier 5.x (5.17 on the GPU
    machines): `gradient_checkpointing_enable`, the same function under its old name.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


@contextmanager
def peft_wrapping():
    """Around peft's wrapping of a model (`get_peft_model`, `PeftModel.from_pretrained`): without the
    FutureWarning transformers >= 5.2x gives for peft's own read of `is_gradient_checkpointing`
    (nothing a user can change; any other warning passes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


# --- torch.distributed.checkpoint stagers ---------------------------------------------------------


class SaveStagers:
    """The `async_stager` each asynchronous DCP save of a stage passes (`for_save`).

    Where a `DefaultStager` can stage more than once (`stager_reusable`), one is kept
    for the whole stage: it copies each tensor into a CPU buffer allocated at the
    first save and reused at every later one (pinned on CUDA, so the device-to-host
    copies run at full speed). Where it cannot (torch 2.11), each save gets a new
    one (which closes itself as it stages: nothing to close after). Without
    `DefaultStager` (torch < 2.9) `for_save` returns None and DCP stages into new
    memory itself. Staging is synchronous in every case: done when `async_save`
    returns, so the training may change the weights right after.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.reuse = stager_reusable()
        self._current = None

    def for_save(self):
        """The stager for the next save (the previous save must be complete: its files written)."""
        if self.reuse is None:
            return None
        if not self.reuse:
            return _new_stager(self.cuda)
        if self._current is None:
            self._current = _new_stager(self.cuda)
        return self._current

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None


def _new_stager(cuda: bool):
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


@functools.cache
def stager_reusable() -> bool | None:
    """Can one `DefaultStager` stage several saves? None: torch has no `DefaultStager` (< 2.9).

    Found out by staging a one-element CPU state twice with a throwaway stager: torch
    2.11's closes its inner copier at the end of each `stage` and fails on the second.
    """
    try:
        import torch
        from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401
    except ImportError:
        return None
    stager = _new_stager(cuda=False)
    try:
        state = {"probe": torch.zeros(1)}
        stager.stage(state)
        stager.stage(state)
        return True
    except Exception as err:  # noqa: BLE001 (whatever the broken reuse raises: KeyError in 2.11)
        log.info("DCP DefaultStager cannot be reused on torch %s (%s: %s): one per save",
                 torch.__version__, type(err).__name__, err)
        return False
    finally:
        try:
            stager.close()
        except Exception:  # noqa: BLE001 (closing twice is what broke it)
            pass


def async_save(state, *, checkpoint_id: str, process_group, stager):
    """`torch.distributed.checkpoint.async_save`, passing `stager` only where there is one (the keyword
    exists from torch 2.9, as `DefaultStager` does)."""
    import torch.distributed.checkpoint as dcp

    extra = {"async_stager": stager} if stager is not None else {}
    return dcp.async_save(state, checkpoint_id=checkpoint_id, process_group=process_group, **extra)


# --- layers read past their forward ---------------------------------------------------------------

# Linear layers whose weight their family's forward reads itself, past the layer (`self.dt_proj.weight @ x`
# in transformers' modeling_mamba.py, and in modeling_falcon_mamba.py / modeling_jamba.py unless quantized):
# an adapter on the layer never acts there (its lora_B gets no gradient, and stock peft's base + adapter
# leaves it out), so all-linear leaves them out and a list naming one fails (`pipeline.model.targets`).
# bitsandbytes leaves them unquantized (`pipeline.model.quantization`): Mamba's forward cannot multiply by
# a 4-bit weight.
WEIGHT_READ_PAST_LAYER = {"mamba": ("dt_proj",), "falcon_mamba": ("dt_proj",), "jamba": ("dt_proj",)}


# --- weights a family rescales in evaluation mode -------------------------------------------------

# Config values a base loads with under adapters, where the stock value makes evaluation mode compute another
# function than training. RWKV (transformers' modeling_rwkv.py), an fp16 overflow guard: switching to eval
# divides each block's attention `output` and feed-forward `value` weights by 2 ** (block // rescale_every)
# and halves the hidden states every `rescale_every` blocks. A LoRA delta beside those weights is not divided,
# so base + adapter in eval mode is not the model trained (validation, the EMA evaluation, verify_merge's
# stock reference); and under 4-bit quantization transformers' requantizing step fails outright. With it off
# both modes compute the same function; a merged model holds the delta in its weights and keeps its config.
RESCALED_IN_EVAL = {"rwkv": {"rescale_every": 0}}


def unrescaled(config) -> dict:
    """The config values `config`'s family loads with under adapters (`RESCALED_IN_EVAL`; most: none)."""
    return dict(RESCALED_IN_EVAL.get(getattr(config, "model_type", None), {}))


# --- per-layer config values ----------------------------------------------------------------------


def per_layer(config, key: str) -> list:
    """The values of `key` in a transformers config: one per layer where the config sets some attribute
    per layer (`is_heterogeneous`, transformers >= 5.17; so two keys' lists pair up layer by layer), else
    its global value alone, `[None]` where the config has no such attribute."""
    if getattr(config, "is_heterogeneous", False):
        return [getattr(layer, key, None) for layer in config.per_layer_config]
    return [getattr(config, key, None)]


# --- attention without the mask builder -----------------------------------------------------------


@functools.cache
def _register_mask_free_sdpa() -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(MASK_FREE_SDPA, sdpa_attention_forward)
    return MASK_FREE_SDPA


def _full_causal(config) -> bool:
    """Is every attention layer of this (text) config plain causal: no sliding window, no chunks?"""
    layer_types = getattr(config, "layer_types", None) or []
    limits = [*per_layer(config, "sliding_window"), *per_layer(config, "attention_chunk_size")]
    return all(limit is None for limit in limits) and all(kind == "full_attention" for kind in layer_types)


@contextmanager
def skip_mask_builder(model):
    """Run `model`'s forward inside with no attention mask built: for SDPA forwards that need none
    (causal attention over rows with no padding the loss reads, and no packed sequences).

    transformers' `create_causal_mask` reads the position ids back to the host in
    every forward (`find_packed_sequence_indices`: `.all()`, a device sync) and,
    given a padding mask, the mask too. Under an attention name it has no mask
    function for, it returns None at once, and SDPA's function then runs its
    causal kernel (`is_causal`), the same computation as with `sdpa` and no mask.
    Other attention implementations, and models with sliding-window or chunked
    layers (whose masks are more than causal), are left as they are. The layers' activation
    checkpoint recompute needs no mask either: it reuses the forward's (None).
    """
    config = model.config
    if config._attn_implementation != "sdpa" or not _full_causal(config.get_text_config()):
        yield
        return
    config._attn_implementation = _register_mask_free_sdpa()
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def peft_refuses_target(model, name: str) -> str | None:
    """peft's own verdict on a LoRA target name in `model`: its error message when it refuses the
    name, None when it takes it.

    peft checks each target name against rules of its own before it adapts a
    model (0.21: `out_proj` and `conv1d` of Mamba-based families, falcon_h1 and
    nemotron_h among them, `_check_lora_target_modules_mamba`); asking it at plan
    time fails the run there rather than in the first stage. A peft without the
    check (older or renamed) refuses nothing here, and the stage's own
    `get_peft_model` has the last word.
    """
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    check = getattr(LoraModel, "_check_target_module_compatiblity", None)  # sic: peft's spelling
    if check is None:
        return None
    try:
        check(None, LoraConfig(target_modules=[name]), model, name)  # the check does not use the tuner itself
    except ValueError as err:
        return str(err)
    except (AttributeError, TypeError):  # a peft whose check needs the tuner: left to get_peft_model
        return None
    return None


def peft_remapped_targets(model, names: list[str]) -> set[str]:
    """The layer names among `names` that peft would not adapt as layers of `model`.

    peft 0.19+ under transformers 5 rewrites a LoRA config of a mixture-of-experts
    family whose experts transformers 5 fused (Mixtral, and the Qwen2-MoE pattern:
    Qwen3-MoE, Qwen3-Next, OLMoE, ...): the transformers-4 names of the experts'
    layers (`gate_proj`, `up_proj`, `down_proj`; Mixtral `w1`, `w2`, `w3`; the
    router `gate`) move from `target_modules` to the fused weights in
    `target_parameters`, with rank and alpha doubled for `gate_up_proj`
    (`convert_peft_config_for_transformers`, run by every `get_peft_model` and
    `PeftModel.from_pretrained`). A layer of those names that is not an expert (a
    shared expert's, a dense MLP's) is then silently not adapted. Asking peft's own
    conversion which names it moves tells the caller which layers must be named
    another way. Without the conversion (older peft, transformers 4) none are moved.
    """
    if not names:
        return set()
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers, get_model_conversion_mapping,
        )
    except ImportError:
        return set()
    conversions = get_model_conversion_mapping(model)
    moved = set()
    for name in names:  # one at a time: a name fused with another (gate_proj with up_proj) alone makes peft raise
        config = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(config, model=model, conversions=conversions)
        except ValueError:  # "cannot convert gate_proj without also targeting up_proj": an expert name too
            moved.add(name)
            continue
        if name not in set(config.target_modules or ()):
            moved.add(name)
    return moved


def peft_unscopes_regex(model, regex: str) -> bool:
    """Whether peft would adapt a regex `target_modules` of `model` as bare leaf names.

    For the mixture-of-experts families whose experts transformers 5 fused
    (Mixtral's and Qwen2-MoE's patterns, GLM-4.5V's `glm4v_moe` among them, peft
    0.19+), `convert_peft_config_for_transformers` resolves a regex to the leaf
    names it matches (`q_proj`, ...) before remapping them; those then match the
    same names anywhere in the model, outside the regex's scope (a vision-language
    model's tower). Asks peft's own conversion; without it (older peft,
    transformers 4) a regex stays a regex.
    """
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import (
            convert_peft_config_for_transformers, get_model_conversion_mapping,
        )
    except ImportError:
        return False
    config = LoraConfig(target_modules=regex)
    convert_peft_config_for_transformers(config, model=model, conversions=get_model_conversion_mapping(model))
    return not isinstance(config.target_modules, str)
