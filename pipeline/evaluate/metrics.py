"""Held-out exact match: greedy decoding of each prompt against its reference answer.

Runs in eval mode under no_grad and consumes no RNG (decoding is greedy).
Validation loss lives in `pipeline.model.loss`, shared with the trainer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_held_out_args(ap: argparse.ArgumentParser) -> None:
    """--test, --max-test, --max-new-tokens: the held-out prompts and the decoding budget."""
    ap.add_argument("--test", type=Path, default=None, help="held-out dataset file for exact match")
    ap.add_argument("--max-test", type=int, default=None, help="evaluate at most this many held-out records")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy decoding budget per prompt")


def held_out_examples(path: Path | None, limit: int | None) -> list[tuple[list[dict], str]]:
    """(prompt messages, reference answer) of the first `limit` records of a held-out file."""
    if path is None:
        return []
    from pipeline.data.formats import load_records, prompt_and_reference

    examples = [prompt_and_reference(r) for r in load_records(path)]
    return examples[:limit] if limit else examples



def normalize_answer(text: str) -> str:
    return " ".join(text.strip().split())


@torch.no_grad()
def exact_match(model, tokenizer, examples: list[tuple[list[dict], str]], *, device, batch_size: int = 32,
                max_new_tokens: int = 32, keep: int = 5) -> dict:
    """Greedy-decode each prompt (chat template + generation prompt); compare to the reference.

    `examples`: (prompt messages, reference answer). Returns the exact-match rate
    and a few (prompt, answer, reference) samples for the report.
    """
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation continues from the right edge
    correct, samples = 0, []
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m, _ in chunk]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )
            for (messages, ref), row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
                answer = tokenizer.decode(row, skip_special_tokens=True)
                hit = normalize_answer(answer) == normalize_answer(ref)
                correct += hit
                if len(samples) < keep:
                    samples.append({"prompt": messages[-1]["content"], "answer": answer, "reference": ref, "match": hit})
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return {"exact_match": correct / max(len(examples), 1), "n": len(examples), "samples": samples}
