"""Held-out exact match: greedy decoding of each prompt against its reference answer.

Runs in eval mode under no_grad and consumes no RNG (decoding is greedy).
Validation loss lives in `pipeline.model.loss`, shared with the trainer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch


def add_held_out_args(ap: argparse.ArgumentParser) -> None:
    """--test, --max-test, --max-new-tokens: the held-out prompts and the decoding budget."""
    ap.add_argument("--test", type=Path, default=None, help="held-out dataset file for exact match")
    ap.add_argument("--max-test", type=int, default=None, help="evaluate at most this many held-out records")
    # Required: its default is the workflow schema's evaluate.max_new_tokens, which the rules pass.
    ap.add_argument("--max-new-tokens", type=int, required=True, help="greedy decoding budget per prompt")
    from pipeline.data.shapes import add_arguments

    add_arguments(ap)  # --columns / --roles / --image-dir: how the held-out file's records are read


@dataclass(frozen=True)
class HeldOut:
    """One held-out question: the prompt messages, the reference answer, the prompt's image paths."""

    messages: list[dict]
    reference: str
    images: list[str]


def held_out_examples(path: Path | None, limit: int | None, args: argparse.Namespace | None = None) -> list[HeldOut]:
    """The first `limit` records of a held-out file, each split into prompt and reference answer, read as
    `args`'s ``--columns`` / ``--roles`` / ``--image-dir`` say (`add_held_out_args`; None: as they are)."""
    if path is None:
        return []
    from pipeline.data.formats import load_records, prompt_and_reference
    from pipeline.data.shapes import fields_of

    # Images sit in user turns only (validation), so all of a record's images are in its prompt.
    records = load_records(path, fields_of(args) if args is not None else None)
    examples = [HeldOut(*prompt_and_reference(r), list(r.images)) for r in records]
    return examples[:limit] if limit else examples



def normalize_answer(text: str) -> str:
    return " ".join(text.strip().split())


@torch.no_grad()
def exact_match(model, prompts, examples: list[HeldOut], *, device, batch_size: int = 32, max_new_tokens: int = 32,
                keep: int = 5) -> dict:
    """Greedy-decode each prompt (chat template + generation prompt); compare to the reference.

    `prompts`: a `pipeline.model.prompts.Prompts` (text, or text and images).
    Returns the exact-match rate and a few (prompt, answer, reference) samples
    for the report.
    """
    was_training = model.training
    model.eval()
    correct, samples = 0, []
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            enc = prompts.encode([e.messages for e in chunk], [e.images for e in chunk])
            enc = {k: v.to(device) for k, v in enc.items()}
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=prompts.pad_token_id, eos_token_id=prompts.eos_token_id,
            )
            for example, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                answer = prompts.decode(row)
                hit = normalize_answer(answer) == normalize_answer(example.reference)
                correct += hit
                if len(samples) < keep:
                    samples.append({"prompt": example.messages[-1]["content"], "answer": answer,
                                    "reference": example.reference, "match": hit,
                                    **({"images": example.images} if example.images else {})})
    finally:
        model.train(was_training)
    return {"exact_match": correct / max(len(examples), 1), "n": len(examples), "samples": samples}
