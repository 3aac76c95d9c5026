"""Batches of the token cache, the next-token loss, and validation loss.

Shared by training (`pipeline.train`) and evaluation (`pipeline.evaluate`), so
both compute the loss the same way. Labels carry `IGNORE_INDEX` on every
position that is not supervised (prompts, padding).
"""

from __future__ import annotations

import math

import torch

from pipeline.data.cache import IGNORE_INDEX


def collate(cache, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (IGNORE_INDEX on padding)."""
    items = [cache[i] for i in indices]
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(items):
        input_ids[row, :len(ids)] = ids
        labels[row, :len(lab)] = lab
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over supervised positions, computed in fp32."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def supervised_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Positions whose next token carries a loss (what `token_loss_sum` sums over)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def num_batches(cache, micro_batch: int, max_batches: int | None = None) -> int:
    """Batches of `micro_batch` records the validation cache splits into (at most `max_batches`)."""
    n = -(-len(cache) // micro_batch)
    return n if max_batches is None else min(n, max_batches)


@torch.no_grad()
def batch_loss_sums(model, cache, batch_ids: list[int], *, pad_id: int, micro_batch: int, device, autocast,
                    should_stop=None) -> list[tuple[float, int]] | None:
    """(loss sum, supervised tokens) of each batch in `batch_ids`; batch b holds records
    [b * micro_batch, (b + 1) * micro_batch) of the cache, padded as in training.

    Runs in eval mode (no dropout) and consumes no RNG, so evaluating inside a
    stage does not change what training computes afterwards. `should_stop()` is
    asked before each batch; when it says yes the evaluation is abandoned and
    None returned (a preemption signal arrived meanwhile).
    """
    was_training = model.training
    model.eval()
    sums = []
    try:
        for b in batch_ids:
            if should_stop is not None and should_stop():
                return None
            batch = collate(cache, list(range(b * micro_batch, min(len(cache), (b + 1) * micro_batch))), pad_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums.append((float(token_loss_sum(logits, batch["labels"])), int(supervised_tokens(batch["labels"]))))
    finally:
        model.train(was_training)
    return sums


def mean_loss(sums: list[tuple[float, int]]) -> dict:
    """Token-weighted mean loss and perplexity of per-batch (loss sum, tokens), summed in batch order."""
    total, tokens = 0.0, 0
    for loss, n in sums:
        total += loss
        tokens += n
    loss = total / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


def validation_loss(model, cache, *, pad_id: int, micro_batch: int, device, autocast) -> dict:
    """Token-weighted mean loss over the whole cache, in this process (see `batch_loss_sums`)."""
    ids = list(range(num_batches(cache, micro_batch)))
    return mean_loss(batch_loss_sums(model, cache, ids, pad_id=pad_id, micro_batch=micro_batch, device=device,
                                     autocast=autocast))
