"""The model for training and evaluation: base + LoRA, and trained weights <-> state dicts.

The base model directory is only ever read. Under LoRA the trained weights are
the PEFT adapter tensors (stored with PEFT's own key names, so a checkpoint's
adapter/ is a stock PEFT dir); in full fine-tuning they are every parameter
that trains. A vision-language model (`AutoModelForImageTextToText`, detected
from its config) trains its language model the same way and its other parts
as the `vision` config group says (`pipeline.model.vision`).

A quantized base (`model.quantization`: nf4 / fp4 / int8, QLoRA) is read
through transformers' `BitsAndBytesConfig`: its linear layers are quantized by
bitsandbytes as they load, on the CPU as on a GPU; embeddings, norms and the
output head stay in `model.dtype`. The quantized tensors are frozen and never
saved: checkpoints, EMA shadows and exports hold the adapter only, and the
merge reads the unquantized base files.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from pipeline import compat
from pipeline.config import ALL_LINEAR, LORA_INITS, TrainConfig
from pipeline.data.prepare import added_token_ids, read_chat
from pipeline.data.vision import ImageText, config_is_vision_language, load_image_text
from pipeline.errors import UserError
from pipeline.model import kernels, quantization, vision
from pipeline.model.precision import Precision, weights_dtype

log = logging.getLogger(__name__)


def auto_class(config):
    """The Auto class that loads a model with this config: image-text-to-text or causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if config_is_vision_language(config) else AutoModelForCausalLM


def is_vision_language(model) -> bool:
    """Is this (possibly PEFT-wrapped) model a vision-language model?"""
    return config_is_vision_language(getattr(model, "config", None))


def _config(cfg: TrainConfig):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)


def image_text(cfg: TrainConfig) -> ImageText | None:
    """The processor's `ImageText` of a vision-language base (None for a text model)."""
    return load_image_text(cfg.model.path, cfg.model.trust_remote_code) if config_is_vision_language(_config(cfg)) else None


def load_base(cfg: TrainConfig, dtype: torch.dtype, device: torch.device, *, checkpointed: int = 0,
              compute_dtype: torch.dtype | None = None):
    """The base model from `model.path`, in `dtype`, read straight onto `device`.

    `checkpointed`: recompute the activations of the first `checkpointed`
    decoder layers in the backward (non-reentrant `torch.utils.checkpoint`,
    which replays the layer's dropout masks, so the gradients do not change).
    With `model.quantization` its linear layers are quantized as they load
    (`pipeline.model.quantization`; `compute_dtype`: the run's compute dtype, for
    `model.quant_compute_dtype=auto`, default `dtype`).
    """
    quant = quantization.quantization_config(cfg, compute_dtype or dtype)
    try:
        model = auto_class(_config(cfg)).from_pretrained(
            cfg.model.path, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
            attn_implementation=str(cfg.model.attn_implementation),
            # One device: transformers reads each tensor straight onto it (no full CPU copy first;
            # a device_map needs accelerate, a dependency for that reason). bitsandbytes quantizes
            # each layer as it lands on the device the map names, the CPU included.
            device_map=None if device.type == "cpu" and quant is None else {"": device},
            quantization_config=quant,
        )
    except (OSError, ImportError, ValueError) as err:  # an attention kernel (or accelerate) not installed
        raise UserError(f"cannot load the base model {cfg.model.path!r}{quantization.described(cfg)}: {err}") from None
    if quant is not None:
        quantization.one_cpu_kernel(model)
        if device.type == "cpu":
            quantization.off_the_file(model)
        log.info("base %s loaded with model.quantization=%s: %d linear layers quantized by bitsandbytes",
                 cfg.model.path, cfg.model.quantization, quantization.count_quantized(model))
    _for_training(model, checkpointed)
    return model


def empty_base(cfg: TrainConfig, dtype: torch.dtype, *, checkpointed: int = 0):
    """The base model's skeleton: parameters allocated on the CPU but never written, buffers real.

    Nothing is read from the weight files and almost no memory is resident (the
    kernel backs untouched pages with nothing), yet every parameter has a real
    CPU tensor, so adapters attach and `fully_shard` cuts shards as from a loaded
    model; the weights are then read into each rank's shards only
    (`pipeline.train.sharded_load`). Creating it draws nothing from the RNG.
    """
    config = _config(cfg)
    # Some modules draw their initial values in __init__ on the CPU before registering them
    # (CLIP's class embedding: torch.randn); the run's RNG stream must not see those draws.
    with torch.random.fork_rng(devices=[]), _parameters_on_meta():
        model = auto_class(config).from_config(config, dtype=dtype, trust_remote_code=cfg.model.trust_remote_code,
                                                 attn_implementation=str(cfg.model.attn_implementation))
    with _unfilled():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta":
                    module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                                  requires_grad=param.requires_grad)
    model.tie_weights()  # the replaced parameters broke the ties (lm_head to the embeddings)
    _for_training(model, checkpointed)
    return model


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


