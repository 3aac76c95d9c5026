"""The one reader of checkpoints: restore, evaluation, the pilot gate and export all use it.

A checkpoint dir `<ckpt>/` (names in `pipeline.layout`, written by
`pipeline.checkpoint.state`) holds its trained weights in one of two formats,
detected in this order (`--format` forces one):

hf
    `adapter/` (PEFT dir) in LoRA runs or `model/` (HF safetensors, single file
    or sharded + index) in full fine-tuning; EMA shadows in `ema/<tag>/` in the
    same format as the main weights.
dcp
    `dcp/`, a `torch.distributed.checkpoint` dir written by an FSDP run with
    `dcp.save({"model": {name: t}, "ema": {tag: {name: t}}, "optim": ...}, checkpoint_id=<ckpt>/dcp)`.
    DCP flattens this to the keys `model.<name>` and `ema.<tag>.<name>`
    (`layout.DCP_MODEL_PREFIX`, `layout.DCP_EMA_PREFIX`); a flat dict with
    those keys is equivalent. Values may be DTensors (FSDP2 shards) or plain
    tensors. `<name>` is the PEFT adapter key in LoRA runs
    (`base_model.model.<module>.lora_A.weight`, what
    `peft.get_peft_model_state_dict` returns; an adapter-name segment such as
    `lora_A.default.weight` is also accepted and dropped) and the HF
    checkpoint key in full fine-tuning (`model.layers.0.mlp.up_proj.weight`).
    A LoRA run also writes its `adapter_config.json` into `dcp/`; its absence
    means full fine-tuning. The trainer restores a dcp/ checkpoint shard by
    shard into its live state (`Checkpoint.dcp_dir`); everyone else reads it
    here, unsharded, a batch of tensors at a time.

Besides the weights: `training_state(rank)` (optimizer, scheduler, scaler,
progress, this rank's RNG), `progress` and the resolved trainer `config.yaml`.

A checkpoint dir counts only when `MANIFEST.json` is present (the trainer
writes it last); `verify=True` also checks every file against its sha256.
Tensors are loaded lazily, a batch at a time, so exporting a model costs
about one output shard of memory, not the whole model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import load_file

from pipeline import layout
from pipeline.checkpoint import io as ckpt_io
from pipeline.errors import UserError
from pipeline.storage import hf_dir
from pipeline.storage.safetensors_stream import TensorSpec, read_specs, read_tensor

FORMATS = ("auto", "hf", "dcp")
_DCP_BATCH_BYTES = 512 * 2**20  # one dcp.load call per ~512 MB: few calls, bounded memory
_ADAPTER_NAME_SEGMENT = re.compile(r"\.(lora_A|lora_B)\.[^.]+\.weight$|\.(lora_embedding_[AB])\.[^.]+$")
_EMA_KEY = re.compile(r"ema\.(?P<tag>\d+(?:\.\d+)?(?:e-?\d+)?)\.(?P<name>.+)")


@dataclass
class TrainedWeights:
    """One set of trained tensors (the main weights, or one EMA rate).

    `specs` maps each (normalized) tensor name to its stored dtype and shape;
    `fetch(names)` yields `(name, tensor)` for the names asked, in that order.
    """

    label: str
    specs: dict[str, TensorSpec]
    _loader: object = field(repr=False)

    def fetch(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        unknown = [n for n in names if n not in self.specs]
        if unknown:
            raise KeyError(f"{self.label} has no tensor {unknown[0]!r}")
        return self._loader(names)

    def all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the set (small sets: an adapter, a shadow of one)."""
        return dict(self.fetch(sorted(self.specs)))


