"""`python -m pipeline consolidate`: a final checkpoint -> Hugging Face dirs.

    python -m pipeline consolidate --checkpoint CKPT --base BASE
        [--out-adapter DIR] [--out-adapter-ema DIR]     # LoRA runs
        [--out-model DIR] [--out-model-ema DIR]         # full fine-tuning
        [--ema-rate RATE] [--all-ema-dir DIR] [--models main|ema|both]
        [--dtype auto|bf16|fp16|fp32] [--max-shard-size 5GB]
        [--format auto|hf|dcp] [--tokenizer DIR] [--overwrite]

The checkpoint's format (HF dirs, or the DCP shards of an FSDP run) is
detected by `pipeline.checkpoint.reader`, which also documents the DCP layout
the trainer writes. What is written:

* LoRA run: `--out-adapter` (main weights) and `--out-adapter-ema` (EMA rate
  `--ema-rate`; optional when the run has a single rate) as stock PEFT dirs
  (`adapter_config.json` with `base_model_name_or_path` set to `--base`,
  `adapter_model.safetensors`), loadable with
  `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), dir)`
  (`AutoModelForImageTextToText` for a vision-language base; a projector trained
  in full is in the same dir as PEFT `modules_to_save`).
* full fine-tuning: `--out-model` / `--out-model-ema` as HF model dirs
  (`model.safetensors`, or `model-0000i-of-0000n.safetensors` +
  `model.safetensors.index.json` beyond `--max-shard-size`) with every
  non-weight file of `--base` (config, tokenizer, processor, generation
  config). The tensor names and key layout are the base's (`BaseKeys`): tied
  weights the base does not store (e.g. `lm_head.weight` tied to the
  embeddings) are written once, as in the base; tensors training kept frozen
  (a vision-language model's vision tower) are copied from it; weights the
  base stores as rows of one tensor (HRM's `gqkv_proj`: gate, q, k, v) are
  put back into those rows (`BaseKeys.rows`).
* `--all-ema-dir DIR`: every EMA rate as `DIR/<tag>/`, same format.
* `--tokenizer DIR`: the run's tokenizer (`results/<run>/tokenizer`): every dir
  written carries its files in place of the base's (`pipeline.export.tokenizer`),
  so `apply_chat_template` on it renders what training rendered. With tokens it
  added, an adapter holds their trained rows (peft trainable tokens): load it on
  the base after `model.resize_token_embeddings(len(tokenizer))` with the
  tokenizer from the adapter dir; a full model dir has the grown embeddings
  and `vocab_size`.

`--models` picks main, EMA or both (default); each picked set needs its output
flag. `--dtype` casts floating tensors (auto: as stored). Tensors missing from
an EMA shadow (frozen parameters, buffers) are taken from the main weights.
All outputs are checked (not inside `--base` or `--checkpoint`, not
overlapping, empty or `--overwrite`) before anything is written; each output
appears atomically when complete. `--card-*`: a model card (`README.md`) in each
(`pipeline.export.card`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Iterator

import torch

from pipeline import layout
from pipeline.errors import UserError
from pipeline.export import lora_math
from pipeline.export.card import add_card_args, write_cards
from pipeline.model.base_keys import BaseKeys, tied_aliases
from pipeline.storage import dtypes, hf_dir, packed as stored_packed
from pipeline.storage.hub import model_dir
from pipeline.checkpoint.reader import FORMATS, Checkpoint, TrainedWeights, open_checkpoint
from pipeline.export.outputs import check_replaceable, refuse_overlaps, staged_dir
from pipeline.export.tokenizer import carry_tokenizer, vocab_rows
from pipeline.storage.safetensors_stream import StreamingWriter, TensorSpec, read_tensor

log = logging.getLogger(__name__)


def consolidate(
    checkpoint: Path | str,
    base: Path | str,
    *,
    out_adapter: Path | str | None = None,
    out_adapter_ema: Path | str | None = None,
    out_model: Path | str | None = None,
    out_model_ema: Path | str | None = None,
    ema_rate: str | None = None,
    all_ema_dir: Path | str | None = None,
    models: str = "both",
    dtype: str = "auto",
    max_shard_size: str = "5GB",
    fmt: str = "auto",
    tokenizer: Path | str | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Export the requested weight sets; returns the dirs written. See the module docstring."""
    base = Path(base)
    requested = dtypes.parse_cli(dtype)
    max_bytes = hf_dir.parse_size(max_shard_size)
    if models not in ("main", "ema", "both"):
        raise UserError(f"--models must be main, ema or both, not {models!r}")
    outputs = {"--out-adapter": out_adapter, "--out-adapter-ema": out_adapter_ema, "--out-model": out_model,
               "--out-model-ema": out_model_ema, "--all-ema-dir": all_ema_dir}
    checkpoint = Path(checkpoint)
    refuse_overlaps(outputs, {"--base": base, "--checkpoint": checkpoint})
    if not base.is_dir():
        raise UserError(f"--base {base} is not a directory")
    ckpt = open_checkpoint(checkpoint, fmt, verify=True)  # a damaged file is named, never exported
    jobs, all_ema = _plan_jobs(ckpt, outputs, models, ema_rate)
    for label, out, _ in jobs:
        check_replaceable(out, overwrite=overwrite, label=label)
    if all_ema:
        check_replaceable(all_ema_dir, overwrite=overwrite, label="--all-ema-dir")

    def export(weights: TrainedWeights, out: Path, replace: bool) -> None:
        with staged_dir(out, overwrite=replace) as stage:
            if ckpt.kind == "lora":
                _write_adapter(stage, weights, ckpt.peft_config, base, requested)
            else:
                _write_model(stage, weights, ckpt.main, base, requested, max_bytes, vocab_rows(tokenizer))
            if tokenizer is not None:
                carry_tokenizer(stage, tokenizer, base)
        log.info("wrote %s (%s checkpoint) -> %s", weights.label, ckpt.format, out)

    written = []
    for _, out, weights in jobs:
        export(weights, Path(out), overwrite)
        written.append(Path(out))
    if all_ema:
        # One staged parent: DIR/ appears with every rate in it, or not at all.
        with staged_dir(all_ema_dir, overwrite=overwrite, label="--all-ema-dir") as stage:
            for tag, weights in all_ema.items():
                export(weights, stage / tag, False)
        written.append(Path(all_ema_dir))
    return written