def _for_training(model, checkpointed: int) -> None:
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


def _lora_modules(model, cfg: TrainConfig) -> list[tuple[str, torch.nn.Module]]:
    """The modules LoRA may adapt: all of a text model's; a vision-language model's language
    model only (and its vision tower with `vision.train_tower`), never the projector."""
    if not is_vision_language(model):
        return list(model.named_modules())
    parts = vision.find_parts(model)
    return [(n, m) for n, m in model.named_modules() if vision.in_lora_scope(parts, n, tower=cfg.vision.train_tower)]


def adaptable_layers(model, modules: list[tuple[str, torch.nn.Module]] | None = None) -> list[str]:
    """Name suffixes of the layers LoRA can adapt: Linear and GPT-2-style Conv1D, not the output head
    (among `modules`, default all of the model's)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, m in (model.named_modules() if modules is None else modules)
             if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    return sorted(names)


def lora_targets(model, cfg: TrainConfig) -> list[str]:
    """The layer name suffixes `lora.target_modules` selects in `model`; UserError if none.

    `[all-linear]` (the default) selects every adaptable layer (`adaptable_layers`);
    a list of names selects those present (the others are logged and ignored).
    In a vision-language model both look in the language model only (and the
    vision tower with `vision.train_tower`): the default trains no vision weight.
    """
    requested = list(cfg.lora.target_modules)
    modules = _lora_modules(model, cfg)
    adaptable = adaptable_layers(model, modules)
    where = cfg.model.path + (" (its language model" + (" and vision tower)" if cfg.vision.train_tower else ")")
                              if is_vision_language(model) else "")
    if requested == [ALL_LINEAR]:
        chosen = adaptable
    else:
        present = {name.rsplit(".", 1)[-1] for name, _ in modules}
        chosen = [t for t in requested if t in present]
        missing = [t for t in requested if t not in present]
        if missing and chosen:
            log.warning("lora.target_modules not found in the model (ignored): %s", missing)
    if not chosen:
        raise UserError(
            f"lora.target_modules={requested} match no layer of {where}; the layers LoRA can adapt "
            f"there (Linear / Conv1D, output head left out) are: {', '.join(adaptable) or 'none'}. "
            f"Use lora.target_modules=[{ALL_LINEAR}] or some of these names."
        )
    if is_vision_language(model) and cfg.vision.train_tower:
        parts = vision.find_parts(model)
        tower = {n.rsplit(".", 1)[-1] for n, m in modules  # (a projector inside it is not the tower)
                 if n.startswith(parts.tower + ".") and isinstance(m, torch.nn.Linear)}
        if not tower & set(chosen):
            raise UserError(f"vision.train_tower=true, but no name of lora.target_modules={requested} "
                            f"is a linear layer of the vision tower {parts.tower}; its linear layers: {sorted(tower)}")
    if cfg.lora.use_dora:
        _check_dora_layers(modules, chosen, requested)
    return chosen


def _dora_kinds() -> tuple[type, ...]:
    """Layer kinds DoRA trains and the streaming merge folds (peft 0.21: Linear, GPT-2 Conv1D as a
    Linear with fan_in_fan_out, Embedding; its Conv and MultiheadAttention are left out: the
    merge handles 2-D weights only, and peft has no DoRA for MultiheadAttention)."""
    from transformers.pytorch_utils import Conv1D

    return torch.nn.Linear, Conv1D, torch.nn.Embedding


def _check_dora_layers(modules: list[tuple[str, torch.nn.Module]], chosen: list[str], requested: list[str]) -> None:
    """UserError naming lora.use_dora, lora.target_modules and the layers when a chosen name
    selects a layer kind DoRA does not support."""
    kinds = _dora_kinds()
    bad = sorted({f"{n.rsplit('.', 1)[-1]} ({type(m).__name__})" for n, m in modules
                  if n.rsplit(".", 1)[-1] in chosen and not isinstance(m, kinds)})
    if bad:
        raise UserError(f"lora.use_dora=true, but lora.target_modules={requested} selects layers DoRA is not "
                        f"supported on here: {', '.join(bad)}; DoRA adapts {' / '.join(k.__name__ for k in kinds)} "
                        "layers. Leave those out of lora.target_modules, or set lora.use_dora=false")


def check_vision_settings(model, cfg: TrainConfig) -> None:
    """The `vision` group's training switches need a vision-language model."""
    if not is_vision_language(model) and (cfg.vision.train_projector or cfg.vision.train_tower):
        raise UserError(f"vision.train_projector / vision.train_tower set, but {cfg.model.path} is a text-only model "
                        "(no vision part in its config)")


