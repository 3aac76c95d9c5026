"""`python -m pipeline verify-merge`: does the merged model compute what base + adapter computes?

    python -m pipeline verify-merge --base DIR --adapter DIR --merged DIR --out verification.json
        [--tolerance auto|FLOAT] [--probes 4] [--seq-len 32] [--seed 0]
        [--device auto|cpu|cuda] [--compute-dtype fp32|bf16|fp16] [--train-config train_config.yaml]

In one process, and one model at a time (peak memory is one model, not two):
the reference is stock `PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(base), adapter)`, the candidate `AutoModelForCausalLM
.from_pretrained(merged)` (`AutoModelForImageTextToText` for a vision-language
base). Both run on the same probe batch, random token ids below the vocab size
drawn from a fixed seed, and their logits are compared. A vision-language
model's probes are (image, prompt) inputs: a random-noise image per probe in a
user turn (through the base's processor: template, image tokens, pixels), then
the random ids, so the vision tower, the projector and the language model are
all compared.

An adapter that trained rows for special tokens the run added (peft
`trainable_token_indices`) may have grown the vocabulary: the merged model then
has more rows than the base, and the reference base is resized to them first
(`resize_token_embeddings`, as a user loading the adapter does; peft replaces
the trained rows whatever the resize put there). Every probe then starts with
the trained token ids, so their rows are compared too.

Tolerance `auto`: the relative tolerance of the least precise dtype involved
(merged weights' storage, compute; see `dtypes.relative_logit_tolerance`)
times the reference's largest |logit| (at least 1). A merged model stored in
bf16 differs from the fp32 reference by rounding alone, so it gets a looser
bound than an fp32 merge.

A run that trained on a quantized base (`--train-config` with
`model.quantization`: nf4 / fp4 / int8, QLoRA) is verified the same way: the
merge adds the adapter to the *unquantized* base files, so the merged model
must equal the float base + adapter to rounding, and that comparison, with the
same tolerance, passes or fails it. The quantized base + adapter (what the
stages trained and evaluated) differs from both by the base's quantization
error, which no a-priori bound fits (it depends on the weights and the depth):
it is measured and reported beside the quantization error of the base alone
(quantized base vs float base, adapters off), so the report shows whether the
merged model is as far from what trained as quantization makes any model, and
not a pass criterion. The report names the base each side used.

The reference must hold the adapter as saved: LoRA tensors that stock peft
leaves out or changes on loading (its key conversion for some families:
Mistral Large 4's mixture-of-experts layers) are listed in the report
(`adapter_not_loaded`), and the check fails.

Writes `--out` (JSON: max_abs_diff, tolerance, passed, and what was compared)
in every case; exits 0 when passed, 1 otherwise. `--out` may not lie inside
the base or adapter dir.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import tempfile
from pathlib import Path

import torch

from pipeline import compat
from pipeline.compat import peft_wrapping
from pipeline.data.formats import IMAGE_PLACEHOLDER
from pipeline.data.vision import config_is_vision_language, load_image_text
from pipeline.errors import UserError
from pipeline.model.base import auto_class
from pipeline.model.quantization import one_cpu_kernel, quantization_config, stored_config
from pipeline.storage import dtypes, hf_dir, packed as stored_packed
from pipeline.storage.hub import model_dir
from pipeline.export.outputs import refuse_overlaps
from pipeline.storage.publish import write_json

log = logging.getLogger(__name__)

EXIT_MISMATCH = 1


PROBE_IMAGE_SIZE = (48, 40)  # width, height: any size; the processor resizes it as it would a real image


def probe_ids(vocab_size: int, probes: int, seq_len: int, seed: int, exclude: set[int] = frozenset()) -> torch.Tensor:
    """The probe batch: uniform token ids in [0, vocab_size) (none of `exclude`), reproducible from the seed."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (probes, seq_len), generator=generator)
    for token in exclude:  # an image token without its image would not match the features
        ids[ids == token] = (token + 1) % vocab_size if (token + 1) % vocab_size not in exclude else 0
    return ids


