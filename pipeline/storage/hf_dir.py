"""Hugging Face model directories: finding their weights, writing them shard by shard.

A model dir holds either one `model.safetensors` or several shards plus
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file). The
other top-level files a Hugging Face model is made of (config, generation
config, tokenizer, chat template; the allow-list `HF_FILE`) are "non-weight
files" and travel unchanged, except that `config.json`'s `dtype` is kept
truthful when the weights change dtype.

Only safetensors weights are read: pickled `.bin` checkpoints can run code on
load and are refused.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes
from pipeline.storage.safetensors_stream import StreamingWriter, TensorSpec, read_specs

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
ST_METADATA = {"format": "pt"}  # transformers checks this marker when loading

# Files that are weights in some format; never copied as "non-weight" files.
WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|npz)$|.*\.safetensors\.index\.json$")

# (name, tensor) pairs in the order asked for; sources may batch reads internally.
TensorFetcher = Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class WeightFiles:
    """The safetensors weights of one model dir."""

    root: Path
    specs: dict[str, list[TensorSpec]]  # shard file name -> its tensors (header order)
    index: dict | None  # parsed index json; None for a single-file model

    @property
    def all_specs(self) -> dict[str, TensorSpec]:
        return {spec.name: spec for specs in self.specs.values() for spec in specs}


def find_weights(root: Path | str, label: str) -> WeightFiles:
    """Locate and read the headers of a model dir's safetensors weights.

    Raises UserError when the dir has no safetensors weights, or when the index
    names a missing shard or disagrees with the shards' headers.
    """
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{label} {root} is not a directory")
    index_path = root / WEIGHTS_INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index_path}: no weight_map")
        files = sorted(set(weight_map.values()))
        specs = {}
        for name in files:
            if not (root / name).is_file():
                raise UserError(f"{index_path} names {name}, which does not exist")
            specs[name] = read_specs(root / name)
            listed = {key for key, file in weight_map.items() if file == name}
            found = {spec.name for spec in specs[name]}
            if listed != found:
                raise UserError(f"{root / name}: tensors disagree with {WEIGHTS_INDEX} ({len(listed ^ found)} differ)")
        return WeightFiles(root, specs, index)
    if (root / WEIGHTS_FILE).is_file():
        return WeightFiles(root, {WEIGHTS_FILE: read_specs(root / WEIGHTS_FILE)}, None)
    raise UserError(f"{label} {root} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX} (only safetensors weights are supported)")


def read_config(root: Path | str) -> dict:
    path = Path(root) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{root} has no {CONFIG_FILE}")
    return json.loads(path.read_text())


def refuse_quantized(config: dict, label: str) -> None:
    """Weights of a quantized base are codes, not numbers; adding a delta to them is wrong. (MXFP4 and FP8, which
    `pipeline.storage.packed` reads as numbers, is not passed here.)"""
    if config.get("quantization_config"):
        raise UserError(f"{label} is quantized ({config['quantization_config'].get('quant_method', '?')}); "
                        "merge into the unquantized base instead")


def set_config_unquantized(root: Path | str) -> None:
    """Drop config.json's `quantization_config`: the weights written are numbers (a merged MXFP4 or FP8 base)."""
    path = Path(root) / CONFIG_FILE
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# The non-weight files a Hugging Face model dir is made of, by name: an allow-list, not a deny-list.
# A base dir holds other things too (its README, i.e. the base's model card, which would describe
# the wrong model; the demo's pretrain_report.json; evaluation dumps, images, notebooks of a hub
# repository), and a deny-list would have to know every one of them; what is not listed here is
# not read by transformers/peft/vLLM/TGI, so dropping it loses nothing a loader needs. Kept:
# configs (model, generation, processor, image/video/feature processors: `*config*.json`), the
# tokenizer in every format, chat templates, remote code (`*.py`, for trust_remote_code), and the
# base's licence and use-policy files (a derived model is still under them).
HF_FILE = re.compile(
    r"(.*config.*\.json|special_tokens_map\.json|added_tokens\.json|tokenizer.*|vocab.*|merges\.txt"
    r"|.*\.model|.*\.tiktoken|chat_template.*\.(jinja|json)|.*\.py"
    r"|(LICEN[CS]E|NOTICE|USE_POLICY|COPYING)(\..*|-.*)?)",
    re.IGNORECASE,
)


def is_hf_file(name: str) -> bool:
    """Whether a top-level non-weight file of a model dir is one `copy_non_weight_files` carries."""
    return not name.startswith(".") and not WEIGHT_FILE.fullmatch(name) and bool(HF_FILE.fullmatch(name))


