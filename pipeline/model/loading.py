"""The model as a run's trainer config builds it: base + LoRA adapter (or every weight, in full fine-tuning).

The entry points that take the whole trainer config (`TrainConfig`), because
they combine its groups; each concept lives in a module of its own and takes
the group it needs:

* `pipeline.model.base`       -- the base model (`model` group): loaded, or an empty skeleton
* `pipeline.model.targets`    -- what LoRA adapts (`lora`, `moe` groups), per module kind
* `pipeline.model.adapter`    -- the peft adapter on those targets
* `pipeline.model.vocabulary` -- rows for the special tokens the run's tokenizer added
* `pipeline.model.trained`    -- the trained parameters and the keys saved states use

The base model directory is only ever read. The names the other modules define
that callers reach through this one (`loading.trainable`, `loading.decoder_layers`,
...) are re-exported below.
"""

from __future__ import annotations

import torch

from pipeline.config import TrainConfig
from pipeline.errors import UserError
from pipeline.model import base, kernels, loss, quantization, router, targets, vision
from pipeline.model.adapter import attach_lora, no_input_casts
from pipeline.model.base import auto_class, decoder_layers, is_vision_language  # noqa: F401  (re-exported)
from pipeline.model.expert_keys import stored_apart
from pipeline.model.precision import Precision, weights_dtype
from pipeline.model.trained import (  # noqa: F401  (re-exported)
    is_peft, load_trained, named_to_param_names, saved_key_map, to_saved_keys, trainable, trained_state,
)
from pipeline.model.vocabulary import grow_vocabulary, refuse_added_tokens_sharded  # noqa: F401  (re-exported)


def load_base(cfg: TrainConfig, dtype: torch.dtype, device: torch.device, *, checkpointed: int = 0,
              compute_dtype: torch.dtype | None = None):
    """`pipeline.model.base.load_base` of the run's `model` group."""
    return base.load_base(cfg.model, dtype, device, checkpointed=checkpointed, compute_dtype=compute_dtype)


def empty_base(cfg: TrainConfig, dtype: torch.dtype, *, checkpointed: int = 0):
    """`pipeline.model.base.empty_base` of the run's `model` group."""
    return base.empty_base(cfg.model, dtype, checkpointed=checkpointed)


def check_vision_settings(model, cfg: TrainConfig) -> None:
    """The `vision` group's training switches need a vision-language model."""
    if not is_vision_language(model) and (cfg.vision.train_projector or cfg.vision.train_tower):
        raise UserError(f"vision.train_projector / vision.train_tower set, but {cfg.model.path} is a text-only model "
                        "(no vision part in its config)")


def plan_model(cfg: TrainConfig, *, world: int | None) -> targets.Targets | None:
    """At plan time, on the base's skeleton on the meta device (nothing read, nothing allocated):
    print the attention kernel and why (an explicit one the model does not support: UserError naming
    `model.attn_implementation`), what LoRA adapts per module kind (`pipeline.model.targets`, which
    refuses what peft would) and the router loss; refuse a model whose decoder body the loss cannot run
    apart from its head (Llama 4's composite); refuse FSDP on a mixture of experts. Returns the
    resolved LoRA targets (None in full fine-tuning). `world`: ranks per stage, if fixed."""
    skeleton = base.meta_model(cfg.model)
    impl, reason = base.attention_choice(cfg.model.attn_implementation, skeleton.config)
    print(f"attention: {impl} ({reason}; each job resolves it again for its own device)")
    check_vision_settings(skeleton, cfg)
    try:  # the loss runs the body and the head apart (`pipeline.model.loss`): a model without a body cannot train
        loss.body(skeleton)
    except ValueError as err:
        raise UserError(f"{cfg.model.path} cannot be trained here: the loss runs the model's decoder body (the "
                        f"module giving last_hidden_state, images merged in) and then its head, and {err}") from None
    resolved = None
    if cfg.lora.enabled:
        resolved = targets.resolve(skeleton, cfg.lora, cfg.moe, tower=cfg.vision.train_tower, where=cfg.model.path)
        print("\n".join(resolved.lines(cfg.model.path)))
    line = router.describe(skeleton, cfg.moe)
    if line:
        print(line)
    if quantization.stored_config(skeleton.config, cfg.model.path) is not None:
        print(f"base stored in {quantization.stored_method(skeleton.config).upper()}: its quantized weights load "
              "dequantized, as numbers in the run's dtype; the export writes them unquantized")
    experts = [n for n, _ in targets.fused_expert_weights(skeleton)]
    if experts and not cfg.lora.enabled and (apart := stored_apart(cfg.model.path, experts)):
        raise UserError(f"lora.enabled=false (full fine-tuning) on {cfg.model.path}: its experts' weights are fused "
                        f"in the model ({apart[0]}, ...) but stored one tensor per expert in its files, and the "
                        "export writes a fully fine-tuned model in the base's layout tensor by tensor: not supported; "
                        "train LoRA adapters (lora.enabled=true), whose merge writes that layout")
    if experts and cfg.distributed.strategy == "fsdp" and world != 1:
        adapted = f"adapts their fused weights ({', '.join(resolved.parameters)})" if resolved and resolved.parameters \
            else "does not adapt them"
        raise UserError(f"distributed.strategy=fsdp on {cfg.model.path}, a mixture of experts (fused expert weights "
                        f"such as {experts[0]}), is not supported: FSDP's sharded load reads each weight under one "
                        "stored key, and peft's ParamWrapper (LoRA on fused experts) is not tested sharded. "
                        f"lora.target_modules={list(cfg.lora.target_modules)} {adapted}; use "
                        "distributed.strategy=ddp (each rank holds the whole model)")
    return resolved


