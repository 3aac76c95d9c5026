"""`python -m pipeline merge`: fold a LoRA adapter into its base, one tensor at a time.

    python -m pipeline merge --base DIR --adapter DIR --out DIR
        [--tokenizer DIR] [--dtype auto|bf16|fp16|fp32] [--overwrite]

The model is never built (except on the meta device, when the base stores its
tensors under other keys than the live model's names: `BaseKeys`). The base's
safetensors shards are read one at a
time with `safe_open`, tensor by tensor (a handle per tensor, so no more than
one tensor of the base is ever mapped in); each LoRA target gets
W + s * B @ A in fp32 (under DoRA rescaled per output feature by its magnitude
vector, which the adapter holds whole; `pipeline.export.lora_math`; a module the adapter saved
whole, PEFT `modules_to_save`, replaces the base tensor; a fused expert weight adapted by peft's
`ParamWrapper` gets each expert's delta, in the fused tensor or in the per-expert tensors the
base stores it as, `pipeline.export.expert_math` and `pipeline.model.expert_keys`), is cast to the output
dtype and checked finite, and is streamed into the output shard of the same
name (`safetensors_stream.StreamingWriter`), so peak memory is the adapter
plus a few copies of the largest tensor, far below one shard.

`--card-*` options add a model card, `README.md` (`pipeline.export.card`).

Output: the same shard files and tensor names as the base (so a tied
`lm_head` stays tied: it is simply not stored), the index when the base has
one (sizes updated), and the top-level non-weight files of the base that make up a Hugging Face
model (`hf_dir.HF_FILE`: config with `dtype` updated, tokenizer, generation
config, ...; not its README or reports such as the demo's `pretrain_report.json`). `--dtype
auto` keeps each tensor's stored dtype; integer tensors are never cast.

The tokenizer is the run's (`--tokenizer`, default the adapter dir's own when it
carries one, as the exported adapters do): its files replace the base's, so
`apply_chat_template` on the merged model renders what training rendered, and
generation stops at its end-of-turn marker (`pipeline.export.tokenizer`).
Token rows the adapter trained for added special tokens (`TokenRows`) are put
into the embeddings / untied head, grown to the new vocabulary (the config's
`vocab_size` follows).

Refused before anything is written (`UserError`): an output equal to, inside
or containing the base or adapter dir, a non-empty output without
`--overwrite`, a quantized base (but for MXFP4, GPT-OSS as published, and block FP8: their quantized
weights are dequantized as transformers loads them, merged and written as numbers,
`pipeline.storage.packed`),
adapter kinds that are not plain LoRA or DoRA
(plus `modules_to_save`), and
any adapter tensor that does not map exactly onto a stored base tensor. The
base and adapter are only read.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from pathlib import Path

from safetensors.torch import load_file

from pipeline import layout
from pipeline.errors import UserError
from pipeline.export import lora_math
from pipeline.export.card import add_card_args, write_cards
from pipeline.export.tokenizer import carry_tokenizer, is_tokenizer_dir
from pipeline.export.expert_math import FusedWeight
from pipeline.model.base_keys import BaseKeys
from pipeline.model.expert_keys import ExpertLayout, param_wrappers
from pipeline.storage import dtypes, hf_dir, packed as stored_packed
from pipeline.storage.hub import model_dir
from pipeline.export.outputs import check_replaceable, refuse_overlaps, staged_dir
from pipeline.storage.safetensors_stream import StreamingWriter, TensorSpec, read_metadata, read_tensor

log = logging.getLogger(__name__)


def read_adapter(adapter: Path) -> tuple[dict, dict]:
    """(adapter_config dict, tensors) of a PEFT dir; only the safetensors format is read."""
    config_path = adapter / layout.PEFT_CONFIG
    weights_path = adapter / layout.PEFT_WEIGHTS
    if not config_path.is_file():
        raise UserError(f"--adapter {adapter} has no {layout.PEFT_CONFIG}")
    if not weights_path.is_file():
        raise UserError(f"--adapter {adapter} has no {layout.PEFT_WEIGHTS} (only safetensors adapters are read)")
    return json.loads(config_path.read_text()), load_file(str(weights_path))


def merge_dirs(
    base: Path | str,
    adapter: Path | str,
    out: Path | str,
    *,
    tokenizer: Path | str | None = None,
    dtype: str = "auto",
    overwrite: bool = False,
) -> dict:
    """Write `out` = `base` with `adapter` merged; returns a small report dict.

    All checks (paths, adapter kind, key mapping, shapes) run before the first
    write; the output appears atomically when complete.
    """
    base, adapter, out = Path(base), Path(adapter), Path(out)
    if tokenizer is None and is_tokenizer_dir(adapter):
        tokenizer = adapter
    requested = dtypes.parse_cli(dtype)
    refuse_overlaps({"--out": out}, {"--base": base, "--adapter": adapter})
    check_replaceable(out, overwrite=overwrite, label="--out")
    weights = hf_dir.find_weights(base, "--base")
    # an MXFP4 base (GPT-OSS as published): its packed experts read as the numbers the stages trained on
    packed = stored_packed.packed_if_stored(weights)
    if packed is None:
        hf_dir.refuse_quantized(hf_dir.read_config(base), f"--base {base}")
    all_specs, file_specs = (packed.all_specs, packed.specs) if packed else (weights.all_specs, weights.specs)
    adapter_config, adapter_tensors = read_adapter(adapter)
    settings = lora_math.parse_adapter_config(adapter_config)
    base_shapes = {key: tuple(spec.shape) for key, spec in all_specs.items()}
    keys = BaseKeys(base, set(all_specs))
    layout = ExpertLayout(base, base_shapes, keys) if settings.target_parameters else None
    plan = lora_math.plan_targets(
        {key: tuple(t.shape) for key, t in adapter_tensors.items()}, base_shapes, settings, keys,
        _fused(base, adapter_config, layout) if layout is not None else None, keys.rows,
    )
    grown = {t.rows for t in plan.values() if isinstance(t, lora_math.TokenRows)
             and t.rows > all_specs[t.base_key].shape[0]}
    if len(grown) > 1:
        raise UserError(f"the adapter's trained token rows grow the vocabulary to different sizes: {sorted(grown)}")
    config = hf_dir.read_config(base)
    tied = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", True))
    if grown and not tied and sum(isinstance(t, lora_math.TokenRows) for t in plan.values()) < 2:
        raise UserError("the adapter grows the vocabulary of a base with an untied output head, but trains the rows "
                        "of only one of the input embeddings and the head")

    started = time.perf_counter()
    written: dict[str, list[TensorSpec]] = {}
    with staged_dir(out, overwrite=overwrite, label="--out") as stage:
        for file, specs in file_specs.items():
            written[file] = [TensorSpec(s.name, dtypes.output_dtype(s.dtype, requested),
                                        lora_math.output_shape(plan.get(s.name), s.shape)) for s in specs]
            read = functools.partial(packed.read, file) if packed else functools.partial(read_tensor, base / file)
            _merge_shard(base / file, stage / file, written[file], plan, adapter_tensors, _Pieces(layout), read)
            log.info("merged %s", file)
        if weights.index is not None:
            hf_dir.write_index(stage, written, weights.index.get("metadata"))
        hf_dir.copy_non_weight_files(base, stage)
        if tokenizer is not None:
            carry_tokenizer(stage, tokenizer, base)
        if grown:
            hf_dir.set_config_vocab(stage, grown.pop())
        if packed:
            hf_dir.set_config_unquantized(stage)
        out_specs = [spec for specs in written.values() for spec in specs]
        hf_dir.set_config_dtype(stage, dtypes.dominant_float((s.dtype, s.numel) for s in out_specs))
    return {
        "targets": len(plan),
        "shards": len(written),
        "tensors": sum(map(len, written.values())),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _fused(base: Path, adapter_config: dict, layout: ExpertLayout) -> dict[str, FusedWeight]:
    """The adapter's ParamWrapper modules and the stored tensors holding each one's weight."""
    out = {}
    for module, wrapped in param_wrappers(base, adapter_config).items():
        slices = layout.slices(wrapped.param, wrapped.shape)
        out[module] = FusedWeight(wrapped.param, wrapped.experts, wrapped.layout, wrapped.shape,
                                  tuple((s.key, s.expert, s.piece) for s in slices))
    return out


class _Pieces:
    """One expert's delta cut into the tensors the base stores it as (`ExpertLayout.split`), kept for
    the few experts last asked: an expert's pieces (gate, up) come one after the other in a shard."""

    def __init__(self, layout: ExpertLayout | None, keep: int = 4):
        self.layout, self.keep, self.cache = layout, keep, {}

    def __call__(self, target, delta):
        key = (target.param, target.expert)
        if key not in self.cache:
            self.cache[key] = self.layout.split(target.param, delta())
            while len(self.cache) > self.keep:
                self.cache.pop(next(iter(self.cache)))
        return self.cache[key]


