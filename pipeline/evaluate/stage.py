"""Evaluate one stage's checkpoint: raw weights and every EMA rate.

    python -m pipeline evaluate --checkpoint results/<run>/stages/chunk01/checkpoint \
        --stage chunk01 --out results/<run>/eval/chunk01.json

For each weight set: validation loss and perplexity over the validation cache
(its first `validation.max_records` records, as in the stages), and, when a
held-out test file is given, greedy-decoding exact match
(for a vision-language model: on the held-out image questions, with their images),
with the answers of every weight set to the same first `--samples` held-out prompts
next to their references (the report's samples page shows them side by side).
The model (base + adapter) is built once; each EMA shadow is loaded into the
adapter in turn. `--base-only` evaluates the untouched base model instead (the
"before" row of the summary).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from pipeline import config as train_config
from pipeline.checkpoint.reader import open_checkpoint
from pipeline.data import run_tokenizer
from pipeline.evaluate.metrics import add_held_out_args, exact_match, held_out_examples
from pipeline.model import base, loading, precision as prec
from pipeline.model.batch import validation_collator
from pipeline.model.loss import TokenLoss, validation_loss
from pipeline.model.prompts import Prompts

log = logging.getLogger(__name__)


# The fixed held-out prompts whose answers every stage end records: the first N of the test split.
SAMPLES = 8


def _evaluate_current(model, prompts, val, examples, cfg, device, precision, max_new_tokens,
                      samples: int = SAMPLES) -> dict:
    row: dict = {}
    if val is not None:
        row.update(validation_loss(TokenLoss(model), val, micro_batch=cfg.validation.batch_size, device=device,
                                   autocast=precision.autocast))
    if examples:
        # Under autocast, as in training: a LoRA model built for half precision leaves its inputs uncast.
        with precision.autocast():
            em = exact_match(model, prompts, examples, device=device, max_new_tokens=max_new_tokens, keep=samples)
        row.update({"exact_match": em["exact_match"], "n_test": em["n"], "samples": em["samples"]})
    return row


def evaluate(args) -> dict:
    from transformers import AutoTokenizer

    # HF dirs (adapter/ or model/, ema/<tag>/) or, from an FSDP run, the DCP shards (dcp/), unsharded here.
    ckpt = open_checkpoint(args.checkpoint, verify=True) if args.checkpoint is not None else None
    cfg = train_config.load(ckpt.config_path if ckpt is not None else args.config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = prec.choose(cfg.precision.mode, device, init_scale=cfg.precision.init_scale)
    prec.use_tf32(device, cfg.precision.tf32)
    images = base.image_text(cfg.model)  # a vision-language model's processor; None for a text model
    prompts = Prompts(images.tokenizer if images else AutoTokenizer.from_pretrained(run_tokenizer.path(cfg.model)), images)
    val = validation_collator(cfg, prompts.pad_token_id, images)
    examples = held_out_examples(args.test, args.max_test, args)
    samples = getattr(args, "samples", SAMPLES)
    result = {"stage": args.stage, "rows": []}
    t0 = time.time()

    if ckpt is None:  # the base model, before any training
        model = base.load_base(cfg.model, prec.weights_dtype(cfg.model.dtype, precision), device,
                               compute_dtype=precision.dtype or torch.float32)  # quantized as the stages train it
        # Rows for the special tokens the run's template added (the validation data holds them), as
        # every stage starts from: the base before training is the same grown model.
        loading.grow_vocabulary(model, cfg.model.tokenizer)
        row = _evaluate_current(model, prompts, val, examples, cfg, device, precision, args.max_new_tokens, samples)
        result["rows"].append({"weights": "base", **row})
    else:
        torch.manual_seed(cfg.seed)  # adapter init is overwritten below; seed only for tidiness
        model = loading.build(cfg, precision, device, evaluation=True)
        names = [n for n, _ in loading.trainable(model)]
        result["step"] = ckpt.progress["step"]
        sets = [("raw", ckpt.main)] + [(f"ema_{tag}", weights) for tag, weights in ckpt.ema.items()]
        for name, weights in sets:
            loading.load_trained(model, names, weights.all(), f"{args.checkpoint} ({weights.label})")
            row = _evaluate_current(model, prompts, val, examples, cfg, device, precision, args.max_new_tokens,
                                    samples)
            result["rows"].append({"weights": name, **row})
            log.info("%s %s: %s", args.stage, name, {k: v for k, v in row.items() if k != "samples"})
    result["seconds"] = round(time.time() - t0, 2)
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="stage checkpoint dir")
    src.add_argument("--config", type=Path, help="resolved trainer config: evaluate the base model alone")
    ap.add_argument("--stage", required=True, help="name recorded in the output (e.g. chunk01, base)")
    add_held_out_args(ap)
    ap.add_argument("--samples", type=int, default=SAMPLES,
                    help="record every weight set's answers to the first N held-out prompts (default %(default)s)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    result = evaluate(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.stage != "base":  # a stage's evaluation, in the run's tracker (if any)
        from pipeline.tracker import Tracker

        tracker = Tracker(args.out.parent.parent, job=f"evaluate {args.stage}")
        tracker.log_evaluation(result)
        tracker.close()
    for row in result["rows"]:
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "samples"}
        print(args.stage, shown)
    return 0
