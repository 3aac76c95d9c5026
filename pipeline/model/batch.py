"""Micro-batches of the token cache as the model takes them: padded, packed rows, or one flat row.

Labels carry `IGNORE_INDEX` on every position that is not supervised (prompts,
image tokens, padding). A `Batch` names, besides the model's inputs, the flat
positions whose next token carries a loss and those next tokens (computed here
on the CPU, so the loss picks them without a host sync).

Four layouts (`pipeline.planning.packing` decides which one a run trains with):
  padded  one row per record, right-padded to the longest (an attention mask
          only when there is padding: without one, SDPA can take its causal
          fast path). `TokenLoss` drops that mask for the text decoders of
          `MASK_FREE_FAMILIES` (see there why that is exact). Evaluation and
          vision-language training always use it; packed training falls back
          to it for a micro-batch whose rows hold one record each (nothing to
          keep apart: the same batch, and SDPA keeps its causal path).
  rows    packed rows: several records back to back in each row, `position_ids`
          restarting at 0 at each record and at the padding that fills the row
          to the widest (a record of its own that no loss reads), no attention
          mask. transformers then builds a block-causal mask from the position
          ids (SDPA, eager; flex_attention a document BlockMask).
  flat    every record of the micro-batch back to back in one row, no padding,
          `position_ids` restarting at each record and the boundaries given
          (`cu_seq_lens_q/k`, `max_length_q/k`): flash-attention's varlen kernel.
  records the same flat row with the boundaries as plain ints (`RECORD_BOUNDS`),
          for SDPA record by record on a CPU (`pipeline.model.packed_attention`),
          which then reads no tensor back.

A vision-language model's micro-batch is a padded one whose `inputs` also
carry the model's image inputs (`pixel_values`, Qwen2-VL's `image_grid_thw`
and `mm_token_type_ids`, Llama 3.2 Vision's `cross_attention_mask`): `Collator`
makes them from the records' image files with the model's processor
(`ImageText.inputs`), in a DataLoader worker when training
(`pipeline.train.batches`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.vision import ImageText

LAYOUTS = ("padded", "rows", "flat", "records")
PACKED = ("rows", "flat", "records")
RECORD_BOUNDS = "record_bounds"  # the model input: (0, end of record 1, end of record 2, ...) as ints


@dataclass(frozen=True)
class Batch:
    """One micro-batch, as `pipeline.model.loss.TokenLoss` takes it.

    `inputs`: the model's keyword inputs (input_ids; attention_mask when padded
    with padding present, which `TokenLoss` may leave out; position_ids when
    packed, and the sequence boundaries when flat). `loss_index`: flat
    positions (into rows x width) whose next token carries a loss, and
    `targets` that next token. `tokens` (non-padding tokens) and `supervised`
    are plain ints, known without looking at a device. `real`: 1 on the real
    tokens, 0 on the padding, for packed rows that have padding (which no
    attention mask marks); not a model input: a mixture of experts' load-balancing
    loss leaves that padding out with it (`real_tokens`).
    """

    inputs: dict[str, torch.Tensor | int]
    loss_index: torch.Tensor
    targets: torch.Tensor
    tokens: int
    real: torch.Tensor | None = None

    def real_tokens(self) -> torch.Tensor | None:
        """Which positions hold real tokens (rows x width, 1 or 0); None where every position does."""
        return self.real if self.real is not None else self.inputs.get("attention_mask")

    @property
    def supervised(self) -> int:
        return int(self.targets.numel())

    def to(self, device: torch.device) -> Batch:
        """The batch on `device`; on a GPU from pinned memory without blocking the host."""
        if device.type == "cpu":
            return self
        cuda = device.type == "cuda"

        def move(t):
            if not isinstance(t, torch.Tensor):
                return t  # a plain number (the longest packed sequence)
            return (t.pin_memory() if cuda else t).to(device, non_blocking=cuda)

        return replace(self, inputs={k: move(v) for k, v in self.inputs.items()},
                       loss_index=move(self.loss_index), targets=move(self.targets),
                       real=None if self.real is None else move(self.real))


def collate(cache, indices: list[int], pad_id: int, *, packed: bool = False) -> Batch:
    """The records `indices` of `cache` as one micro-batch: padded, or (`packed`) one flat row."""
    items = [cache[i] for i in indices]
    return _flat(items) if packed else _padded(items, pad_id)


def collate_rows(cache, rows: list[list[int]], pad_id: int, layout: str) -> Batch:
    """A packed micro-batch (`rows`: record indices of `cache` per row) in `layout` "rows", "flat" or
    "records" (see the module docstring); in "rows", rows of one record each are collated padded."""
    if layout not in PACKED:
        raise ValueError(f"not a packed layout: {layout!r}")
    if layout != "rows":
        return _flat([cache[i] for row in rows for i in row], bounds_as_ints=layout == "records")
    if all(len(row) == 1 for row in rows):
        return _padded([cache[row[0]] for row in rows], pad_id)
    return _rows([[cache[i] for i in row] for row in rows], pad_id)


def _padded(items, pad_id: int) -> Batch:
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    index, targets = [], []
    for row, (ids, lab) in enumerate(items):
        input_ids[row, :len(ids)] = ids
        mask[row, :len(ids)] = 1
        pos, tgt = _supervised(lab)
        index.append(pos + row * width)
        targets.append(tgt)
    inputs = {"input_ids": input_ids}
    if any(len(ids) < width for ids, _ in items):
        inputs["attention_mask"] = mask
    return Batch(inputs, torch.cat(index), torch.cat(targets), tokens=sum(len(ids) for ids, _ in items))


def _rows(rows, pad_id: int) -> Batch:
    width = max(sum(len(ids) for ids, _ in row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.empty((len(rows), width), dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    index, targets, tokens = [], [], 0
    for r, row in enumerate(rows):
        offset = 0
        for ids, lab in row:
            n = len(ids)
            input_ids[r, offset:offset + n] = ids
            position_ids[r, offset:offset + n] = torch.arange(n)
            pos, tgt = _supervised(lab)  # within one record: no target crosses into the next one
            index.append(pos + r * width + offset)
            targets.append(tgt)
            offset += n
        # The padding restarts its positions too: one more record to the mask builder, after the real
        # ones (so none of them attends to it), and never a loss position.
        position_ids[r, offset:] = torch.arange(width - offset)
        real[r, :offset] = 1
        tokens += offset
    return Batch({"input_ids": input_ids, "position_ids": position_ids}, torch.cat(index), torch.cat(targets),
                 tokens=tokens, real=real if tokens < real.numel() else None)


def _flat(items, *, bounds_as_ints: bool = False) -> Batch:
    input_ids = torch.cat([ids for ids, _ in items]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(len(ids)) for ids, _ in items]).unsqueeze(0)
    sizes = [len(ids) for ids, _ in items]
    edges = (0, *itertools.accumulate(sizes))
    if bounds_as_ints:
        varlen = {RECORD_BOUNDS: edges}
    else:
        # Flash-attention's varlen kernel takes the sequence boundaries as given; from position ids alone
        # transformers would work them out on the device and read them back (a host sync per layer).
        # Other attention implementations ignore these.
        bounds = torch.tensor(edges, dtype=torch.int32)
        longest = max(sizes)
        varlen = {"cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest, "max_length_k": longest}
    index, targets, offset = [], [], 0
    for ids, lab in items:
        pos, tgt = _supervised(lab)  # within one sequence: no target crosses into the next one
        index.append(pos + offset)
        targets.append(tgt)
        offset += len(ids)
    return Batch({"input_ids": input_ids, "position_ids": position_ids, **varlen}, torch.cat(index),
                 torch.cat(targets), tokens=offset)


def validation_collator(cfg, pad_id: int, images: ImageText | None) -> Collator | None:
    """The batch maker of a run's validation set (`cfg`: its `TrainConfig`): padded, the first
    `validation.max_records` records of the validation cache; None without one."""
    if not cfg.tokens.val_cache:
        return None
    from pipeline.data.cache import TokenCache

    return Collator(TokenCache(cfg.tokens.val_cache, records=cfg.validation.max_records), pad_id, images=images)


class Collator:
    """A micro-batch's records of a token cache -> one `Batch`, plus a vision-language model's image
    inputs: pixels made here from the records' image files (in their token order, record by
    record) and the inputs the model derives from the tokens (`ImageText`).

    `layout` "padded": a micro-batch is a list of record indices (`collate`);
    "rows" / "flat" / "records": a list of rows of record indices (`collate_rows`,
    the packed micro-batches of `pipeline.planning.packing.pack_update`).
    Picklable (the cache pickles by path), so DataLoader workers can run it and decode the
    images off the training loop. `cache` is the token cache it reads.
    """

    def __init__(self, cache, pad_id: int, *, layout: str = "padded", images: ImageText | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
        if layout != "padded" and images is not None:
            raise ValueError("packed micro-batches of a vision-language model are not supported")
        self.cache, self.pad_id, self.layout, self.images = cache, pad_id, layout, images

    @property
    def packed(self) -> bool:
        return self.layout != "padded"

    def __call__(self, micro_batch: list) -> Batch:
        if self.packed:
            return collate_rows(self.cache, micro_batch, self.pad_id, self.layout)
        batch = collate(self.cache, micro_batch, self.pad_id)
        if self.images is None:
            return batch
        extra = self.images.inputs(batch.inputs["input_ids"], [self.cache.images(i) for i in micro_batch])
        return replace(batch, inputs={**batch.inputs, **extra})


def _supervised(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of one sequence whose next token is supervised, and those next tokens."""
    nxt = labels[1:]
    pos = torch.nonzero(nxt != IGNORE_INDEX).flatten()
    return pos, nxt[pos]
