"""The trainer's one typed config: Hydra structured configs (dataclasses).

Every setting's default and doc live here, once (`setting`); the reference a
user reads, docs/train_config.yaml, is generated from them
(`python -m pipeline train-config-reference`, pipeline/config_reference.py).
`config/train/` holds one YAML group per dataclass below (model, lora, vision,
moe, ema, optim, precision, distributed, checkpoint, validation, alerts, tokens), each
option holding only what it changes (`lora=full`, `distributed=fsdp`); `resolve()`
composes them with the user's overrides through Hydra's compose API and merges
the result onto these dataclasses, so an unknown key, a wrong type or a value
outside a choice's Enum is an error that names the key. The resolved config
is written once by the `plan` rule and read back by every stage (and saved in
every checkpoint), so all stages of a run train with the same settings.

We use the compose API rather than `@hydra.main` on purpose: under torchrun
every rank would otherwise create its own timestamped output dir and log file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.errors import UserError

SCHEMA_NAME = "train_schema"
ALL_LINEAR = "all-linear"  # lora.target_modules=[all-linear]: every Linear / Conv1D layer but the output head


class Choice(str, Enum):
    """A setting with a fixed set of values. A `str` too, so `cfg.precision.mode == "bf16"` holds;
    it prints as its value (`f"{mode}"` is "bf16", not "PrecisionMode.bf16"). OmegaConf takes a
    member's name, so each name is the value the user writes."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class PrecisionMode(Choice):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Dtype(Choice):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Switch(Choice):
    """auto | on | off. YAML reads a bare on / off as true / false: those are taken as on / off."""

    auto = "auto"
    on = "on"
    off = "off"


class Attention(Choice):
    """`model.attn_implementation`: auto is resolved per model and machine (`pipeline.model.attention`)."""

    auto = "auto"
    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"
    flash_attention_3 = "flash_attention_3"
    flex_attention = "flex_attention"


# lora.init values: the accepted ones start the adapter as a no-op on the unchanged base, so a
# merge is W + delta over the base files as stored (pipeline.export.lora_math); the others say why not.
LORA_INITS = {"default": True, "gaussian": "gaussian"}
REFUSED_INITS = {
    "pissa": "rewrites the base weights (W - the adapter's principal part)",
    "olora": "rewrites the base weights (W - the adapter's QR part)",
    "corda": "rewrites the base weights, from activation statistics over data",
    "loftq": "rewrites the base weights (quantization-aware)",
    "eva": "is data-driven: it needs a pass over the training data before the first update",
    "lora_ga": "is data-driven: it needs gradients over the training data before the first update",
    "orthogonal": "does not start at the base model (B is not zero)",
    "mica": "freezes lora_B (a variant with a different trained set)",
}


def init_problem(init: str) -> str | None:
    """Why `lora.init` cannot be used (None when it can). The base-rewriting ones would need the
    rewritten base at merge time, and the streaming merge reads the base unchanged from its files."""
    if init in LORA_INITS:
        return None
    known = next((k for k in REFUSED_INITS if init == k or init.startswith(k + "_")), None)
    if known is None:
        return f"lora.init={init!r} is not one of {', '.join(LORA_INITS)}"
    return (f"lora.init={init!r} is not supported: it {REFUSED_INITS[known]}; the workflow's merge reads the base "
            f"weights unchanged from the base files. Use one of: {', '.join(LORA_INITS)}")


class FusedLoss(Choice):
    """How the LM head and the cross-entropy run (pipeline/model/kernels.py)."""

    auto = "auto"
    chunked = "chunked"
    liger = "liger"
    cce = "cce"


class Quantization(Choice):
    """How the frozen base is stored under LoRA (bitsandbytes): none, 4-bit NF4 / FP4, or 8-bit."""

    none = "none"
    nf4 = "nf4"
    fp4 = "fp4"
    int8 = "int8"


class Strategy(Choice):
    ddp = "ddp"
    fsdp = "fsdp"


