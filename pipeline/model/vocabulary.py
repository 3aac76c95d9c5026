"""Special tokens the run's tokenizer added to the base vocabulary: their rows, grown and trained.

A built-in chat template on a vocabulary without its turn markers adds them as
special tokens (`pipeline.data.prepare`; the contract in `pipeline.data.run_tokenizer`). The base then needs an embedding row
(and an untied output head row) for each, which the adapter trains as peft
`trainable_token_indices` (saved as `...token_adapter.trainable_tokens_delta`:
the rows' values). Every function takes the run's tokenizer dir
(`model.tokenizer`), or the `model` config group that names it.
"""

from __future__ import annotations

import torch

from pipeline.data.run_tokenizer import added_token_ids, refuse_added_tokens_sharded, vocab_rows  # noqa: F401  (re-exported)


def module_name(model, module) -> str:
    """The qualified name of `module` in `model`."""
    return next(n for n, m in model.named_modules() if m is module)


def _grown(weight: torch.Tensor, rows: int) -> torch.nn.Parameter:
    """`weight` with rows appended up to `rows`, each the mean of the existing rows.

    No RNG: every stage and every process grows the same rows bit for bit, so
    the run's random stream and its exact resume do not depend on it. The mean
    (summed in fp32) keeps a new token's first logits and inputs typical of the
    vocabulary (a zero or random row would not); training replaces the rows anyway.
    """
    with torch.no_grad():
        new = weight.new_empty((rows, weight.shape[1]))
        new[: weight.shape[0]] = weight
        new[weight.shape[0]:] = weight.float().mean(dim=0).to(weight.dtype)
    return torch.nn.Parameter(new, requires_grad=weight.requires_grad)


def grow_vocabulary(model, tokenizer: str | None) -> list[int]:
    """Give the base model rows for the tokens the run's tokenizer dir added; returns their ids.

    A vocabulary that already has spare rows (padded to a multiple) keeps its
    shape; otherwise the input embeddings, and an untied output head, grow to
    the tokenizer's size (`grow_rows`), and the config's `vocab_size` follows.
    """
    ids = added_token_ids(tokenizer) if tokenizer else []
    if ids:
        grow_rows(model, vocab_rows(tokenizer))
    return ids


def grow_rows(model, rows: int) -> None:
    """Grow the input embeddings, and an untied output head, to `rows` rows (`_grown`: each new row
    the mean of the existing ones); a model that has as many rows already is left as it is."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embedding.weight.shape[0] >= rows:
        return
    tied = head is not None and head.weight is embedding.weight
    embedding.weight = _grown(embedding.weight, rows)
    embedding.num_embeddings = rows
    if tied:
        head.weight = embedding.weight
    elif head is not None:
        head.weight = _grown(head.weight, rows)
    if head is not None:
        head.out_features = rows
    model.config.get_text_config().vocab_size = rows


def token_rows(model, ids: list[int]) -> dict[str, list[int]] | None:
    """peft `trainable_token_indices`: the added rows of the input embeddings, and of an untied head
    (a tied head shares the embedding's trained rows; peft ties them itself)."""
    if not ids:
        return None
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = {module_name(model, embedding): list(ids)}
    if head is not None and head.weight is not embedding.weight:
        rows[module_name(model, head)] = list(ids)
    return rows


def fp32_token_rows(model) -> None:
    """The trained token rows in fp32, as the LoRA weights: peft copies them in the base's dtype,
    and AdamW updates on bf16 weights lose the small steps (the forward casts them back)."""
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    for module in model.modules():
        if isinstance(module, TrainableTokensLayer) and not module.tied_adapter:
            for param in module.trainable_tokens_delta.values():
                param.data = param.data.float()
