"""Training state <-> files: tensors in safetensors, metadata in JSON, nothing pickled.

The writing side. Gathering (CPU copies of live state, done on the training
thread by `pipeline.checkpoint.checkpointer`) is separate from writing (done on
the checkpoint thread, here): `Snapshot` is the hand-over. Reading is
`pipeline.checkpoint.reader`.

Layout of one checkpoint dir (names in `pipeline.layout`):

    adapter/ | model/             trained weights (PEFT dir, or HF weights in full FT)
    ema/<rate>/                   fp32 shadow per EMA rate, same format as above
    dcp/                          FSDP runs only, instead of the three entries around this
                                  one: weights, EMA shadows and optimizer state, sharded
                                  (torch.distributed.checkpoint; see pipeline.train.fsdp)
    training_state/
        optimizer.safetensors     per-parameter state, keys "<param name>::<state key>"
        optimizer.json            param groups (with parameter names), scalar state
        scheduler.json            LR scheduler state_dict
        scaler.json               GradScaler state_dict ({} when disabled)
        progress.json             step, samples and tokens seen, skip counters
        rng_rankNNN.safetensors   torch CPU / CUDA generator states of rank NNN
        rng_rankNNN.json          python and numpy generator states of rank NNN
    config.yaml                   resolved trainer config
    MANIFEST.json                 written last (pipeline.checkpoint.io)
"""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from pipeline import layout
from pipeline.storage import hf_dir

_SEP = "::"


# ----------------------------------------------------------------------------- RNG

