"""Batches of the token cache, the next-token loss, and validation loss.

Shared by training (`pipeline.train`) and evaluation (`pipeline.evaluate`), so
both compute the loss the same way. Labels carry `IGNORE_INDEX` on every
position that is not supervised (prompts, image tokens, padding). A batch is a
dict of tensors; everything in it but the labels goes to the model's forward
(`model_inputs`), so a vision-language batch simply carries its pixels too.
"""

from __future__ import annotations

import math

import torch

from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.vision import ImageText

LABELS = "labels"


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
    return {"input_ids": input_ids, "attention_mask": mask, LABELS: labels}


class Collator:
    """Records of a token cache -> one batch: `collate`'s tensors, plus a vision-language model's
    image inputs (pixels made here from the records' image files) and token-derived inputs.

    Picklable (the cache pickles by path), so DataLoader workers can run it and
    decode the images off the training loop.
    """

    def __init__(self, cache, pad_id: int, images: ImageText | None = None):
        self.cache, self.pad_id, self.images = cache, pad_id, images

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = collate(self.cache, indices, self.pad_id)
        if self.images is not None:
            batch.update(self.images.text_inputs(batch["input_ids"]))
            paths = [p for i in indices for p in self.cache.images(i)]
            if paths:  # images in the order of their tokens: record by record
                batch.update(self.images.pixels(paths))
        return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model's forward takes from a batch: all but the labels (the loss is ours)."""
    return {k: v for k, v in batch.items() if k != LABELS}


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over supervised positions, computed in fp32."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def supervised_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Positions whose next token carries a loss (what `token_loss_sum` sums over)."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def validation_loss(model, collate: Collator, *, micro_batch: int, device, autocast, max_batches: int | None = None,
                    should_stop=None) -> dict | None:
    """Token-weighted mean loss over the collator's cache (or its first `max_batches` batches).

    Runs in eval mode (no dropout) and consumes no RNG, so evaluating inside a
    stage does not change what training computes afterwards. `should_stop()`
    is asked before each batch; when it says yes the evaluation is abandoned
    and None returned (a preemption signal arrived meanwhile).
    """
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    n = len(collate.cache)
    for b, start in enumerate(range(0, n, micro_batch)):
        if max_batches is not None and b >= max_batches:
            break
        if should_stop is not None and should_stop():
            model.train(was_training)
            return None
        batch = collate(list(range(start, min(n, start + micro_batch))))
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            logits = model(**model_inputs(batch)).logits
        total += float(token_loss_sum(logits, batch[LABELS]))
        tokens += int(supervised_tokens(batch[LABELS]))
    model.train(was_training)
    loss = total / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}