def _plan_jobs(ckpt: Checkpoint, outputs: dict, models: str, ema_rate: str | None):
    """([(flag, out dir, weights)], {tag: weights} for --all-ema-dir); refuses flags that do not fit."""
    lora = ckpt.kind == "lora"
    main_flag, ema_flag = ("--out-adapter", "--out-adapter-ema") if lora else ("--out-model", "--out-model-ema")
    wrong = [f for f in (("--out-model", "--out-model-ema") if lora else ("--out-adapter", "--out-adapter-ema"))
             if outputs[f] is not None]
    if wrong:
        kind = "a LoRA run" if lora else "a full fine-tuning run"
        raise UserError(f"{ckpt.path} is {kind}; {', '.join(wrong)} does not apply (use {main_flag}/{ema_flag})")
    want_main, want_ema = models in ("main", "both"), models in ("ema", "both")
    jobs = []
    if want_main:
        if outputs[main_flag] is None:
            raise UserError(f"--models {models} needs {main_flag}")
        jobs.append((main_flag, outputs[main_flag], ckpt.main))
    elif outputs[main_flag] is not None:
        raise UserError(f"{main_flag} given but --models {models} excludes the main weights")
    if not want_ema:
        if outputs[ema_flag] is not None or outputs["--all-ema-dir"] is not None:
            raise UserError(f"EMA outputs given but --models {models} excludes EMA weights")
        return jobs, {}
    if not ckpt.ema:
        raise UserError(f"{ckpt.path} has no EMA weights; use --models main")
    if outputs[ema_flag] is None and outputs["--all-ema-dir"] is None:
        raise UserError(f"--models {models} needs {ema_flag} (or --all-ema-dir)")
    if outputs[ema_flag] is not None:
        jobs.append((ema_flag, outputs[ema_flag], ckpt.ema[_pick_tag(ckpt, ema_rate)]))
    return jobs, (dict(ckpt.ema) if outputs["--all-ema-dir"] is not None else {})


def _pick_tag(ckpt: Checkpoint, ema_rate: str | None) -> str:
    if ema_rate is None:
        if len(ckpt.ema) == 1:
            return next(iter(ckpt.ema))
        raise UserError(f"the checkpoint has EMA rates {', '.join(ckpt.ema)}; choose one with --ema-rate")
    try:
        tag = layout.ema_tag(float(ema_rate))
    except ValueError:
        tag = ema_rate
    if tag not in ckpt.ema:
        raise UserError(f"--ema-rate {ema_rate}: the checkpoint has EMA rates {', '.join(ckpt.ema) or 'none'}")
    return tag