@dataclass
class Checkpoint:
    """A complete checkpoint: its format, run kind, PEFT config, weight sets and loop state."""

    path: Path
    format: str  # "hf" | "dcp"
    kind: str  # "lora" | "full"
    peft_config: dict | None
    main: TrainedWeights
    ema: dict[str, TrainedWeights]  # tag -> weights

    @property
    def sharded(self) -> bool:
        """Written by an FSDP run: weights, EMA shadows and optimizer state are DCP shards."""
        return self.format == "dcp"

    @property
    def dcp_dir(self) -> Path:
        return self.path / layout.DCP_DIR

    @property
    def config_path(self) -> Path:
        """The resolved trainer config the run trained with."""
        return self.path / layout.CHECKPOINT_CONFIG_FILE

    @property
    def progress(self) -> dict:
        """step, stage, samples and tokens seen, skip counters, the run's best evals."""
        return json.loads((self.path / layout.TRAINING_STATE_DIR / layout.PROGRESS_FILE).read_text())

    def training_state(self, rank: int) -> dict:
        """training_state/, with this rank's RNG (None for a rank the run did not have).

        The optimizer entries are None in a sharded checkpoint (its state is in dcp/).
        """
        state = self.path / layout.TRAINING_STATE_DIR
        rng_rank = rank if (state / layout.RNG_META.format(rank=rank)).is_file() else None
        unsharded = (state / layout.OPTIMIZER_TENSORS).is_file()
        return {
            "optimizer_tensors": load_file(str(state / layout.OPTIMIZER_TENSORS)) if unsharded else None,
            "optimizer_meta": json.loads((state / layout.OPTIMIZER_META).read_text()) if unsharded else None,
            "scheduler": json.loads((state / layout.SCHEDULER_FILE).read_text()),
            "scaler": json.loads((state / layout.SCALER_FILE).read_text()),
            "progress": self.progress,
            "rng": _read_rng(state, rng_rank) if rng_rank is not None else None,
        }