def copy_non_weight_files(src: Path | str, dst: Path | str) -> list[str]:
    """Copy the top-level non-weight files of a model dir that belong to a Hugging Face model
    (`HF_FILE`: config, generation config, tokenizer, chat template, processor, remote code, licence).

    Subdirectories and hidden files are skipped: they are caches or alternative
    weight formats (e.g. `original/`), not part of the Hugging Face model. Other
    files (the base's README, reports like the demo's `pretrain_report.json`) stay behind.
    """
    copied = []
    for path in sorted(Path(src).iterdir()):
        if not path.is_file() or not is_hf_file(path.name):
            continue
        shutil.copy2(path, Path(dst) / path.name)
        copied.append(path.name)
    return copied


def set_config_dtype(root: Path | str, dtype: torch.dtype | None) -> None:
    """Make config.json's dtype field match the weights actually written."""
    path = Path(root) / CONFIG_FILE
    if dtype is None or not path.is_file():
        return
    config = json.loads(path.read_text())
    name = dtypes.config_name(dtype)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    if all(config.get(k) == name for k in keys):
        return
    for key in keys:
        config[key] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def set_config_vocab(root: Path | str, rows: int) -> None:
    """Make config.json's `vocab_size` (a vision-language model's text config's) match grown
    embeddings, so `from_pretrained` builds them at the size the weights have."""
    path = Path(root) / CONFIG_FILE
    config = json.loads(path.read_text())
    holder = config["text_config"] if "vocab_size" not in config and isinstance(config.get("text_config"), dict) \
        else config
    if holder.get("vocab_size") == rows:
        return
    holder["vocab_size"] = rows
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000' -> bytes (decimal units, like transformers)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise UserError(f"cannot parse size {text!r}; write e.g. 5GB or 500MB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(number * scale)


def plan_shards(specs: Iterable[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors, in order, into shards of at most `max_bytes` (a bigger tensor gets its own)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (size + spec.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_index(root: Path | str, shards: dict[str, list[TensorSpec]], extra_metadata: dict | None = None) -> None:
    """Write model.safetensors.index.json for the given shard file -> tensors."""
    specs = [spec for file_specs in shards.values() for spec in file_specs]
    metadata = dict(extra_metadata or {})
    metadata["total_size"] = sum(spec.nbytes for spec in specs)
    metadata["total_parameters"] = sum(spec.numel for spec in specs)
    weight_map = {spec.name: file for file, file_specs in shards.items() for spec in file_specs}
    payload = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (Path(root) / WEIGHTS_INDEX).write_text(json.dumps(payload, indent=2) + "\n")


def cast_checked(tensor: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """Cast, refusing a result with inf/nan (e.g. fp32 values beyond the fp16 range).

    A tensor already in `dtype` is returned as is: the cast can only break a
    value that changes, and skipping the scan saves a pass over big tensors.
    """
    if tensor.dtype == dtype:
        return tensor
    if not dtypes.fits(tensor, dtype):
        raise UserError(f"{name}: values that are not finite in {dtype} (casting from {tensor.dtype})")
    return tensor.to(dtype)


def write_model(
    dst: Path | str,
    specs: list[TensorSpec],
    fetch: TensorFetcher,
    *,
    max_shard_bytes: int,
) -> dict[str, list[TensorSpec]]:
    """Write tensors as HF shards (+ index when more than one), one tensor in memory at a time.

    `specs` gives the output name, dtype and shape of each tensor in file order;
    `fetch(names)` yields the source tensors, which are cast to the spec dtype
    (checked finite). Returns shard file -> specs.
    """
    groups = plan_shards(specs, max_shard_bytes)
    names = [WEIGHTS_FILE] if len(groups) == 1 else [
        SHARD_NAME.format(index=i + 1, count=len(groups)) for i in range(len(groups))
    ]
    shards = dict(zip(names, groups))
    for file, group in shards.items():
        wanted = {spec.name: spec for spec in group}
        with StreamingWriter(Path(dst) / file, group, ST_METADATA) as writer:
            for name, tensor in fetch([spec.name for spec in group]):
                spec = wanted[name]
                if tuple(tensor.shape) != spec.shape:
                    raise UserError(f"{name}: shape {tuple(tensor.shape)} differs from the expected {spec.shape}")
                writer.write(name, cast_checked(tensor, spec.dtype, name))
    if len(shards) > 1:
        write_index(dst, shards)
    return shards
