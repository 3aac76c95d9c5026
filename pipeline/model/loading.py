"""The model for training and evaluation: base + LoRA, and trained weights <-> state dicts.

The base model directory is only ever read. Under LoRA the trained weights are
the PEFT adapter tensors (stored with PEFT's own key names, so a checkpoint's
adapter/ is a stock PEFT dir); in full fine-tuning they are every parameter
that trains. A vision-language model (`AutoModelForImageTextToText`, detected
from its config) trains its language model the same way and its other parts
as the `vision` config group says (`pipeline.model.vision`).
"""

from __future__ import annotations

import logging

import torch

from pipeline.config import TrainConfig
from pipeline.data.vision import ImageText, config_is_vision_language, load_image_text
from pipeline.errors import UserError
from pipeline.model import vision
from pipeline.model.precision import Precision, weights_dtype

log = logging.getLogger(__name__)


def auto_class(config):
    """The Auto class that loads a model with this config: image-text-to-text or causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if config_is_vision_language(config) else AutoModelForCausalLM


def is_vision_language(model) -> bool:
    """Is this (possibly PEFT-wrapped) model a vision-language model?"""
    return config_is_vision_language(getattr(model, "config", None))


def image_text(cfg: TrainConfig) -> ImageText | None:
    """The processor's `ImageText` of a vision-language base (None for a text model)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    return load_image_text(cfg.model.path, cfg.model.trust_remote_code) if config_is_vision_language(config) else None


def load_base(cfg: TrainConfig, dtype: torch.dtype, device: torch.device):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        model = auto_class(config).from_pretrained(
            cfg.model.path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code
        )
    except OSError as err:
        raise UserError(f"cannot load the base model {cfg.model.path!r}: {err}") from None
    model.to(device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def attach_lora(model, cfg: TrainConfig):
    """Wrap with a fresh LoRA adapter; initialization draws from torch's RNG.

    On a vision-language model the adapters go on the language model only (and
    the tower with `vision.train_tower`); `vision.train_projector` trains the
    projector in full as PEFT `modules_to_save`.
    """
    from peft import LoraConfig, get_peft_model

    parts = vision.find_parts(model) if is_vision_language(model) else None
    scopes = None if parts is None else (parts.language,) + ((parts.tower,) if cfg.vision.train_tower else ())
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()
               if scopes is None or name.startswith(tuple(f"{s}." for s in scopes))}
    missing = [t for t in cfg.lora.target_modules if t not in present]
    if len(missing) == len(cfg.lora.target_modules):
        raise UserError(
            f"lora.target_modules={list(cfg.lora.target_modules)} match no module of {cfg.model.path}; "
            f"linear layers there include {sorted(_linear_names(model))[:12]}"
        )
    if missing:
        log.warning("lora.target_modules not found in the model (ignored): %s", missing)
    if parts is not None and cfg.vision.train_tower:
        tower = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()  # (a projector inside it is not the tower)
                 if n.startswith(parts.tower + ".") and not n.startswith(parts.projector + ".")
                 and isinstance(m, torch.nn.Linear)}
        if not tower & set(cfg.lora.target_modules):
            raise UserError(f"vision.train_tower=true, but no name of lora.target_modules={list(cfg.lora.target_modules)} "
                            f"is a linear layer of the vision tower {parts.tower}; its linear layers: {sorted(tower)}")
    targets = [t for t in cfg.lora.target_modules if t in present]
    extra = {}
    if parts is not None:
        extra["modules_to_save"] = [parts.projector] if cfg.vision.train_projector else None
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets if parts is None else vision.lora_targets(parts, targets, tower=cfg.vision.train_tower),
        use_rslora=cfg.lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )
    return get_peft_model(model, lora)


def _linear_names(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def build(cfg: TrainConfig, precision: Precision, device: torch.device):
    """The model as trained: base (frozen under LoRA) plus a fresh adapter.

    Under LoRA the frozen base is loaded in `model.dtype` (auto: the autocast
    dtype); full fine-tuning keeps fp32 weights, which the optimizer updates.
    """
    dtype = weights_dtype(cfg.model.dtype, precision) if cfg.lora.enabled else torch.float32
    model = load_base(cfg, dtype, device)
    if not is_vision_language(model) and (cfg.vision.train_projector or cfg.vision.train_tower):
        raise UserError(f"vision.train_projector / vision.train_tower set, but {cfg.model.path} is a text-only model "
                        "(no vision part in its config)")
    if cfg.lora.enabled:
        model = attach_lora(model, cfg)
    elif is_vision_language(model):
        vision.freeze_for_full_finetuning(model, vision.find_parts(model), train_projector=cfg.vision.train_projector,
                                          train_tower=cfg.vision.train_tower)
    else:
        model.requires_grad_(True)
    return model


def pad_token_id(model_path: str) -> int:
    """The tokenizer's padding id (its end-of-sequence id when it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Trained parameters in a fixed order; their names key every saved state."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def to_saved_keys(model, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter-name keys -> the keys a checkpoint stores (PEFT's, under LoRA)."""
    if not is_peft(model):
        return named
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=named)


def saved_key_map(model, names: list[str]) -> dict[str, str]:
    """saved key -> parameter name, for the trained parameters."""
    params = dict(model.named_parameters())
    by_id = {id(params[n]): n for n in names}
    saved = to_saved_keys(model, {n: params[n] for n in names})
    mapping = {key: by_id[id(t)] for key, t in saved.items() if id(t) in by_id}
    if len(mapping) != len(names):
        raise RuntimeError(f"cannot map {len(names) - len(mapping)} trained parameters to saved keys")
    return mapping


def trained_state(model, names: list[str]) -> dict[str, torch.Tensor]:
    """CPU copies of the trained weights under their saved keys."""
    params = dict(model.named_parameters())
    return {key: params[n].detach().to("cpu", copy=True).contiguous() for key, n in saved_key_map(model, names).items()}


@torch.no_grad()
def load_trained(model, names: list[str], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy saved trained weights into the live parameters, exactly, or fail."""
    mapping = saved_key_map(model, names)
    missing = sorted(set(mapping) - set(tensors))
    unexpected = sorted(set(tensors) - set(mapping))
    if missing or unexpected:
        raise UserError(
            f"{source} does not match the model being trained: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''} "
            "(was it trained with another lora/model config?)"
        )
    params = dict(model.named_parameters())
    for key, name in mapping.items():
        params[name].copy_(tensors[key])


def named_to_param_names(model, names: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saved-key tensors -> parameter-name keys (to load EMA shadows)."""
    mapping = saved_key_map(model, names)
    return {mapping[k]: v for k, v in tensors.items() if k in mapping}