def _merge_shard(src: Path, dst: Path, specs: list[TensorSpec], plan: dict, adapter: dict, pieces: _Pieces,
                 read) -> None:
    """Write shard `dst` (`specs`) from the base's shard `src`, whose tensors `read(name)` gives."""
    metadata = {**hf_dir.ST_METADATA, **(read_metadata(src) or {})}
    with StreamingWriter(dst, specs, metadata) as writer:
        for spec in specs:
            # A handle per tensor: the mapped pages of the base are released tensor by tensor.
            tensor = read(spec.name)
            target = plan.get(spec.name)
            if target is None:
                tensor = hf_dir.cast_checked(tensor, spec.dtype, spec.name)
            else:
                tensor = lora_math.merged(target, tensor, adapter, spec.dtype, pieces)
            writer.write(spec.name, tensor)
            del tensor  # drop before the next read: peak stays one tensor


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=model_dir, help="base model dir, safetensors (or a hub model: its model.json or id, read from the HF cache), only read")
    parser.add_argument("--adapter", required=True, type=Path, help="PEFT LoRA adapter dir, only read")
    parser.add_argument("--out", required=True, type=Path, help="merged model dir to write")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the run's tokenizer dir (default: the adapter dir's, if it has one)")
    parser.add_argument("--dtype", default="auto", choices=dtypes.CLI_CHOICES,
                        help="output dtype of floating tensors (auto: as stored in the base)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    add_card_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = merge_dirs(args.base, args.adapter, args.out, tokenizer=args.tokenizer, dtype=args.dtype, overwrite=args.overwrite)
    write_cards(args, [args.out])
    print(f"merged {report['targets']} LoRA targets into {report['shards']} shard(s) "
          f"in {report['seconds']} s -> {args.out}")
    return 0
