"""The base model: read from `model.path` (only ever read), or built as an empty skeleton.

A vision-language model (`AutoModelForImageTextToText`, detected from its
config) loads like a causal LM. A quantized base (`model.quantization`: nf4 /
fp4 / int8, QLoRA) is read through transformers' `BitsAndBytesConfig`: its
linear layers are quantized by bitsandbytes as they load, on the CPU as on a
GPU; embeddings, norms and the output head stay in `model.dtype`
(`pipeline.model.quantization`). The attention kernel is `model.attn_implementation`
resolved for the model and the device (`pipeline.model.attention`).

Every function here takes the `model` config group (`ModelConfig`), not the
whole trainer config: that is all the base depends on.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from pipeline import compat
from pipeline.config import ModelConfig
from pipeline.data.vision import ImageText, config_is_vision_language, load_image_text
from pipeline.errors import UserError
from pipeline.model import attention, quantization, vision
from pipeline.storage import packed as stored_packed

log = logging.getLogger(__name__)


def auto_class(config):
    """The Auto class that loads a model with this config: image-text-to-text or causal LM. A text model
    whose causal-LM class transformers registers only for image-text-to-text (Mistral 4's
    `Mistral4ForCausalLM` in 5.24) loads through that mapping: it is the same class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if config_is_vision_language(config):
        return AutoModelForImageTextToText
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def model_class(config):
    """The class `auto_class(config)` builds for this config, or None (remote code it does not map)."""
    try:
        return auto_class(config)._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None


def is_vision_language(model) -> bool:
    """Is this (possibly PEFT-wrapped) model a vision-language model?"""
    return config_is_vision_language(getattr(model, "config", None))


def hf_config(model: ModelConfig):
    """The base's transformers config (config.json of `model.path`), with the values its family trains under
    adapters with (`compat.unrescaled`: RWKV's eval-mode rescaling off)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    for key, value in compat.unrescaled(config).items():
        setattr(config, key, value)
    return config


def image_text(model: ModelConfig) -> ImageText | None:
    """The processor's `ImageText` of a vision-language base (None for a text model)."""
    return load_image_text(model.path, model.trust_remote_code) if config_is_vision_language(hf_config(model)) else None


def attention_choice(requested: str, config, device=None) -> tuple[str, str]:
    """`attention.resolve` for the model of `config` on `device` (default: CUDA if this process has it):
    (the implementation, why)."""
    family = str(getattr(config, "model_type", None) or type(config).__name__)
    largest = max((size for size in attention.head_sizes(config) if size), default=None)
    return attention.resolve(requested, attention.support_of(model_class(config), family, largest),
                             attention.Machine.here(device))


def attention_for(model: ModelConfig, config, device) -> str:
    """The attention implementation the base loads with on `device` (`attention_choice`), logged with why."""
    impl, reason = attention_choice(model.attn_implementation, config, device)
    log.info("attention: %s (%s)", impl, reason)
    return impl


def load_base(model: ModelConfig, dtype: torch.dtype, device: torch.device, *, checkpointed: int = 0,
              compute_dtype: torch.dtype | None = None):
    """The base model from `model.path`, in `dtype`, read straight onto `device`.

    `checkpointed`: recompute the activations of the first `checkpointed`
    decoder layers in the backward (non-reentrant `torch.utils.checkpoint`,
    which replays the layer's dropout masks, so the gradients do not change).
    With `model.quantization` its linear layers are quantized as they load
    (`pipeline.model.quantization`; `compute_dtype`: the run's compute dtype, for
    `model.quant_compute_dtype=auto`, default `dtype`).
    """
    quant = quantization.quantization_config(model, compute_dtype or dtype)
    config = hf_config(model)
    # a base stored quantized (MXFP4: GPT-OSS as published) loads dequantized, as numbers
    stored = quantization.stored_config(config, model.path)
    try:
        base, loaded = auto_class(config).from_pretrained(
            model.path, dtype=dtype, trust_remote_code=model.trust_remote_code,
            attn_implementation=attention_for(model, config, device),
            # One device: transformers reads each tensor straight onto it (no full CPU copy first;
            # a device_map needs accelerate, a dependency for that reason). bitsandbytes quantizes
            # each layer as it lands on the device the map names, the CPU included.
            device_map=None if device.type == "cpu" and quant is None else {"": device},
            quantization_config=quant or stored, output_loading_info=True, **compat.unrescaled(config),
        )
    except (OSError, ImportError, ValueError) as err:  # an attention kernel (or accelerate) not installed
        raise UserError(f"cannot load the base model {model.path!r}{quantization.described(model)}: {err}") from None
    if stored is not None:
        stored_packed.in_dtype(base, stored_packed.packed_weights(model.path), dtype)
    if loaded.get("missing_keys"):  # transformers initialised them at random: training would start from noise there
        missing = sorted(loaded["missing_keys"])
        raise UserError(f"the base model {model.path!r} holds no values for {len(missing)} parameters of "
                        f"{type(base).__name__}, which transformers would initialise at random: "
                        f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    if quant is not None:
        quantization.one_cpu_kernel(base)
        if device.type == "cpu":
            quantization.off_the_file(base)
        log.info("base %s loaded with model.quantization=%s: %d linear layers quantized by bitsandbytes",
                 model.path, model.quantization, quantization.count_quantized(base))
    for_training(base, checkpointed)
    return base


def empty_base(model: ModelConfig, dtype: torch.dtype, *, checkpointed: int = 0, device=None):
    """The base model's skeleton: parameters allocated on the CPU but never written, buffers real.

    Nothing is read from the weight files and almost no memory is resident (the
    kernel backs untouched pages with nothing), yet every parameter has a real
    CPU tensor, so adapters attach and `fully_shard` cuts shards as from a loaded
    model; the weights are then read into each rank's shards only
    (`pipeline.train.sharded_load`). Creating it draws nothing from the RNG.
    `device`: where it will compute (its attention kernel is chosen for it).
    """
    config = hf_config(model)
    # Some modules draw their initial values in __init__ on the CPU before registering them
    # (CLIP's class embedding: torch.randn); the run's RNG stream must not see those draws.
    with torch.random.fork_rng(devices=[]), _parameters_on_meta():
        skeleton = auto_class(config).from_config(config, dtype=dtype, trust_remote_code=model.trust_remote_code,
                                                  attn_implementation=attention_for(model, config, device))
    with _unfilled():
        for module in skeleton.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta":
                    module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                                  requires_grad=param.requires_grad)
    skeleton.tie_weights()  # the replaced parameters broke the ties (lm_head to the embeddings)
    for_training(skeleton, checkpointed)
    return skeleton


