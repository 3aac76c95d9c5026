"""The LoRA adapter a run trains: peft's, on the targets `pipeline.model.targets` resolves.

On a vision-language model the adapters go on the language model only (and the
tower with `vision.train_tower`); `vision.train_projector` trains the projector
in full as PEFT `modules_to_save`. Fused expert weights of a mixture-of-experts
model are adapted through peft's `target_parameters` (`ParamWrapper`); on a
vision-language model those names, and the regex of its target modules where
peft's conversion of a fused-expert family would reduce it to bare names, are
given in full where they would reach outside the language model (GLM-4.5V).
"""

from __future__ import annotations

import logging

from pipeline.compat import peft_unscopes_regex, peft_wrapping
from pipeline.config import LORA_INITS, TrainConfig
from pipeline.errors import UserError
from pipeline.model import kernels, targets as lora_targets, vision
from pipeline.model.base import is_vision_language
from pipeline.model.vocabulary import fp32_token_rows, module_name, token_rows

log = logging.getLogger(__name__)


def attach_lora(model, cfg: TrainConfig, token_ids: list[int] = ()):
    """Wrap with a fresh LoRA adapter; initialization draws from torch's RNG.

    `token_ids`: rows of the embeddings (and untied head) trained too, as peft
    `trainable_token_indices` (saved in the adapter as
    `...token_adapter.trainable_tokens_delta`: the rows' values).
    """
    from peft import LoraConfig, get_peft_model

    resolved = lora_targets.resolve(model, cfg.lora, cfg.moe, tower=cfg.vision.train_tower, where=cfg.model.path)
    targets = resolved.modules
    extra = {}
    rows = token_rows(model, list(token_ids))
    if rows:
        head = model.get_output_embeddings()
        if head is not None and module_name(model, head).rsplit(".", 1)[-1] in targets:
            raise UserError(f"lora.target_modules adapts the output head, and the run's tokenizer added tokens whose "
                            f"head rows must train; leave {module_name(model, head)} out of lora.target_modules")
        extra["trainable_token_indices"] = rows
    parameters = resolved.parameters
    if is_vision_language(model):
        parts = vision.find_parts(model)
        targets = vision.lora_targets(parts, targets, tower=cfg.vision.train_tower) if targets else None
        if targets and parameters and peft_unscopes_regex(model, targets):  # kept in scope as a list of names
            targets = vision.matching_modules(model, targets)
        parameters = vision.scoped_parameters(model, parts, parameters, tower=cfg.vision.train_tower)
        extra["modules_to_save"] = _wrappable(model, parts.projectors) if cfg.vision.train_projector else None
    if parameters:
        extra["target_parameters"] = parameters
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        # [] with weights only, not None: None is peft's default layers of the family (Mixtral's q_proj and v_proj
        # in peft 0.18, Falcon's query_key_value), adapted besides the weights or refused where they coincide
        target_modules=targets or [],
        use_rslora=cfg.lora.use_rslora,
        use_dora=cfg.lora.use_dora,
        init_lora_weights=LORA_INITS[cfg.lora.init],  # the config refuses the others (pipeline.config.init_problem)
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )
    with peft_wrapping():
        model = get_peft_model(model, lora)
    if _quantized_conv1d(model):  # the adapter merges into (and loads onto) the base's Conv1D layout
        model.peft_config["default"].fan_in_fan_out = True
    if rows:
        fp32_token_rows(model)
    if cfg.lora.fused:
        log.info("lora.fused: %d LoRA linear layers run as one addmm each", kernels.fuse_lora(model))
    return model


def _quantized_conv1d(model) -> bool:
    """Are the LoRA layers' bases quantized layers that replaced GPT-2-style Conv1D layers (transformers'
    bitsandbytes integration keeps the class it replaced as `source_cls`)? Trained on them, the adapter is a
    Linear's; the unquantized base the merge and stock peft read stores those weights transposed ([in, out]), as
    peft's `fan_in_fan_out` says. UserError for a mix of both kinds, which one adapter config cannot say."""
    from transformers.pytorch_utils import Conv1D

    sources = [getattr(m.get_base_layer(), "source_cls", None) for m in model.modules()
               if hasattr(m, "lora_A") and hasattr(m, "get_base_layer")]
    conv = [isinstance(s, type) and issubclass(s, Conv1D) for s in sources]
    if any(conv) and not all(conv):
        raise UserError("model.quantization: LoRA targets both quantized Conv1D (GPT-2 style) and Linear layers, "
                        "whose weights the base stores in opposite layouts; target one kind (lora.target_modules)")
    return any(conv)


def no_input_casts(model) -> None:
    """Keep LoRA inputs in the compute dtype under autocast.

    peft casts each LoRA layer's input to the adapter's dtype (fp32) and
    applies dropout there: for seven targets about as much memory traffic as
    the base matmuls. Under autocast the LoRA matmuls run in the autocast dtype
    anyway, so the cast buys nothing; without autocast it is needed (fp32
    weights, half-precision input) and stays.
    """
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def _wrappable(model, names) -> list[str]:
    """`names` as peft's modules_to_save takes them: peft wraps a module, not a container of modules, so a
    ModuleList or ModuleDict (Granite 4 Vision's Q-Former projectors) is named by its children."""
    import torch

    modules = dict(model.named_modules())
    out = []
    for name in names:
        module = modules[name]
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += [f"{name}.{child}" for child, _ in module.named_children()]
        else:
            out.append(name)
    return out