def check_lora_targets(cfg: TrainConfig) -> None:
    """At plan time: build the model's skeleton on the meta device (no weights read) and resolve
    the LoRA targets against it, so a mismatch fails before any training. UserError if none match."""
    config = _config(cfg)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    check_vision_settings(model, cfg)
    lora_targets(model, cfg)


# --- special tokens the run's tokenizer added ----------------------------------------------------

FSDP_TOKENS_ERROR = ("{where} adds special tokens {tokens} (data.chat_template={template!r} on a vocabulary "
                     "without them), whose embedding rows must be trained; distributed.strategy=fsdp does not "
                     "support that yet: use distributed.strategy=ddp, or a chat template whose turn markers "
                     "the vocabulary has")


def added_tokens(cfg: TrainConfig) -> list[int]:
    """Ids of the special tokens the run's tokenizer (`model.tokenizer`) added to the base vocabulary."""
    return added_token_ids(cfg.model.tokenizer) if cfg.model.tokenizer else []


def refuse_added_tokens_sharded(cfg: TrainConfig) -> None:
    """UserError when the run adds tokens and shards the model (FSDP trains no token rows)."""
    if added_tokens(cfg):
        chat = read_chat(cfg.model.tokenizer)
        raise UserError(FSDP_TOKENS_ERROR.format(where=f"the run's tokenizer {cfg.model.tokenizer}",
                                                 tokens=", ".join(chat.get("added_tokens", {})),
                                                 template=chat.get("template", "?").removeprefix("builtin:")))