def image_probes(base: Path, config, probes: int, seq_len: int, seed: int, workdir: Path) -> dict:
    """(image, prompt) probes of a vision-language base: image tokens and pixels from its processor, then random ids."""
    import numpy as np
    from PIL import Image

    images = load_image_text(base)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(probes):
        paths.append(str(workdir / f"probe{i}.png"))
        Image.fromarray(rng.integers(0, 256, (*PROBE_IMAGE_SIZE[::-1], 3), dtype=np.uint8)).save(paths[-1])
    conversation = images.conversation([{"role": "user", "content": IMAGE_PLACEHOLDER}])
    prompt = images.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                  chat_template=images.chat_template)
    heads = [images.tokenizer(images.expand(prompt, [p]), add_special_tokens=False, return_tensors="pt")["input_ids"]
             for p in paths]
    special = {getattr(config, k, None) for k in ("image_token_id", "video_token_id")} - {None}
    ids = torch.cat([torch.cat(heads), probe_ids(config.get_text_config().vocab_size, probes, seq_len, seed,
                                                 special)], dim=1)
    # one image per probe (Llama 3.2 Vision's cross_attention_mask too, from these ids)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **images.inputs(ids, [[p] for p in paths])}


def _trained_token_rows(adapter: Path) -> list[int]:
    """Row ids an adapter trained as peft trainable tokens (any layer), sorted."""
    import json

    path = adapter / "adapter_config.json"
    indices = json.loads(path.read_text()).get("trainable_token_indices") if path.is_file() else None
    if not indices:
        return []
    lists = indices.values() if isinstance(indices, dict) else [indices]
    return sorted({int(i) for rows in lists for i in rows})


def _text_probes(vocab: int, token_rows: list[int], probes: int, seq_len: int, seed: int) -> dict:
    """`probe_ids` as model inputs, each probe starting with the rows the adapter trained as tokens
    (added tokens: random ids would hardly ever reach them)."""
    ids = probe_ids(vocab, probes, seq_len, seed)
    head = token_rows[:seq_len]
    ids[:, :len(head)] = torch.tensor(head, dtype=ids.dtype)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@torch.no_grad()
def _logits(model, inputs: dict, device: str) -> torch.Tensor:
    model.eval()
    out = model(**{k: v.to(device) for k, v in inputs.items()}, use_cache=False)
    return out.logits.float().cpu()


def verify(
    base: Path | str,
    adapter: Path | str,
    merged: Path | str,
    out: Path | str,
    *,
    tolerance: str = "auto",
    probes: int = 4,
    seq_len: int = 32,
    seed: int = 0,
    device: str = "auto",
    compute_dtype: str = "fp32",
    train_config: Path | str | None = None,
) -> dict:
    """Compare logits, write the JSON report to `out` and return it (`train_config`: the run's resolved
    trainer config; with `model.quantization` the quantized base + adapter is measured too)."""
    from transformers import AutoConfig

    base, adapter, merged, out = Path(base), Path(adapter), Path(merged), Path(out)
    refuse_overlaps({"--out": out}, {"--base": base, "--adapter": adapter})
    fixed_tolerance = _fixed_tolerance(tolerance)
    if probes < 1 or seq_len < 1:
        raise UserError("--probes and --seq-len must be positive")
    compute = dtypes.BY_NAME[compute_dtype]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = hf_dir.find_weights(merged, "--merged").all_specs.values()
    stored = dtypes.dominant_float((s.dtype, s.numel) for s in specs)
    config = AutoConfig.from_pretrained(base)
    vocab = AutoConfig.from_pretrained(merged).get_text_config().vocab_size
    base_vocab = config.get_text_config().vocab_size
    vision = config_is_vision_language(config)
    inputs = _probe_inputs(base, config, adapter, vocab, probes=probes, seq_len=seq_len, seed=seed)
    model_class = auto_class(config)
    quantized = _quantized_base(train_config, compute)

    def base_plus_adapter(quantization=None):
        return _base_plus_adapter(model_class, base, adapter, inputs, compute=compute, device=device,
                                  resize_to=vocab if vocab > base_vocab else None, quantization=quantization,
                                  base_alone=quantized is not None, config=compat.unrescaled(config),
                                  stored=stored_config(config, base))

    # One model in memory at a time: each reference is freed before the next model loads.
    expected, float_base, left_out = base_plus_adapter()
    candidate = model_class.from_pretrained(merged, dtype=compute, device_map=device)
    actual = _logits(candidate, inputs, device)
    del candidate

    report = {
        **_comparison(actual, expected, dtypes.relative_logit_tolerance(stored, compute), fixed_tolerance),
        "merged_dtype": dtypes.config_name(stored) if stored else None,
        "compute_dtype": dtypes.config_name(compute),
        "device": device,
        "probes": probes,
        "probe_images": probes if vision else 0,
        "seq_len": seq_len,
        "seed": seed,
        "vocab_size": vocab,
        "base": str(base),
        "adapter": str(adapter),
        "merged": str(merged),
        "reference": f"{base} ({dtypes.config_name(compute)}, unquantized, from its files) + {adapter}",
        "candidate": f"{merged} ({dtypes.config_name(compute)})",
    }
    if left_out:  # the reference is not base + adapter: say so, not only that the logits differ
        report["passed"] = False
        report["adapter_not_loaded"] = _not_loaded_entry(adapter, left_out)
    if quantized is not None:
        settings, quantization = quantized
        trained, quantized_base, _ = base_plus_adapter(quantization)
        report["quantized_reference"] = _quantized_entry(
            f"{base} quantized ({settings}, bitsandbytes, as the stages trained) + {adapter}", actual, trained,
            quantized_base - float_base)
    write_json(out, report)
    return report