def meta_model(model: ModelConfig):
    """The base's architecture on the meta device: no weight read, nothing allocated (plan-time checks). A part
    whose class needs a package not installed here (Gemma 3n's timm tower) is a UserError naming the model."""
    config = hf_config(model)
    try:
        with torch.device("meta"):
            return auto_class(config).from_config(config, trust_remote_code=model.trust_remote_code)
    except ImportError as err:  # transformers' requires_backends: a blank line, then "X requires the y library..."
        raise UserError(f"{model.path} cannot be built here: {' '.join(str(err).split())}") from None


@contextmanager
def _unfilled():
    """`torch.empty` leaves memory unwritten, even in deterministic mode.

    `deterministic=true` (`torch.use_deterministic_algorithms`) makes every
    empty tensor filled with NaN (`torch.utils.deterministic.fill_uninitialized_memory`),
    which writes every page of the skeleton: each rank would hold the whole
    model in host RAM. No computation sees the skeleton's values: before the
    first forward every parameter is either read from the weight files into its
    shards or initialized (the adapter), so what a run computes stays deterministic.
    """
    import torch.utils.deterministic as deterministic

    fill = deterministic.fill_uninitialized_memory
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = fill


@contextmanager
def _parameters_on_meta():
    """Parameters registered inside live on the meta device (no memory, no RNG draw for their
    initialization); buffers are created as usual (rotary tables are computed, not loaded)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def for_training(model, checkpointed: int) -> None:
    """Activation checkpointing on the first `checkpointed` decoder layers of the (language) model,
    off on the others: those keep their activations and skip the recompute. At least their number:
    every layer, a vision tower's too.

    The first ones: the backward reaches them last, after the later layers' activations are freed,
    so their recompute does not add to the peak (`pipeline.model.memory`, which counts the language
    model's layers only).
    """
    if not checkpointed:
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    compat.enable_activation_checkpointing(model, use_reentrant=False)
    # transformers turns it on in every GradientCheckpointingLayer; module order is the forward's.
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    language = vision.find_parts(model).language + "." if is_vision_language(model) else ""
    decoder = [m for n, m in layers if n.startswith(language)]
    if checkpointed >= len(decoder):
        return
    kept = {id(m) for m in decoder[:checkpointed]}
    for _, layer in layers:
        layer.gradient_checkpointing = id(layer) in kept


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of an HF model (its `_no_split_modules` classes), outermost first.

    What FSDP shards one by one and `model.compile` compiles one by one. `model`
    may wrap the HF model (PEFT, `pipeline.model.loss.TokenLoss`): the classes
    come from whichever submodules declare them.
    """
    kinds = {k for m in model.modules() for k in (getattr(m, "_no_split_modules", None) or [])}
    layers = [m for m in model.modules() if type(m).__name__ in kinds]
    # A no-split class nested inside another one goes with its parent.
    inner = {id(c) for m in layers for c in m.modules() if c is not m}
    return [m for m in layers if id(m) not in inner]
