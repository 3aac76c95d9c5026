"""`python -m pipeline verify-merge`: does the merged model compute what base + adapter computes?

    python -m pipeline verify-merge --base DIR --adapter DIR --merged DIR --out verification.json
        [--tolerance auto|FLOAT] [--probes 4] [--seq-len 32] [--seed 0]
        [--device auto|cpu|cuda] [--compute-dtype fp32|bf16|fp16]

In one process, and one model at a time (peak memory is one model, not two):
the reference is stock `PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(base), adapter)`, the candidate `AutoModelForCausalLM
.from_pretrained(merged)`. Both run on the same probe batch, random token ids
below the vocab size drawn from a fixed seed, and their logits are compared.

Tolerance `auto`: the relative tolerance of the least precise dtype involved
(merged weights' storage, compute; see `dtypes.relative_logit_tolerance`)
times the reference's largest |logit| (at least 1). A merged model stored in
bf16 differs from the fp32 reference by rounding alone, so it gets a looser
bound than an fp32 merge.

Writes `--out` (JSON: max_abs_diff, tolerance, passed, and what was compared)
in every case; exits 0 when passed, 1 otherwise. `--out` may not lie inside
the base or adapter dir.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.storage import dtypes, hf_dir
from pipeline.export.outputs import refuse_overlaps
from pipeline.storage.publish import write_json

log = logging.getLogger(__name__)

EXIT_MISMATCH = 1


def probe_ids(vocab_size: int, probes: int, seq_len: int, seed: int) -> torch.Tensor:
    """The probe batch: uniform token ids in [0, vocab_size), reproducible from the seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (probes, seq_len), generator=generator)


@torch.no_grad()
def _logits(model, ids: torch.Tensor, device: str) -> torch.Tensor:
    model.eval()
    out = model(input_ids=ids.to(device), attention_mask=torch.ones_like(ids, device=device), use_cache=False)
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
) -> dict:
    """Compare logits, write the JSON report to `out` and return it."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    base, adapter, merged, out = Path(base), Path(adapter), Path(merged), Path(out)
    refuse_overlaps({"--out": out}, {"--base": base, "--adapter": adapter})
    if tolerance != "auto":
        try:
            fixed_tolerance = float(tolerance)
        except ValueError:
            raise UserError(f"--tolerance must be 'auto' or a number, not {tolerance!r}") from None
    if probes < 1 or seq_len < 1:
        raise UserError("--probes and --seq-len must be positive")
    compute = dtypes.BY_NAME[compute_dtype]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    specs = hf_dir.find_weights(merged, "--merged").all_specs.values()
    stored = dtypes.dominant_float((s.dtype, s.numel) for s in specs)
    vocab = AutoConfig.from_pretrained(merged).get_text_config().vocab_size
    base_vocab = AutoConfig.from_pretrained(base).get_text_config().vocab_size
    if vocab != base_vocab:
        raise UserError(f"--merged has vocab size {vocab}, --base {base_vocab}: not the same model")
    ids = probe_ids(vocab, probes, seq_len, seed)

    # One model in memory at a time: the reference is freed before the merged model loads.
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=compute, device_map=device), adapter
    )
    expected = _logits(reference, ids, device)
    del reference
    gc.collect()
    candidate = AutoModelForCausalLM.from_pretrained(merged, dtype=compute, device_map=device)
    actual = _logits(candidate, ids, device)
    del candidate

    diff = (actual - expected).abs()
    max_diff = float(diff.max())
    scale = float(expected.abs().max())
    relative = dtypes.relative_logit_tolerance(stored, compute)
    tol = fixed_tolerance if tolerance != "auto" else relative * max(1.0, scale)
    passed = bool(torch.isfinite(actual).all()) and max_diff <= tol
    report = {
        "passed": passed,
        "max_abs_diff": max_diff,
        "mean_abs_diff": float(diff.mean()),
        "tolerance": tol,
        "tolerance_mode": "auto" if tolerance == "auto" else "fixed",
        "relative_tolerance": relative if tolerance == "auto" else None,
        "logit_scale": scale,
        "merged_dtype": dtypes.config_name(stored) if stored else None,
        "compute_dtype": dtypes.config_name(compute),
        "device": device,
        "probes": probes,
        "seq_len": seq_len,
        "seed": seed,
        "vocab_size": vocab,
        "base": str(base),
        "adapter": str(adapter),
        "merged": str(merged),
    }
    write_json(out, report)
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline verify-merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path)
    parser.add_argument("--adapter", required=True, type=Path)
    parser.add_argument("--merged", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path, help="verification JSON to write")
    parser.add_argument("--tolerance", default="auto", help="max |logit diff| allowed: auto or a number")
    parser.add_argument("--probes", type=int, default=4, help="probe sequences (default 4)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per probe (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    parser.add_argument("--compute-dtype", default="fp32", choices=tuple(dtypes.BY_NAME))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = verify(args.base, args.adapter, args.merged, args.out, tolerance=args.tolerance,
                    probes=args.probes, seq_len=args.seq_len, seed=args.seed, device=args.device,
                    compute_dtype=args.compute_dtype)
    verdict = "passed" if report["passed"] else "FAILED"
    print(f"verify-merge {verdict}: max |logit diff| {report['max_abs_diff']:.3g} "
          f"(tolerance {report['tolerance']:.3g}) -> {args.out}", file=sys.stdout if report["passed"] else sys.stderr)
    return 0 if report["passed"] else EXIT_MISMATCH