def _base_plus_adapter(model_class, base: Path, adapter: Path, inputs: dict, *, compute: torch.dtype, device: str,
                       resize_to: int | None = None, quantization=None, base_alone: bool = False,
                       config: dict | None = None, stored=None):
    """(logits of stock base + adapter on the probes, the base's alone when `base_alone` else None, the adapter
    tensors stock peft did not load as saved); the model is freed before this returns. `resize_to`: the merged
    vocabulary, larger than the base's; `quantization`: a transformers quantization config to load the base
    with (then the tensors are not checked); `config`: config values the base loads with, as the stages
    loaded it (`compat.unrescaled`: RWKV's eval-mode rescaling, which would leave the adapter's delta
    unscaled, off; the merged model keeps its own); `stored`: the quantization config a base stored quantized
    loads with as numbers (`quantization.stored_config`: MXFP4 dequantized, as the stages loaded it)."""
    from peft import PeftModel

    model = model_class.from_pretrained(base, dtype=compute, device_map=device if quantization is None
                                        else {"": device}, quantization_config=quantization or stored,
                                        **(config or {}))
    if quantization is not None:
        one_cpu_kernel(model)  # the kernel the stages trained and evaluated with
    elif stored is not None:
        stored_packed.in_dtype(model, stored_packed.packed_weights(base), compute)
    if resize_to is not None:  # the new rows' values come from the adapter (all of them are trained)
        model.resize_token_embeddings(resize_to, mean_resizing=False)
    with peft_wrapping():
        model = PeftModel.from_pretrained(model, adapter)
    left_out = _not_loaded(model, adapter) if quantization is None else []
    with_adapter, alone = _logits(model, inputs, device), None
    if base_alone:  # what quantization does to the base
        with model.disable_adapter():
            alone = _logits(model, inputs, device)
    del model
    gc.collect()
    return with_adapter, alone, left_out


def _probe_inputs(base: Path, config, adapter: Path, vocab: int, *, probes: int, seq_len: int, seed: int) -> dict:
    """The probe batch both sides run: (image, prompt) inputs for a vision-language base, else random ids
    starting with the rows the adapter trained as tokens. A merged `vocab` larger than the base's must be
    exactly those rows."""
    base_vocab = config.get_text_config().vocab_size
    token_rows = _trained_token_rows(adapter)
    if vocab != base_vocab and not (vocab > base_vocab and set(range(base_vocab, vocab)) <= set(token_rows)):
        raise UserError(f"--merged has vocab size {vocab}, --base {base_vocab}: not the same model")
    if not config_is_vision_language(config):
        return _text_probes(vocab, token_rows, probes, seq_len, seed)
    with tempfile.TemporaryDirectory() as workdir:
        return image_probes(base, config, probes, seq_len, seed, Path(workdir))


def _not_loaded_entry(adapter: Path, left_out: list[str]) -> dict:
    """The report's `adapter_not_loaded`: what stock peft did not load as saved, and why that fails the check."""
    log.error("%s: stock peft loads %d tensor(s) of the adapter not as saved (first: %s), so the reference "
              "is not base + adapter", adapter, len(left_out), left_out[0])
    return {"count": len(left_out), "first": left_out[:4],
            "why": "stock PeftModel.from_pretrained does not hold these adapter tensors as saved (peft renames an "
                   "adapter's keys by the base family's checkpoint conversion, which need not map the adapter's own "
                   "names back to themselves): stock base + adapter is not the model that trained"}