def capture_rng() -> dict[str, Any]:
    """This process's generator states: python, numpy, torch CPU, every CUDA device."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        cuda = state["torch_cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # resumed on another GPU count: keep per-device seeds reproducible at least
            torch.cuda.manual_seed_all(int(cuda[0].sum()))


def _write_rng(state: dict[str, Any], root: Path, rank: int) -> None:
    tensors = {"torch_cpu": state["torch_cpu"]}
    for i, t in enumerate(state.get("torch_cuda", [])):
        tensors[f"torch_cuda_{i}"] = t
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32).copy())
    meta = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, int(pos), int(has_gauss), float(cached)],
        "cuda_devices": len(state.get("torch_cuda", [])),
    }
    save_file(tensors, str(root / layout.RNG_TENSORS.format(rank=rank)))
    (root / layout.RNG_META.format(rank=rank)).write_text(json.dumps(meta))


# ----------------------------------------------------------------------- optimizer

def optimizer_state(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """Split `optimizer.state_dict()` into named tensors and JSON metadata.

    `names[i]` is the name of the i-th parameter in param-group order, so the
    state can be matched back by name on load (not by position).
    """
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, per_param in sd["state"].items():
        name = names[idx]
        for key, value in per_param.items():
            if torch.is_tensor(value):
                tensors[f"{name}{_SEP}{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{name}{_SEP}{key}"] = value
    groups = []
    for group in sd["param_groups"]:
        g = {k: v for k, v in group.items() if k != "params"}
        g["params"] = [names[i] for i in group["params"]]
        groups.append(g)
    return tensors, {"param_groups": groups, "scalars": scalars}


# Param-group keys that say how the optimizer computes, not what: chosen for the device of the
# process that built it (`fused` on a GPU, `foreach` on a CPU), and never restored from a checkpoint.
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def keep_implementation(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> list[dict]:
    """`saved_groups` (a checkpoint's param groups, in order) with `optimizer`'s own implementation flags.

    `Optimizer.load_state_dict` takes every key of the saved groups, flags
    included: a run saved on a CPU (foreach) and resumed on a GPU would lose its
    fused kernel, and under fp16 crash, since `GradScaler.step` hands `found_inf`
    to an optimizer built fused (`_step_supports_amp_scaling`) whose groups now
    say otherwise. Hyperparameters (lr, betas, eps, weight decay, ...) are the
    checkpoint's; the flags stay those this process chose. They are set before
    loading, because loading places the `step` counters by them (on the
    parameter's device when fused or capturable).
    """
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"optimizer state has {len(saved_groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    groups = []
    for saved, live in zip(saved_groups, optimizer.param_groups):
        own = {k: live[k] for k in IMPLEMENTATION_KEYS if k in live}
        groups.append({**{k: v for k, v in saved.items() if k not in IMPLEMENTATION_KEYS}, **own})
    return groups


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict, meta: dict) -> None:
    """Restore `optimizer_state()`'s output into `optimizer`, matching parameters by name.

    Its implementation flags stay its own (`keep_implementation`).
    """
    index = {name: i for i, name in enumerate(names)}
    saved = [n for g in meta["param_groups"] for n in g["params"]]
    if sorted(saved) != sorted(names):
        missing, unexpected = set(names) - set(saved), set(saved) - set(names)
        raise ValueError(
            f"optimizer state does not match the trainable parameters "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        name, sub = key.rsplit(_SEP, 1)
        state.setdefault(index[name], {})[sub] = value
    for key, value in meta["scalars"].items():
        name, sub = key.rsplit(_SEP, 1)
        state.setdefault(index[name], {})[sub] = value
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        g["params"] = [index[n] for n in g["params"]]
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": keep_implementation(optimizer, groups)})


# ------------------------------------------------------------------------ snapshot

@dataclass
class TrainedState:
    """The trained part of a checkpoint, as a parallelism strategy captures it.

    Replicated runs: CPU copies of the weights, every EMA shadow and the
    optimizer state, for rank 0 to write (None on the other ranks). FSDP runs:
    `sharded_dir`, a dir all ranks write with DCP (in the background until
    `pending` is done), moved into the checkpoint as dcp/; `progress` adds what
    the restore checks it against.
    """

    weights: dict[str, torch.Tensor] | None = None  # PEFT-format adapter keys, or full model keys
    ema: dict[str, dict[str, torch.Tensor]] | None = None  # ema tag -> same keys as `weights`
    optimizer: tuple[dict, dict] | None = None  # `optimizer_state()`: (tensors, meta)
    sharded_dir: Path | None = None
    pending: Future | None = None  # done when every rank's part of `sharded_dir` is written
    progress: dict = field(default_factory=dict)


@dataclass
class Snapshot:
    """Everything one checkpoint holds, as CPU tensors and plain data."""

    step: int
    trained: TrainedState
    peft_config: Any | None  # peft LoraConfig (LoRA) or None (full fine-tuning)
    model_config_json: str | None  # HF config.json text, full fine-tuning only
    scheduler: dict
    scaler: dict
    progress: dict
    rng: list[dict]  # one per rank
    config_yaml: str
    manifest_extra: dict = field(default_factory=dict)


def write_weights(root: Path, weights: dict, peft_config, model_config_json) -> None:
    """A PEFT adapter dir (LoRA) or HF weights + config.json (full fine-tuning)."""
    root.mkdir(parents=True, exist_ok=True)
    if peft_config is not None:
        peft_config.save_pretrained(str(root))
        save_file(weights, str(root / layout.PEFT_WEIGHTS), metadata=hf_dir.ST_METADATA)
    else:
        save_file(weights, str(root / hf_dir.WEIGHTS_FILE), metadata=hf_dir.ST_METADATA)
        if model_config_json is not None:
            (root / hf_dir.CONFIG_FILE).write_text(model_config_json)


def write_snapshot(snap: Snapshot, root: Path) -> None:
    """Write every file of `snap` into `root` (the caller commits it atomically)."""
    root, trained = Path(root), snap.trained
    if trained.sharded_dir is not None:
        os.replace(trained.sharded_dir, root / layout.DCP_DIR)
        if snap.peft_config is not None:  # marks a LoRA run for the export side
            snap.peft_config.save_pretrained(str(root / layout.DCP_DIR))
    else:
        weights_dir = layout.ADAPTER_DIR if snap.peft_config is not None else layout.MODEL_DIR
        write_weights(root / weights_dir, trained.weights, snap.peft_config, snap.model_config_json)
        for tag, shadow in trained.ema.items():
            write_weights(root / layout.EMA_DIR / tag, shadow, snap.peft_config, snap.model_config_json)
    state = root / layout.TRAINING_STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    if trained.optimizer is not None:
        tensors, meta = trained.optimizer
        save_file(tensors, str(state / layout.OPTIMIZER_TENSORS))
        (state / layout.OPTIMIZER_META).write_text(json.dumps(meta, indent=1))
    (state / layout.SCHEDULER_FILE).write_text(json.dumps(snap.scheduler, indent=1))
    (state / layout.SCALER_FILE).write_text(json.dumps(snap.scaler, indent=1))
    (state / layout.PROGRESS_FILE).write_text(json.dumps(snap.progress, indent=1))
    for rank, rng in enumerate(snap.rng):
        _write_rng(rng, state, rank)
    (root / layout.CHECKPOINT_CONFIG_FILE).write_text(snap.config_yaml)