def _write_adapter(dst: Path, weights: TrainedWeights, peft_config: dict | None, base: Path, requested) -> None:
    if not peft_config:
        raise UserError("LoRA checkpoint without adapter_config.json")
    names = sorted(weights.specs)
    foreign = [n for n in names if not n.startswith(lora_math.ADAPTER_PREFIX)]
    if foreign:
        raise UserError(f"{weights.label}: {foreign[0]!r} is not a PEFT adapter key "
                        f"(expected {lora_math.ADAPTER_PREFIX}<module>.lora_A.weight ...)")
    specs = [TensorSpec(n, dtypes.output_dtype(weights.specs[n].dtype, requested), weights.specs[n].shape)
             for n in names]
    with StreamingWriter(dst / layout.PEFT_WEIGHTS, specs, hf_dir.ST_METADATA) as writer:
        for spec, (name, tensor) in zip(specs, weights.fetch(names)):
            writer.write(name, hf_dir.cast_checked(tensor, spec.dtype, name))
    config = dict(peft_config)
    # Points at the base given, so `PeftModel.from_pretrained` on a fresh machine needs only these two paths.
    config["base_model_name_or_path"] = str(base.resolve())
    config["inference_mode"] = True
    (dst / layout.PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_model(dst: Path, weights: TrainedWeights, main: TrainedWeights, base: Path, requested, max_bytes,
                 rows: int | None = None):
    """An HF model dir in the base's layout: its tensor names, order, tying and key layout.

    `rows`: the vocabulary the run grew to (special tokens added): the embeddings
    and an untied head were trained at that size and are written so, with the
    config's `vocab_size`.

    A checkpoint names tensors as the live model does; each is written under the
    key the base stores it as (`BaseKeys`). A base tensor the EMA shadow lacks
    comes from the main weights; one the main weights lack too was frozen in
    training (a vision tower) and is copied from the base.
    """
    base_weights = hf_dir.find_weights(base, "--base")
    # an MXFP4 base (GPT-OSS as published): each packed pair one tensor of numbers, as the stages trained it
    packed = stored_packed.packed_if_stored(base_weights)
    base_files = packed.specs if packed else base_weights.specs
    base_specs = packed.all_specs if packed else base_weights.all_specs
    keys = BaseKeys(base, set(base_specs))
    own = {keys(n): n for n in weights.specs}  # stored key -> name in the checkpoint
    main_own = own if weights is main else {keys(n): n for n in main.specs}
    composed = _composed(keys, weights, main, base_specs)
    extra = sorted(n for k, n in own.items() if k not in base_specs and not keys.rows(n))
    if extra:
        aliases = tied_aliases(base, keys)
        untied = [n for n in extra if n not in aliases]
        if untied:
            raise UserError(f"{weights.label} has tensor(s) the base does not store, e.g. {untied[0]!r} "
                            "(a different architecture?)")
        log.info("dropping %d tied duplicate(s): %s", len(extra), ", ".join(extra))
    names = list(base_specs)  # the base's names and order: its tying and layout carry over
    if not any(n in main_own for n in names):
        raise UserError(f"{main.label} holds none of the tensors of the base {base} (a different model?)")
    sources = {n: (weights, own[n]) if n in own else (main, main_own[n]) if n in main_own
               else (composed[n][0][0], n) if n in composed else (None, n) for n in names}
    from_main = sum(src is main and weights is not main for src, _ in sources.values())
    frozen = [n for n, (src, _) in sources.items() if src is None]
    if from_main:
        log.info("%s: %d tensor(s) taken from the main weights (no EMA kept)", weights.label, from_main)
    if frozen:
        log.info("%d tensor(s) not trained (frozen), taken from the base, e.g. %s", len(frozen), frozen[0])
    base_file = {spec.name: file for file, specs in base_files.items() for spec in specs}

    def read_base(name: str) -> torch.Tensor:
        return packed.read(base_file[name], name) if packed else read_tensor(base / base_file[name], name)

    specs = []
    for name in names:
        src, key = sources[name]
        if name in composed:  # rows of trained weights: the base's shape, the trained weights' dtype
            held, live = composed[name][0][:2]
            stored = TensorSpec(name, held.specs[live].dtype, base_specs[name].shape)
        else:
            stored = src.specs[key] if src is not None else base_specs[name]
        grown = rows is not None and stored.shape == (rows, *base_specs[name].shape[1:]) \
            and base_specs[name].shape[0] < rows
        if stored.shape != base_specs[name].shape and not grown:
            raise UserError(f"{name}: trained shape {stored.shape} differs from the base's {base_specs[name].shape}")
        specs.append(TensorSpec(name, dtypes.output_dtype(stored.dtype, requested), stored.shape))

    def fetch(batch: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        def stream(src):  # (base key, tensor) of the batch's tensors held by `src`
            picked = {sources[n][1]: n for n in batch if sources[n][0] is src and n not in composed}
            return ((picked[key], tensor) for key, tensor in src.fetch(list(picked)))

        frozen_here = ((n, read_base(n)) for n in batch if sources[n][0] is None)
        rows_here = ((n, _assembled(n, composed[n], read_base)) for n in batch if n in composed)
        yield from _in_order(batch, stream(weights), *([stream(main)] if main is not weights else []), frozen_here,
                             rows_here)

    hf_dir.write_model(dst, specs, fetch, max_shard_bytes=max_bytes)
    hf_dir.copy_non_weight_files(base, dst)
    if packed:
        hf_dir.set_config_unquantized(dst)
    if rows is not None and any(s.shape != base_specs[s.name].shape for s in specs):
        hf_dir.set_config_vocab(dst, rows)
    hf_dir.set_config_dtype(dst, dtypes.dominant_float((s.dtype, s.numel) for s in specs))


def _composed(keys: BaseKeys, weights: TrainedWeights, main: TrainedWeights, base_specs) -> dict:
    """Stored tensors the base keeps as rows of trained weights (Sarvam-MoE's `query_key_value`: the live
    `q_proj`, `k_proj`, `v_proj`; `BaseKeys.rows`): stored key -> [(the weights holding the live weight:
    `weights`, else the main weights; its name; its `StoredRows`)]."""
    out: dict[str, list] = {}
    for name in {**main.specs, **weights.specs}:
        if keys(name) not in base_specs:
            for rows in keys.rows(name) or ():
                out.setdefault(rows.key, []).append((weights if name in weights.specs else main, name, rows))
    return out


def _assembled(key: str, held: list, read_base) -> torch.Tensor:
    """The stored tensor `key` with the trained rows put where the base keeps them (rows no trained weight
    holds keep the base's values), in the first trained weight's dtype."""
    tensors = {}
    for src in {id(src): src for src, _, _ in held}.values():  # one read per set of weights
        tensors.update(src.fetch(sorted({name for held_by, name, _ in held if held_by is src})))
    dtype = tensors[held[0][1]].dtype
    out = read_base(key).to(dtype, copy=True)
    for _, name, rows in held:
        out[list(rows.stored)] = tensors[name][list(rows.live)].to(dtype)
    return out


def _in_order(order: list[str], *sources: Iterator[tuple[str, torch.Tensor]]):
    # Sources yield in their own order; hold early arrivals until their turn (a few tensors).
    pending: dict[str, torch.Tensor] = {}
    streams = list(sources)
    for name in order:
        while name not in pending:
            for stream in streams:
                item = next(stream, None)
                if item is not None:
                    pending[item[0]] = item[1]
                    break
            else:
                raise KeyError(name)
        yield name, pending.pop(name)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline consolidate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="final checkpoint dir")
    parser.add_argument("--base", required=True, type=model_dir, help="base model dir (or a hub model: its model.json or id, read from the HF cache), only read")
    parser.add_argument("--out-adapter", type=Path, help="LoRA: PEFT dir of the main weights")
    parser.add_argument("--out-adapter-ema", type=Path, help="LoRA: PEFT dir of the --ema-rate shadow")
    parser.add_argument("--out-model", type=Path, help="full fine-tuning: HF model dir of the main weights")
    parser.add_argument("--out-model-ema", type=Path, help="full fine-tuning: HF model dir of the EMA shadow")
    parser.add_argument("--ema-rate", help="EMA rate to export, e.g. 0.999 (default: the only one)")
    parser.add_argument("--all-ema-dir", type=Path, help="also write every EMA rate as DIR/<tag>/")
    parser.add_argument("--models", default="both", choices=("main", "ema", "both"))
    parser.add_argument("--dtype", default="auto", choices=dtypes.CLI_CHOICES,
                        help="dtype of floating tensors (auto: as stored)")
    parser.add_argument("--max-shard-size", default="5GB", help="full fine-tuning shard size (default 5GB)")
    parser.add_argument("--format", dest="fmt", default="auto", choices=FORMATS, help="checkpoint format")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the run's tokenizer dir, carried into every output (results/<run>/tokenizer)")
    parser.add_argument("--overwrite", action="store_true", help="replace non-empty output dirs")
    add_card_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    namespace = _parser().parse_args(argv)
    args = {k: v for k, v in vars(namespace).items() if not k.startswith("card_")}
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    written = consolidate(args.pop("checkpoint"), args.pop("base"), **args)
    write_cards(namespace, written)
    for path in written:
        print(f"wrote {path}")
    return 0
