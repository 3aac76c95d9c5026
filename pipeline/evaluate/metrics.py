"""Validation loss / perplexity and held-out exact match.

Both run with the model in eval mode and under no_grad; neither consumes the
torch RNG (dropout is off, decoding is greedy), so evaluating inside a stage
does not change what training computes afterwards.
"""

from __future__ import annotations

import math

import torch

from pipeline.train.batches import collate, token_loss_sum


@torch.no_grad()
def validation_loss(model, cache, *, pad_id: int, micro_batch: int, device, autocast, max_batches: int | None = None,
                    should_stop=None) -> dict | None:
    """Token-weighted mean loss over the cache (or its first `max_batches` batches).

    `should_stop()` is asked before each batch; when it says yes the evaluation
    is abandoned and None returned (a preemption signal arrived meanwhile).
    """
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    n = len(cache)
    for b, start in enumerate(range(0, n, micro_batch)):
        if max_batches is not None and b >= max_batches:
            break
        if should_stop is not None and should_stop():
            model.train(was_training)
            return None
        batch = collate(cache, list(range(start, min(n, start + micro_batch))), pad_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        total += float(token_loss_sum(logits, batch["labels"]))
        tokens += int((batch["labels"][:, 1:] != -100).sum())
    model.train(was_training)
    loss = total / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


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
