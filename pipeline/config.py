"""The trainer's one typed config: Hydra structured configs (dataclasses).

`config/train/` holds one YAML group per dataclass below (model, lora, vision,
ema, optim, precision, distributed, checkpoint, eval, alerts, data); `resolve()`
composes them with the user's overrides through Hydra's compose API and merges
the result onto these dataclasses, so an unknown key or a wrong type is an
error that names the key. The resolved config
is written once by the `plan` rule and read back by every stage (and saved in
every checkpoint), so all stages of a run train with the same settings.

We use the compose API rather than `@hydra.main` on purpose: under torchrun
every rank would otherwise create its own timestamped output dir and log file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.errors import UserError

SCHEMA_NAME = "train_schema"
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelConfig:
    path: str = MISSING  # local Hugging Face dir or hub id
    dtype: str = "auto"  # weights dtype when loading: auto | fp32 | bf16 | fp16
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class LoraConfig:
    enabled: bool = True  # false = full fine-tuning
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: list(LLAMA_TARGETS))
    use_rslora: bool = False


@dataclass
class VisionConfig:
    # Vision-language models only (an image-text-to-text model, detected from its config);
    # a text-only model with a setting changed here is an error. The language model is
    # trained as `lora` says (LoRA adapters or in full); these say what else is trained.
    train_projector: bool = False  # the vision-to-text projector, in full (under LoRA: PEFT modules_to_save)
    train_tower: bool = False  # the vision encoder too (under LoRA: adapters on its lora.target_modules)
    loader_workers: int = 2  # DataLoader processes that decode images into pixels ahead of the step


@dataclass
class EmaConfig:
    rates: list[float] = field(default_factory=lambda: [0.999, 0.9999])  # [] disables EMA
    every: int = 1  # update every k optimizer steps with beta**k


@dataclass
class OptimConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_fraction: float = 0.03  # of the whole run, not of a stage
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # 0 disables clipping
    global_batch: int = 32  # sequences per optimizer update, all ranks together
    micro_batch: int = 8  # sequences per forward on one rank


@dataclass
class PrecisionConfig:
    mode: str = "auto"  # auto | bf16 | fp16 | fp32 (auto: bf16 if supported, else fp16; fp32 on CPU)
    max_consecutive_nonfinite: int = 8  # abort (after a checkpoint) when this many updates in a row are skipped


@dataclass
class DistributedConfig:
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    strategy: str = "ddp"  # ddp | fsdp
    timeout_s: int = 1800


@dataclass
class CheckpointConfig:
    save_every: int = 50  # intra-stage checkpoint every N updates (0: only at stage end)
    keep_last: int = 2
    async_save: bool = True


@dataclass
class EvalConfig:
    quick_every: int = 0  # quick EMA eval every N updates inside a stage (0: off)
    quick_batches: int = 4
    eval_every: int = 0  # full eval (best-weights tracking) every N updates of the run; always after the last
    micro_batch: int = 16


@dataclass
class AlertConfig:
    tps_drop_fraction: float = 0.5  # alert when tokens/s < this x running median
    loss_spike_sigma: float = 6.0  # alert when loss > mean + k sigma of recent steps
    window: int = 50


@dataclass
class DataConfig:
    # Token caches (safetensors) the tokenize rule writes and the workflow fills in. (The
    # workflow's own `data.train` / `data.val` are the dataset files they are made from.)
    train_cache: str = MISSING
    val_cache: str | None = None


@dataclass
class TrainConfig:
    seed: int = 0
    log_every: int = 1
    tensorboard: bool = False  # also write the metrics as TensorBoard scalars (needs `pip install tensorboard`)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    alerts: AlertConfig = field(default_factory=AlertConfig)
    data: DataConfig = field(default_factory=DataConfig)


def _check(cfg: TrainConfig) -> None:
    """Cross-field checks, all collected before raising."""
    problems = []
    if cfg.optim.global_batch <= 0 or cfg.optim.micro_batch <= 0:
        problems.append("optim.global_batch and optim.micro_batch must be positive")
    if cfg.precision.mode not in ("auto", "bf16", "fp16", "fp32"):
        problems.append(f"precision.mode={cfg.precision.mode!r}: expected auto | bf16 | fp16 | fp32")
    if cfg.model.dtype not in ("auto", "bf16", "fp16", "fp32"):
        problems.append(f"model.dtype={cfg.model.dtype!r}: expected auto | bf16 | fp16 | fp32")
    if cfg.distributed.strategy not in ("ddp", "fsdp"):
        problems.append(f"distributed.strategy={cfg.distributed.strategy!r}: expected ddp | fsdp")
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
    if cfg.vision.loader_workers < 0:
        problems.append("vision.loader_workers must be >= 0")
    if problems:
        raise UserError("invalid trainer config:\n  " + "\n  ".join(problems))


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per rank per update, derived (never configured)."""
    per_step = cfg.optim.micro_batch * world_size
    if cfg.optim.global_batch % per_step:
        raise UserError(
            f"optim.global_batch={cfg.optim.global_batch} is not divisible by "
            f"optim.micro_batch={cfg.optim.micro_batch} x world size {world_size}"
        )
    return cfg.optim.global_batch // per_step


def resolve(config_dir: Path, name: str = "config", overrides: list[str] = ()) -> TrainConfig:
    """Compose `config_dir/name.yaml` with Hydra overrides, validate, return typed config."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from hydra.core.config_store import ConfigStore

    # The schema sits first in config.yaml's defaults list, so every key exists
    # (plain `key=value` overrides work) and Hydra type-checks each group.
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
    config_dir = Path(config_dir).resolve()
    if not (config_dir / f"{name}.yaml").is_file():
        raise UserError(f"trainer config {config_dir / (name + '.yaml')} not found")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            composed = compose(config_name=name, overrides=list(overrides))
        return to_typed(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise UserError(f"trainer config {config_dir}/{name}.yaml with overrides {list(overrides)}: {err}") from None


def to_typed(raw: Any) -> TrainConfig:
    """Merge a plain/Omega config onto the schema; unknown keys and bad types raise."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), raw)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        raise UserError(f"invalid trainer config: {err}") from None
    _check(cfg)
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as train_config.yaml holds it (what `load` reads back)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load(path: Path) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"resolved trainer config {path} not found")
    return to_typed(OmegaConf.load(path))