def open_checkpoint(path: Path | str, fmt: str = "auto", *, verify: bool = False) -> Checkpoint:
    """Detect the format of `path` and index its weights (headers / metadata only).

    `verify`: also check every file against the MANIFEST's sha256 (reads them all).
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {path} does not exist")
    if verify:
        ok, reason = ckpt_io.verify(path)
        if not ok:
            raise UserError(f"checkpoint {path} is not usable: {reason}")
    elif not (path / layout.MANIFEST_FILE).is_file():
        raise UserError(f"checkpoint {path} has no {layout.MANIFEST_FILE}: incomplete or not a checkpoint")
    present = {
        "hf": (path / layout.ADAPTER_DIR).is_dir() or (path / layout.MODEL_DIR).is_dir(),
        "dcp": (path / layout.DCP_DIR / ".metadata").is_file(),
    }
    if fmt == "auto":
        fmt = next((name for name, found in present.items() if found), "")
        if not fmt:
            raise UserError(f"checkpoint {path}: no {layout.ADAPTER_DIR}/, {layout.MODEL_DIR}/ or {layout.DCP_DIR}/ found")
    elif fmt not in present:
        raise UserError(f"unknown checkpoint format {fmt!r}; choose one of {', '.join(FORMATS)}")
    elif not present[fmt]:
        raise UserError(f"checkpoint {path} has no weights in the {fmt} format")
    return {"hf": _open_hf, "dcp": _open_dcp}[fmt](path)


# --- hf: adapter/ or model/, ema/<tag>/ -----------------------------------------------------


def _open_hf(path: Path) -> Checkpoint:
    lora = (path / layout.ADAPTER_DIR).is_dir()
    if lora and (path / layout.MODEL_DIR).is_dir():
        raise UserError(f"checkpoint {path} has both {layout.ADAPTER_DIR}/ and {layout.MODEL_DIR}/")
    main_dir = path / (layout.ADAPTER_DIR if lora else layout.MODEL_DIR)
    read = _hf_adapter_weights if lora else _hf_model_weights
    ema = {}
    if (path / layout.EMA_DIR).is_dir():
        for sub in sorted((path / layout.EMA_DIR).iterdir()):
            if sub.is_dir() and not sub.name.startswith("."):
                ema[sub.name] = read(sub, f"ema {sub.name}")
    config = _read_json(main_dir / layout.PEFT_CONFIG) if lora else None
    return Checkpoint(path, "hf", "lora" if lora else "full", config, read(main_dir, "main weights"), ema)


def _hf_adapter_weights(root: Path, label: str) -> TrainedWeights:
    file = root / layout.PEFT_WEIGHTS
    if not file.is_file():
        raise UserError(f"{root} has no {layout.PEFT_WEIGHTS}")
    specs = {spec.name: spec for spec in read_specs(file)}
    return TrainedWeights(label, specs, lambda names: _read_safetensors({n: file for n in names}, names))


def _hf_model_weights(root: Path, label: str) -> TrainedWeights:
    weights = hf_dir.find_weights(root, label)
    where = {spec.name: root / file for file, specs in weights.specs.items() for spec in specs}
    return TrainedWeights(label, weights.all_specs, lambda names: _read_safetensors(where, names))


def _read_safetensors(where: dict[str, Path], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        yield name, read_tensor(where[name], name)


# --- dcp: <ckpt>/dcp/ ------------------------------------------------------------------------


def _open_dcp(path: Path) -> Checkpoint:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root = path / layout.DCP_DIR
    metadata = FileSystemReader(str(root)).read_metadata()
    # planner_data keeps each flat key's path in the nested dict: ("ema", "0.999", name).
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    groups: dict[str | None, dict[str, tuple[str, TensorSpec]]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue  # non-tensor entries (e.g. a saved step counter) are not weights
        which, name = _split_dcp_key(key, paths.get(key))
        if which is False:
            continue
        spec = TensorSpec(_normalize_name(name), meta.properties.dtype, tuple(meta.size))
        groups.setdefault(which, {})[spec.name] = (key, spec)
    if None not in groups:
        raise UserError(f"{root} has no '{layout.DCP_MODEL_PREFIX}*' tensors")
    config_path = root / layout.PEFT_CONFIG
    config = _read_json(config_path) if config_path.is_file() else None

    def weights(which: str | None) -> TrainedWeights:
        entries = groups[which]
        label = "main weights" if which is None else f"ema {which}"
        specs = {name: spec for name, (_, spec) in entries.items()}
        return TrainedWeights(label, specs, lambda names: _read_dcp(root, entries, names))

    ema = {tag: weights(tag) for tag in sorted(t for t in groups if t is not None)}
    return Checkpoint(path, "dcp", "lora" if config else "full", config, weights(None), ema)


def _split_dcp_key(key: str, nested: tuple | None) -> tuple[str | None | bool, str]:
    """('main' as None | ema tag | False for foreign keys, tensor name) of one DCP key."""
    if nested and len(nested) >= 2 and nested[0] == "model":
        return None, ".".join(map(str, nested[1:]))
    if nested and len(nested) >= 3 and nested[0] == "ema":
        return str(nested[1]), ".".join(map(str, nested[2:]))
    if key.startswith(layout.DCP_MODEL_PREFIX):
        return None, key[len(layout.DCP_MODEL_PREFIX):]
    match = _EMA_KEY.fullmatch(key) if key.startswith(layout.DCP_EMA_PREFIX) else None
    if match:
        return match["tag"], match["name"]
    return False, key


def _read_dcp(root: Path, entries: dict[str, tuple[str, TensorSpec]], names: list[str]):
    import torch.distributed.checkpoint as dcp

    batch: list[str] = []
    size = 0
    for i, name in enumerate(names):
        batch.append(name)
        size += entries[name][1].nbytes
        if size >= _DCP_BATCH_BYTES or i == len(names) - 1:
            # dcp.load fills preallocated plain tensors, assembling each from every rank's shards;
            # with no process group it runs single-process.
            state = {entries[n][0]: torch.empty(entries[n][1].shape, dtype=entries[n][1].dtype) for n in batch}
            dcp.load(state, checkpoint_id=str(root))
            for n in batch:
                yield n, state.pop(entries[n][0])
            batch, size = [], 0


# --- shared -----------------------------------------------------------------------------------


def _normalize_name(name: str) -> str:
    # `model.state_dict()` of a PeftModel names LoRA tensors with the adapter name
    # (`lora_A.default.weight`); saved PEFT files drop it. Accept both.
    return _ADAPTER_NAME_SEGMENT.sub(lambda m: f".{m[1]}.weight" if m[1] else f".{m[2]}", name)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None


def _read_rng(root: Path, rank: int) -> dict[str, Any]:
    """Generator states of one rank, as `pipeline.checkpoint.state.capture_rng` returns them."""
    tensors = load_file(str(root / layout.RNG_TENSORS.format(rank=rank)))
    meta = json.loads((root / layout.RNG_META.format(rank=rank)).read_text())
    version, internal, gauss = meta["python"]
    kind, pos, has_gauss, cached = meta["numpy"]
    keys = tensors["numpy_keys"].numpy().view(np.uint32)
    state = {
        "python": (version, tuple(internal), gauss),
        "numpy": (kind, keys, pos, has_gauss, cached),
        "torch_cpu": tensors["torch_cpu"],
    }
    if meta["cuda_devices"]:
        state["torch_cuda"] = [tensors[f"torch_cuda_{i}"] for i in range(meta["cuda_devices"])]
    return state