def setting(default: Any, doc: str) -> Any:
    """A trainer setting: its default and its doc, stated here once. The reference a user reads
    (docs/train_config.yaml, `python -m pipeline train-config-reference`) is generated from both."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ModelConfig:
    """The base model and how it is loaded."""

    path: str = setting(MISSING, "local Hugging Face model dir or hub id; the workflow fills it in "
                                 "(config/config.yaml's `model`)")
    tokenizer: str | None = setting(None, "the run's tokenizer dir (results/<run>/tokenizer: the chat template "
                                          "trained with, special tokens it added), filled in by the workflow; "
                                          "null = the model dir's own")
    dtype: Dtype = setting(Dtype.auto, "dtype of the frozen base weights under LoRA, and of the weights "
                                       "evaluated (full fine-tuning trains fp32 weights); auto: the autocast "
                                       "compute dtype on a GPU, fp32 on a CPU")
    activation_checkpointing: Switch = setting(
        Switch.auto, "recompute decoder layers' activations in the backward instead of keeping them; on = every "
                     "layer; auto = the fewest layers (the first ones) with which the memory estimate fits "
                     "(the plan prints the choice, k of n layers)")
    attn_implementation: Attention = setting(
        Attention.auto, "attention kernel; auto = the best the model supports and the machine has: "
                        "flash_attention_2 on a CUDA GPU with flash-attn installed (`pip install flash-attn`), "
                        "else sdpa, else eager (GPT-OSS: its attention sinks have no SDPA kernel); the plan "
                        "prints the choice and why (pipeline.model.attention). A value the model does not "
                        "support fails at plan")
    compile: bool = setting(False, "torch.compile each decoder layer (a GPU feature; the first updates compile)")
    fused_loss: FusedLoss = setting(
        FusedLoss.auto, "the LM head + cross-entropy: chunked = ours (chunks of logits recomputed in the backward); "
                        "liger / cce = Liger-Kernel's / cut-cross-entropy's fused kernel, which never writes the "
                        "logits (CUDA, `pip install -e \".[gpu]\"`; not with LoRA on the head, added tokens, "
                        "FSDP or a model that scales or soft-caps its logits after the head (Gemma 2, Cohere, "
                        "Granite, Falcon-H1): chunked there); auto = liger, else cce, where installed on a GPU, "
                        "else chunked")
    liger_kernels: bool = setting(False, "Liger-Kernel's RMSNorm, SwiGLU and RoPE kernels in the decoder (CUDA, "
                                         "`pip install -e \".[gpu]\"`, the families Liger patches: llama, "
                                         "mistral, qwen2, qwen3, gemma, phi3, ...)")
    gpu_memory_gb: float | None = setting(None, "memory of each GPU (GiB); the run must fit it less the CUDA "
                                                "context, NCCL buffers and a fragmentation margin "
                                                "(pipeline.model.memory.budget); null = what the GPUs found have")
    trust_remote_code: bool = setting(False, "run the model repo's own modelling code (Hugging Face "
                                             "trust_remote_code)")
    quantization: Quantization = setting(
        Quantization.none, "store the frozen base's linear layers quantized by bitsandbytes under LoRA (QLoRA): "
                           "nf4 / fp4 = 4 bits per weight in blocks of 64, int8 = LLM.int8() (embeddings, norms and "
                           "the output head stay in model.dtype); needs lora.enabled and `pip install -e \".[quant]\"`. "
                           "Only the adapter trains and is saved; the merge reads the unquantized base files")
    quant_double: bool = setting(True, "nf4 / fp4: quantize the blocks' absmax constants too (double "
                                       "quantization: 0.127 instead of 0.5 bit per weight for them)")
    quant_compute_dtype: Dtype = setting(Dtype.auto, "nf4 / fp4: the dtype a 4-bit layer dequantizes to and "
                                                     "multiplies in; auto = the run's compute dtype (the autocast "
                                                     "dtype; fp32 on a CPU)")


@dataclass
class LoraConfig:
    """LoRA adapters, or full fine-tuning (the option `lora=full`)."""

    enabled: bool = setting(True, "false = full fine-tuning (all weights trained, EMA over all of them)")
    r: int = setting(16, "adapter rank")
    alpha: int = setting(32, "scaling numerator: the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA)")
    dropout: float = setting(0.0, "dropout on the adapters' input; 0 (the default) skips the dropout and the "
                                  "copy of each adapted layer's input it makes (peft then runs lora_B(lora_A(x)) "
                                  "on the layer's own input), and lets lora.fused take the fused path")
    target_modules: list[str] = setting([ALL_LINEAR], "layer name suffixes (e.g. [q_proj, v_proj]), or "
                                                      "[all-linear]: every Linear / Conv1D layer but the output head")
    fused: bool = setting(False, "each LoRA linear layer as one addmm: the adapter's B matmul accumulates into "
                                 "the base layer's output, scaled (pipeline/model/kernels.py); needs "
                                 "lora.dropout=0; DoRA and quantized layers keep peft's forward")
    use_rslora: bool = setting(False, "rank-stabilized LoRA scaling (alpha / sqrt(r))")
    use_dora: bool = setting(False, "DoRA: each adapted layer also learns a magnitude per output feature "
                                    "(peft lora_magnitude_vector), W' = m * (W + s*B@A) / ||W + s*B@A|| per "
                                    "output row; Linear / Conv1D / Embedding layers, not with "
                                    "distributed.strategy=fsdp")
    init: str = setting("default", "adapter initialization (peft init_lora_weights): default (A Kaiming-uniform, "
                                   "B zero) or gaussian (A normal with std 1/r, B zero); both start at the base "
                                   "model. Refused, with the reason: pissa / olora / corda / loftq (they rewrite "
                                   "the base weights, which the merge reads unchanged from the base files), eva / "
                                   "lora_ga (a pass over the data first), orthogonal (B is not zero), mica")


@dataclass
class VisionConfig:
    """Vision-language models only (an image-text-to-text model, detected from its config); a
    text-only model with a setting changed here is an error. The language model is trained as
    `lora` says (LoRA adapters or in full); the vision encoder stays frozen unless train_tower."""

    train_projector: bool = setting(False, "train the vision-to-text projector in full (under LoRA: PEFT "
                                           "modules_to_save)")
    train_tower: bool = setting(False, "also train the vision encoder (under LoRA: adapters on its "
                                       "lora.target_modules; full fine-tuning: all of it)")
    loader_workers: int = setting(2, "DataLoader processes decoding images into pixels ahead of each "
                                     "update (0: in the loop)")


@dataclass
class MoeConfig:
    """Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, Qwen3-Next, ...); a dense model
    ignores it. What LoRA adapts on them (`lora.target_modules`) and the router loss
    (`pipeline.model.targets`, `pipeline.model.router`)."""

    router_aux_loss: bool = setting(True, "add the model's own load-balancing loss (transformers' "
                                          "load_balancing_loss_func over every router's logits) to the training "
                                          "loss, where the model defines one (its config's router_aux_loss_coef); "
                                          "logged per update as router_loss. Validation losses leave it out")
    router_aux_loss_coef: float | None = setting(None, "the load-balancing loss's weight; null = the model "
                                                       "config's router_aux_loss_coef")
    train_router: bool = setting(False, "also adapt each router's weight (LoRA, as the experts); false: the "
                                        "routers stay frozen")


@dataclass
class EmaConfig:
    """Exponential moving averages of the trained weights, each an fp32 shadow."""

    rates: list[float] = setting([0.999, 0.9999], "one shadow per rate, each in (0, 1); [] disables EMA")
    every: int = setting(1, "update the shadows every k optimizer updates, with beta**k")


@dataclass
class OptimConfig:
    """AdamW, linear warmup then cosine decay over the whole run (not a stage), and the batch."""

    lr: float = setting(2e-4, "peak learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    betas: list[float] = setting([0.9, 0.95], "AdamW betas")
    eps: float = setting(1e-8, "AdamW epsilon")
    warmup_fraction: float = setting(0.03, "linear warmup over this fraction of the whole run, in [0, 1)")
    min_lr_ratio: float = setting(0.1, "the cosine ends at lr x min_lr_ratio at the last update of the run")
    grad_clip: float = setting(1.0, "max gradient norm; 0 disables clipping")
    lora_plus_ratio: float | None = setting(None, "LoRA+: lora_B weights (and DoRA magnitudes) learn at "
                                                  "lr x this ratio, the rest at lr (as peft's "
                                                  "create_loraplus_optimizer, but adapters on embeddings keep lr); "
                                                  "null = off (the LoRA+ paper suggests 16)")
    global_batch: int = setting(32, "sequences per optimizer update, all ranks together; a multiple of the "
                                    "world size")
    micro_batch: int = setting(8, "upper bound on the sequences of one forward on one rank: each rank's "
                                  "global_batch / world_size sequences are cut into the largest micro-batch "
                                  "that divides them and is at most this (accumulation = share / micro-batch; "
                                  "pipeline.config.batch_split); packed (tokens.packing): at most this many rows "
                                  "of up to the longest record's tokens, the accumulation then as packed")


@dataclass
class PrecisionConfig:
    """Mixed precision and what happens to non-finite updates."""

    mode: PrecisionMode = setting(PrecisionMode.auto, "auto: bf16 autocast if the GPU supports it, else fp16 + "
                                                      "GradScaler; fp32 on a CPU. bf16 / fp16 are honoured on a "
                                                      "CPU too when asked for (slow; what CI tests)")
    max_consecutive_nonfinite: int = setting(8, "skipped (non-finite) updates in a row before aborting with a "
                                                "checkpoint; fp16 scaler calibration (scale halved after an "
                                                "overflow) is not counted")
    init_scale: float = setting(65536.0, "fp16: the GradScaler's first loss scale (it halves on overflow, "
                                         "doubles every 2000 clean updates)")
    tf32: bool = setting(True, "CUDA: fp32 matmuls and convolutions (all of them under mode=fp32; those autocast "
                               "keeps in fp32 otherwise) run on TF32 tensor cores (Ampere and newer: several "
                               "times faster, 10-bit mantissa inputs, fp32 sums); false: full fp32. As "
                               "deterministic as full fp32 (deterministic=true does not need it off). No effect "
                               "on a CPU")


@dataclass
class DistributedConfig:
    """How several ranks train one model (select FSDP with the option `distributed=fsdp`)."""

    backend: str = setting("auto", "torch.distributed backend; auto: nccl on CUDA, gloo on CPU")
    strategy: Strategy = setting(Strategy.ddp, "ddp: a full replica per rank; fsdp: FSDP2 (fully_shard per "
                                               "decoder layer + root) for models that do not fit one device; its "
                                               "checkpoints hold dcp/ shards instead of adapter/ + ema/")
    timeout_s: int = setting(1800, "collective timeout (seconds): how long a rank waits for the others in one "
                                   "collective (gloo: each operation; NCCL: its watchdog) before the stage fails, "
                                   "so a node that stops answering ends the job instead of hanging it")
    hsdp: bool = setting(False, "fsdp: replicate across nodes, shard within a node (collectives stay in a node)")
    meta_init: bool = setting(True, "fsdp: build empty, shard, read each rank's shards of the base (false: "
                                    "each rank loads it all)")


@dataclass
class CheckpointConfig:
    """Intra-stage checkpoints (work/<run>/<stage>/), which a retried or preempted stage resumes from."""

    save_every: int = setting(50, "intra-stage checkpoint every N updates (0: only at the stage end)")
    keep_last: int = setting(2, "intra-stage checkpoints kept")
    async_save: bool = setting(True, "write on a background thread; the step loop does not wait on the disk")


@dataclass
class ValidationConfig:
    """Validation loss inside a training stage, on the validation cache (tokens.val_cache), for
    the raw weights and every EMA rate. (The workflow's `evaluate` section is the separate
    evaluation job after each stage.)"""

    quick_every: int = setting(0, "quick validation (the first quick_batches batches) every N updates; 0 = off "
                                  "(alerts still trigger one)")
    quick_batches: int = setting(4, "batches of a quick validation")
    every: int = setting(0, "full validation + best-weights tracking every N updates of the run (always after "
                            "the last); 0 = after the last only")
    batch_size: int = setting(16, "sequences per validation forward")
    max_records: int | None = setting(None, "validate on the first N records of the validation set (in its file "
                                            "order; the evaluation jobs too); null = all of them")


@dataclass
class AlertConfig:
    """Alerts raise an immediate validation and a checkpoint, and a line in alerts.jsonl."""

    tps_drop_fraction: float = setting(0.5, "alert when tokens/s fall below this fraction of the running median")
    loss_spike_sigma: float = setting(6.0, "alert when the loss is above mean + k sigma of the recent window")
    window: int = setting(50, "updates in the running window")


@dataclass
class MixSource:
    """One training dataset of a mix (`tokens.mix`): its token cache and its share of each mixed
    epoch (pipeline/data/mix.py): a weight, a record count, or neither (the whole dataset)."""

    name: str = setting(MISSING, "the dataset's name (the workflow's data.train[].name)")
    cache: str = setting(MISSING, "its token cache")
    weight: float | None = setting(None, "share of a mixed epoch, relative to the other weighted datasets")
    records: int | None = setting(None, "exact records per mixed epoch (a cut or repeats)")


@dataclass
class TokensConfig:
    """The token caches (safetensors) the tokenize rule writes, and how their records become
    batches. (The workflow config's `data` section names the dataset files they are made from.)"""

    train_cache: str | None = setting(MISSING, "training token cache; the workflow fills it in (null: tokens.mix)")
    mix: list[MixSource] = setting([], "several training datasets mixed into one seeded order (the workflow "
                                       "fills it in from a list in data.train); [] = train_cache alone")
    val_cache: str | None = setting(None, "validation token cache, filled in by the workflow; null: no "
                                          "validation set (no in-stage validation, no best weights)")
    group_by_length: bool = setting(True, "padded micro-batches (when not packed): cut each update's batch into "
                                          "micro-batches of similar lengths (less padding; the same samples)")
    packing: Switch = setting(Switch.auto, "pack each update's records by best-fit decreasing into rows of up to "
                                           "the longest record, position ids restarting per record, micro-batches "
                                           "of at most optim.micro_batch rows (the same records per update, less "
                                           "padding); auto = where exact: text models of the checked families "
                                           "with sdpa, eager, flex or flash attention (not vision-language "
                                           "models); on = any text model; off = padded micro-batches of "
                                           "optim.micro_batch records (pipeline/planning/packing.py)")
    torch_varlen: bool = setting(False, "packed micro-batches under SDPA on a GPU: one flat row per micro-batch "
                                        "through torch's flash-attention varlen kernel (torch >= 2.10, bf16 / "
                                        "fp16), not packed rows kept apart by a dense block-causal mask; for the "
                                        "families that attend record by record on a CPU (on an H200: 1.6x the "
                                        "tokens/s at 2048, 2x at 4096; off by default until the kernel's "
                                        "per-record losses are checked on a GPU; pipeline/model/packed_attention.py)")


@dataclass
class ProfileConfig:
    """A torch profiler trace of a few updates of each stage (rank 0), with a summary of where the
    time went: both in stages/<stage>/profile/ (`pipeline.train.profiling`)."""

    updates: int = setting(0, "updates to profile in each stage (0 = off); the trace, and the time spent in "
                              "matmuls, attention, loss, optimizer, EMA and data wait (printed and in summary.json)")
    warmup: int = setting(2, "updates of the stage before the profiled ones (kernels chosen, caches warm)")


@dataclass
class TrainConfig:
    """The trainer config: top-level keys, then one group per dataclass."""

    seed: int = setting(0, "LoRA init, data order, dropout: the whole run derives from it")
    deterministic: bool = setting(False, "GPU: deterministic kernels only (torch.use_deterministic_algorithms), "
                                         "so a chunked or resumed run is bitwise the uninterrupted one there too; "
                                         "slower. (A CPU run is anyway.)")
    log_every: int = setting(1, "metrics line every N updates (rank 0)")
    tensorboard: bool = setting(False, "also TensorBoard scalars in stages/<stage>/tensorboard/ "
                                       "(pip install -e \".[tensorboard]\")")
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    alerts: AlertConfig = field(default_factory=AlertConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


# Names that changed meaning-preservingly (one meaning per name across the trainer and the workflow
# config): an override or a config file with an old one gets the new name, not Hydra's "no key".
RENAMED_GROUPS = {"eval": "validation", "data": "tokens"}
RENAMED_KEYS = {"eval.eval_every": "validation.every", "eval.micro_batch": "validation.batch_size"}


def renamed(key: str) -> str | None:
    """The current name of a trainer key (or group) that was renamed; None when `key` was not."""
    if key in RENAMED_KEYS:
        return RENAMED_KEYS[key]
    group, dot, rest = key.partition(".")
    return RENAMED_GROUPS[group] + dot + rest if group in RENAMED_GROUPS else None


def _renamed_problems(keys: list[str], where: str) -> list[str]:
    return [f"trainer key {key} is now {renamed(key)} ({where})" for key in keys if renamed(key)]


def _check(cfg: TrainConfig) -> None:
    """Cross-field and range checks, all collected before raising (choices are Enums: OmegaConf
    checks those, naming the key and the allowed values)."""
    problems = []
    if cfg.model.gpu_memory_gb is not None and cfg.model.gpu_memory_gb <= 0:
        problems.append("model.gpu_memory_gb must be positive (or null)")
    if cfg.precision.init_scale <= 0:
        problems.append("precision.init_scale must be positive")
    if cfg.optim.global_batch <= 0 or cfg.optim.micro_batch <= 0:
        problems.append("optim.global_batch and optim.micro_batch must be positive")
    if cfg.validation.batch_size <= 0:
        problems.append("validation.batch_size must be positive")
    if cfg.validation.max_records is not None and cfg.validation.max_records <= 0:
        problems.append("validation.max_records must be positive (or null: all)")
    if cfg.profile.updates < 0 or cfg.profile.warmup < 0:
        problems.append("profile.updates and profile.warmup must be >= 0")
    for rate in cfg.ema.rates:
        if not 0.0 < rate < 1.0:
            problems.append(f"ema.rates: {rate} is not in (0, 1)")
    if len(set(cfg.ema.rates)) != len(cfg.ema.rates):
        problems.append("ema.rates has duplicates")
    if cfg.ema.every < 1:
        problems.append("ema.every must be >= 1")
    if not 0.0 <= cfg.optim.warmup_fraction < 1.0:
        problems.append("optim.warmup_fraction must be in [0, 1)")
    if cfg.lora.enabled and (cfg.lora.r <= 0 or not cfg.lora.target_modules):
        problems.append("lora.r must be positive and lora.target_modules non-empty")
    if cfg.model.quantization != "none" and not cfg.lora.enabled:
        problems.append(f"model.quantization={cfg.model.quantization} quantizes a frozen base, but lora.enabled=false "
                        "trains every weight (full fine-tuning needs float weights): set model.quantization=none, or "
                        "train LoRA adapters (lora.enabled=true)")
    if cfg.moe.router_aux_loss_coef is not None and not cfg.moe.router_aux_loss_coef >= 0:
        problems.append("moe.router_aux_loss_coef must be >= 0 (or null: the model's own)")
    if cfg.vision.loader_workers < 0:
        problems.append("vision.loader_workers must be >= 0")
    problems += _lora_variant_problems(cfg)
    if (cfg.tokens.train_cache is None) == (not cfg.tokens.mix):
        problems.append("give either tokens.train_cache or tokens.mix (several datasets), not both")
    names = [m.name for m in cfg.tokens.mix]
    if len(set(names)) != len(names):
        problems.append(f"tokens.mix: dataset names repeat ({names})")
    if problems:
        raise UserError("invalid trainer config:\n  " + "\n  ".join(problems))


def _lora_variant_problems(cfg: TrainConfig) -> list[str]:
    """lora.init, lora.use_dora and optim.lora_plus_ratio: what they combine with."""
    problems = []
    if cfg.lora.enabled and cfg.lora.fused and cfg.lora.dropout > 0:
        problems.append(f"lora.fused=true fuses the adapter's matmul into the base layer's output, which needs "
                        f"lora.dropout=0 (it is {cfg.lora.dropout}): set lora.dropout=0 or lora.fused=false")
    if cfg.lora.enabled and (why := init_problem(cfg.lora.init)):
        problems.append(why)
    if cfg.lora.enabled and cfg.lora.use_dora and cfg.distributed.strategy == "fsdp":
        problems.append("lora.use_dora=true with distributed.strategy=fsdp is not supported: DoRA computes its "
                        "magnitude vector from the base weights when the adapter is attached, and FSDP attaches it "
                        "to an empty skeleton before it reads the base (distributed.meta_init; DoRA under FSDP is "
                        "not tested without it either); use distributed.strategy=ddp or lora.use_dora=false")
    ratio = cfg.optim.lora_plus_ratio
    if ratio is not None and not cfg.lora.enabled:
        problems.append("optim.lora_plus_ratio is a LoRA setting, but lora.enabled=false (full fine-tuning): "
                        "set optim.lora_plus_ratio=null")
    elif ratio is not None and not ratio > 0:
        problems.append(f"optim.lora_plus_ratio={ratio} must be positive (or null: off)")
    return problems


def batch_split(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(micro-batch, micro-batches per rank per update) for this world size, derived, never configured.

    Every rank takes global_batch / world_size sequences of each update; they are
    split into the largest micro-batch that divides that share and is at most
    `optim.micro_batch`. So one config runs on 1, 2, 4, ... ranks (the micro-batch
    shrinks where a rank's share is smaller); only a global batch the ranks cannot
    share evenly is an error.
    """
    if cfg.optim.global_batch % world_size:
        raise UserError(
            f"optim.global_batch={cfg.optim.global_batch} cannot be shared by {world_size} ranks: make it a "
            f"multiple of the world size (train.nodes x processes per node), or change the world size "
            f"(optim.micro_batch={cfg.optim.micro_batch} is only an upper bound per forward)"
        )
    share = cfg.optim.global_batch // world_size
    micro = max(d for d in range(1, min(cfg.optim.micro_batch, share) + 1) if share % d == 0)
    return micro, share // micro


def resolve(config_dir: Path, name: str = "config", overrides: list[str] = ()) -> TrainConfig:
    """Compose `config_dir/name.yaml` with Hydra overrides, validate, return typed config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException

    overrides = list(overrides)
    problems = _renamed_problems([_override_key(o) for o in overrides], "an override")
    if problems:  # before Hydra, whose own error would only say the key does not exist
        raise UserError("\n  ".join([f"trainer config overrides {overrides}:", *problems]))
    # The schema sits first in config.yaml's defaults list, so every key exists
    # (plain `key=value` overrides work) and Hydra type-checks each group.
    ConfigStore.instance().store(name=SCHEMA_NAME, node=_compose_schema(TrainConfig))
    config_dir = Path(config_dir).resolve()
    if not (config_dir / f"{name}.yaml").is_file():
        raise UserError(f"trainer config {config_dir / (name + '.yaml')} not found")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = compose(config_name=name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(f"trainer config {config_dir}/{name}.yaml with overrides {overrides}: "
                        f"{_message(err)}") from None
    return to_typed(composed)


def _message(err: BaseException) -> str:
    """An error and its causes, one line each: Hydra's own line ("Error merging override
    precision.mode=fp8") leaves out why, which OmegaConf's cause says, with the allowed values."""
    lines = []
    while err is not None:
        key = getattr(err, "full_key", None)
        text = str(getattr(err, "msg", None) or err).strip().splitlines()
        line = (f"{key}: " if key else "") + (text[0] if text else type(err).__name__)
        if line not in lines:
            lines.append(line)
        err = err.__cause__
    return "; ".join(lines)


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0].strip()


def _compose_schema(cls: type) -> type:
    """`cls` as Hydra composes with it: the same keys and types, but each Switch typed Any. YAML
    reads a bare on / off as a boolean (in a group file, a sweep grid, `key=true`), which an Enum
    node refuses; `to_typed` turns it back into on / off and then checks the Switch."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            kind = _compose_schema(kind)
            fields.append((f.name, kind, field(default_factory=kind)))
            continue
        default = ({"default": f.default} if f.default is not dataclasses.MISSING
                   else {"default_factory": f.default_factory})
        fields.append((f.name, Any if kind is Switch else kind, field(**default)))
    return dataclasses.make_dataclass(cls.__name__, fields)


def _switch_paths(cls: type | None = None, prefix: str = "") -> list[str]:
    """Dotted keys of every Switch setting (model.activation_checkpointing, tokens.packing)."""
    hints = typing.get_type_hints(cls or TrainConfig)
    paths = []
    for name, kind in hints.items():
        if dataclasses.is_dataclass(kind):
            paths += _switch_paths(kind, f"{prefix}{name}.")
        elif kind is Switch:
            paths.append(prefix + name)
    return paths


def _plain(raw: Any) -> dict:
    """A config (DictConfig or dict) as a plain dict, each on / off switch that YAML read as a
    boolean back to on / off; a renamed key is an error that gives its new name."""
    data = OmegaConf.to_container(raw if OmegaConf.is_config(raw) else OmegaConf.create(raw or {}))
    problems = _renamed_problems([f"{group}.{key}" for group in RENAMED_GROUPS if isinstance(data.get(group), dict)
                                  for key in data[group]], "a config file")
    problems += [f"trainer group {group} is now {new}" for group, new in RENAMED_GROUPS.items()
                 if group in data and not isinstance(data[group], dict)]
    if problems:
        raise UserError("invalid trainer config:\n  " + "\n  ".join(problems))
    for path in _switch_paths():
        *parents, key = path.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), bool):
            node[key] = "on" if node[key] else "off"
    return data


def to_typed(raw: Any) -> TrainConfig:
    """Merge a plain/Omega config onto the schema; unknown keys and bad types or choices raise."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), _plain(raw))
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise UserError(f"invalid trainer config: {_message(err)}") from None
    _check(cfg)
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as train_config.yaml holds it (what `load` reads back)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_id(text: str) -> str:
    """The identity of a resolved config: sha256 of its text as `to_yaml` writes it (train_config.yaml).
    What the trained stages depend on, so the workflow keys the plan on it: a comment or an unused
    group file changes nothing, a changed resolved value changes it."""
    return hashlib.sha256(text.encode()).hexdigest()


def load(path: Path) -> TrainConfig:
    """A resolved config (train_config.yaml) as a job uses it: a hub model's `model.path` (its
    model.json or hub id) becomes the cached snapshot dir (`pipeline.storage.hub.model_dir`)."""
    from pipeline.storage.hub import model_dir

    path = Path(path)
    if not path.is_file():
        raise UserError(f"resolved trainer config {path} not found")
    cfg = to_typed(OmegaConf.load(path))
    cfg.model.path = str(model_dir(cfg.model.path))
    return cfg