def _quantized_entry(reference: str, actual: torch.Tensor, trained: torch.Tensor,
                     quantization_error: torch.Tensor) -> dict:
    """The report's `quantized_reference`: the merged model's logits (`actual`) against the quantized base +
    adapter's (`trained`), beside the quantized base's own error (quantized minus float base, adapters off)."""
    return {
        "reference": reference,
        "max_abs_diff": float((actual - trained).abs().max()),
        "mean_abs_diff": float((actual - trained).abs().mean()),
        "base_quantization_error": float(quantization_error.abs().max()),
        "gated": False,
        "why": "the merge adds the adapter to the unquantized base: the merged model differs from the "
               "quantized base + adapter by the base's quantization error, shown beside it "
               "(base_quantization_error: quantized vs unquantized base alone); not a pass criterion",
    }


def _not_loaded(model, adapter: Path) -> list[str]:
    """The LoRA tensors of `adapter`'s file that the peft `model` does not hold as saved (stock
    `PeftModel.from_pretrained` drops a tensor whose key its conversion renames to no module), sorted."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    path = adapter / "adapter_model.safetensors"
    if not path.is_file():
        return []
    held = get_peft_model_state_dict(model)
    out = []
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if ".lora_" not in key:
                continue
            mine = held.get(key)
            if mine is None or not torch.equal(mine.detach().cpu(), f.get_tensor(key).to(mine.dtype)):
                out.append(key)
    return sorted(out)


def _fixed_tolerance(tolerance: str) -> float | None:
    """--tolerance as a number; None for `auto` (relative to the logits' scale and the dtypes)."""
    if tolerance == "auto":
        return None
    try:
        return float(tolerance)
    except ValueError:
        raise UserError(f"--tolerance must be 'auto' or a number, not {tolerance!r}") from None


def _comparison(actual: torch.Tensor, expected: torch.Tensor, relative: float, fixed: float | None) -> dict:
    """Whether the merged model's logits (`actual`) match base + adapter's (`expected`): within `fixed`,
    or with `fixed` None within `relative` x the logits' scale (at least 1), and all finite."""
    diff = (actual - expected).abs()
    max_diff, scale = float(diff.max()), float(expected.abs().max())
    tol = fixed if fixed is not None else relative * max(1.0, scale)
    return {
        "passed": bool(torch.isfinite(actual).all()) and max_diff <= tol,
        "max_abs_diff": max_diff,
        "mean_abs_diff": float(diff.mean()),
        "tolerance": tol,
        "tolerance_mode": "auto" if fixed is None else "fixed",
        "relative_tolerance": relative if fixed is None else None,
        "logit_scale": scale,
    }


def _quantized_base(train_config: Path | str | None, compute: torch.dtype):
    """(a description, transformers' BitsAndBytesConfig) of the run's quantized base, or None (no
    `train_config`, or a float base): what `pipeline.model.loading.load_base` loads the stages' base with."""
    if train_config is None:
        return None
    from omegaconf import OmegaConf

    from pipeline import config as trainer_config

    cfg = trainer_config.to_typed(OmegaConf.load(train_config))  # only its model.* settings are read
    quantization = quantization_config(cfg.model, compute)
    if quantization is None:
        return None
    model = cfg.model
    settings = (f"model.quantization={model.quantization}" + (f", quant_double={model.quant_double}, "
                f"compute {dtypes.config_name(quantization.bnb_4bit_compute_dtype)}" if model.quantization != "int8" else ""))
    return settings, quantization


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline verify-merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=model_dir)
    parser.add_argument("--adapter", required=True, type=Path)
    parser.add_argument("--merged", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="verification JSON to write")
    parser.add_argument("--tolerance", default="auto", help="max |logit diff| allowed: auto or a number")
    parser.add_argument("--probes", type=int, default=4, help="probe sequences (default 4)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per probe (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    parser.add_argument("--compute-dtype", default="fp32", choices=tuple(dtypes.BY_NAME))
    parser.add_argument("--train-config", type=Path, default=None,
                        help="the run's resolved trainer config: with model.quantization, the quantized base + "
                             "adapter is measured and reported too")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = verify(args.base, args.adapter, args.merged, args.out, tolerance=args.tolerance,
                    probes=args.probes, seq_len=args.seq_len, seed=args.seed, device=args.device,
                    compute_dtype=args.compute_dtype, train_config=args.train_config)
    verdict = "passed" if report["passed"] else "FAILED"
    print(f"verify-merge {verdict}: max |logit diff| {report['max_abs_diff']:.3g} "
          f"(tolerance {report['tolerance']:.3g}) -> {args.out}", file=sys.stdout if report["passed"] else sys.stderr)
    return 0 if report["passed"] else EXIT_MISMATCH