def train_dtype(cfg: TrainConfig, precision: Precision) -> torch.dtype:
    """The weights' dtype in training: under LoRA the frozen base is kept in `model.dtype` (auto: the
    autocast dtype); full fine-tuning keeps fp32 weights, which the optimizer updates."""
    return weights_dtype(cfg.model.dtype, precision) if cfg.lora.enabled else torch.float32


def build(cfg: TrainConfig, precision: Precision, device: torch.device | None, *, empty: bool = False,
          evaluation: bool = False, checkpointed: int = 0):
    """The model as trained: base (frozen under LoRA) plus a fresh adapter.

    `empty`: the base is only a skeleton (`empty_base`) whose weights the caller
    loads; `device` is then unused (the skeleton is on the CPU). `evaluation`:
    every weight in the compute dtype, full fine-tuning too (no fp32 master copy
    to update). The LoRA weights stay fp32 (the optimizer's precision); under
    autocast their inputs are not cast up to fp32 (see `adapter.no_input_casts`).
    A mixture-of-experts model adds its load-balancing loss to the training
    loss as `moe.router_aux_loss` says (`pipeline.model.router`).

    A quantized base (`model.quantization`) goes through the same steps, on
    purpose without peft's `prepare_model_for_kbit_training`: that casts every
    float weight of the base (embeddings, norms, head) up to fp32, silently
    doubling their memory against `model.dtype` and the plan's estimate, and
    turns on reentrant activation checkpointing whatever
    `model.activation_checkpointing` says. What it is for is done here already:
    peft freezes the base, the adapter is fp32, autocast handles the compute
    dtype, and our non-reentrant checkpointing needs no input that requires grad.
    """
    dtype = weights_dtype(cfg.model.dtype, precision) if evaluation else train_dtype(cfg, precision)
    if empty:  # the sharded load reads the base's shapes: it has no rows for added tokens
        refuse_added_tokens_sharded(cfg.model)
    # Through this module's own names (bench/bench_quant.py probes `loading.load_base`).
    model = (empty_base(cfg, dtype, checkpointed=checkpointed) if empty
             else load_base(cfg, dtype, device, checkpointed=checkpointed, compute_dtype=precision.dtype or torch.float32))
    check_vision_settings(model, cfg)
    if cfg.model.liger_kernels:
        kernels.apply_liger(model)
    router.enable_router_loss(model, cfg.moe)
    # Before the adapter: the rows must exist when peft copies them, and in every process alike.
    token_ids = grow_vocabulary(model, cfg.model.tokenizer)
    if cfg.lora.enabled:
        model = attach_lora(model, cfg, token_ids)
        if precision.dtype is not None:
            no_input_casts(model)
    elif is_vision_language(model):
        vision.freeze_for_full_finetuning(model, vision.find_parts(model), train_projector=cfg.vision.train_projector,
                                          train_tower=cfg.vision.train_tower)
    else:
        model.requires_grad_(True)
    if cfg.model.compile:
        for layer in decoder_layers(model):
            layer.compile()
    return model


def pad_token_id(model_path: str) -> int:
    """The tokenizer's padding id (its end-of-sequence id when it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