def _module_name(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _grown(weight: torch.Tensor, rows: int) -> torch.nn.Parameter:
    """`weight` with rows appended up to `rows`, each the mean of the existing rows.

    No RNG: every stage and every process grows the same rows bit for bit, so
    the run's random stream and its exact resume do not depend on it. The mean
    (summed in fp32) keeps a new token's first logits and inputs typical of the
    vocabulary (a zero or random row would not); training replaces the rows anyway.
    """
    with torch.no_grad():
        new = weight.new_empty((rows, weight.shape[1]))
        new[: weight.shape[0]] = weight
        new[weight.shape[0]:] = weight.float().mean(dim=0).to(weight.dtype)
    return torch.nn.Parameter(new, requires_grad=weight.requires_grad)


def grow_vocabulary(model, cfg: TrainConfig) -> list[int]:
    """Give the base model rows for the tokens its run tokenizer added; returns their ids.

    A vocabulary that already has spare rows (padded to a multiple) keeps its
    shape; otherwise the input embeddings, and an untied output head, grow to
    the tokenizer's size (`_grown`), and the config's `vocab_size` follows.
    """
    ids = added_tokens(cfg)
    if not ids:
        return []
    rows = max(int(read_chat(cfg.model.tokenizer).get("vocab_size") or 0), max(ids) + 1)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding.weight.shape[0] < rows:
        tied = head is not None and head.weight is embedding.weight
        embedding.weight = _grown(embedding.weight, rows)
        embedding.num_embeddings = rows
        if tied:
            head.weight = embedding.weight
        elif head is not None:
            head.weight = _grown(head.weight, rows)
        if head is not None:
            head.out_features = rows
        model.config.get_text_config().vocab_size = rows
    return ids


def _token_rows(model, ids: list[int]) -> dict[str, list[int]] | None:
    """peft `trainable_token_indices`: the added rows of the input embeddings, and of an untied head
    (a tied head shares the embedding's trained rows; peft ties them itself)."""
    if not ids:
        return None
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = {_module_name(model, embedding): list(ids)}
    if head is not None and head.weight is not embedding.weight:
        rows[_module_name(model, head)] = list(ids)
    return rows


def _fp32_token_rows(model) -> None:
    """The trained token rows in fp32, as the LoRA weights: peft copies them in the base's dtype,
    and AdamW updates on bf16 weights lose the small steps (the forward casts them back)."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    for module in model.modules():
        if isinstance(module, TrainableTokensLayer) and not module.tied_adapter:
            for param in module.trainable_tokens_delta.values():
                param.data = param.data.float()


def attach_lora(model, cfg: TrainConfig, token_ids: list[int] = ()):
    """Wrap with a fresh LoRA adapter; initialization draws from torch's RNG.

    On a vision-language model the adapters go on the language model only (and
    the tower with `vision.train_tower`); `vision.train_projector` trains the
    projector in full as PEFT `modules_to_save`. `token_ids`: rows of the
    embeddings (and untied head) trained too, as peft `trainable_token_indices`
    (saved in the adapter as `...token_adapter.trainable_tokens_delta`: the rows' values).
    """
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, cfg)
    extra = {}
    rows = _token_rows(model, list(token_ids))
    if rows:
        head = model.get_output_embeddings()
        if head is not None and _module_name(model, head).rsplit(".", 1)[-1] in targets:
            raise UserError(f"lora.target_modules adapts the output head, and the run's tokenizer added tokens whose "
                            f"head rows must train; leave {_module_name(model, head)} out of lora.target_modules")
        extra["trainable_token_indices"] = rows
    if is_vision_language(model):
        parts = vision.find_parts(model)
        targets = vision.lora_targets(parts, targets, tower=cfg.vision.train_tower)
        extra["modules_to_save"] = [parts.projector] if cfg.vision.train_projector else None
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets,
        use_rslora=cfg.lora.use_rslora,
        use_dora=cfg.lora.use_dora,
        init_lora_weights=LORA_INITS[cfg.lora.init],  # the config refuses the others (pipeline.config.init_problem)
        bias="none",
        task_type="CAUSAL_LM",
        **extra,
    )
    model = get_peft_model(model, lora)
    if rows:
        _fp32_token_rows(model)
    if cfg.lora.fused:
        log.info("lora.fused: %d LoRA linear layers run as one addmm each", kernels.fuse_lora(model))
    return model


def train_dtype(cfg: TrainConfig, precision: Precision) -> torch.dtype:
    """The weights' dtype in training: under LoRA the frozen base is kept in `model.dtype` (auto:
    the autocast dtype); full fine-tuning keeps fp32 weights, which the optimizer updates."""
    return weights_dtype(cfg.model.dtype, precision) if cfg.lora.enabled else torch.float32


def build(cfg: TrainConfig, precision: Precision, device: torch.device | None, *, empty: bool = False,
          evaluation: bool = False, checkpointed: int = 0):
    """The model as trained: base (frozen under LoRA) plus a fresh adapter.

    `empty`: the base is only a skeleton (`empty_base`) whose weights the caller
    loads; `device` is then unused (the skeleton is on the CPU). `evaluation`:
    every weight in the compute dtype, full fine-tuning too (no fp32 master copy
    to update). The LoRA weights stay fp32 (the optimizer's precision); under
    autocast their inputs are not cast up to fp32 (see `_no_input_casts`).

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
        refuse_added_tokens_sharded(cfg)
    model = (empty_base(cfg, dtype, checkpointed=checkpointed) if empty
             else load_base(cfg, dtype, device, checkpointed=checkpointed,
                            compute_dtype=precision.dtype or torch.float32))
    check_vision_settings(model, cfg)
    if cfg.model.liger_kernels:
        kernels.apply_liger(model)
    # Before the adapter: the rows must exist when peft copies them, and in every process alike.
    token_ids = grow_vocabulary(model, cfg)
    if cfg.lora.enabled:
        model = attach_lora(model, cfg, token_ids)
        if precision.dtype is not None:
            _no_input_casts(model)
    elif is_vision_language(model):
        vision.freeze_for_full_finetuning(model, vision.find_parts(model), train_projector=cfg.vision.train_projector,
                                          train_tower=cfg.vision.train_tower)
    else:
        model.requires_grad_(True)
    if cfg.model.compile:
        for layer in decoder_layers(model):
            layer.compile()
    return model


def _no_input_casts(model) -> None:
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

    # save_embedding_layers=False: only the trained tensors given are saved. ("auto" would
    # re-read the base's config at every save to spot a grown vocabulary and add the whole
    # embedding matrix; the added rows are in the adapter as trainable tokens already.)
    return get_peft_model_state_dict(model, state_dict=named, save_embedding_layers=False)


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
