"""Token-budget micro-batches: an update's records packed into rows, and the attention path that keeps
them apart.

With packing (`tokens.packing`, on by default for text models wherever it is
exact: `decide`) an update trains on the same records as without, drawn by the
same order (`pipeline.planning.order`); only their layout changes:

1. the update's global batch is packed by best-fit decreasing into rows of at
   most `capacity` tokens, the longest record of the training data (so no row is
   longer than a padded micro-batch's, and the memory estimate of
   `optim.micro_batch` x that length still bounds a micro-batch);
2. the rows, longest first, are cut into the update's micro-batches: as many
   as padded batches have (global_batch / micro_batch, rounded up), in runs of
   rows whose counts differ by at most one, so each holds at most
   `optim.micro_batch` rows (at most micro_batch x capacity tokens, however many
   records that is) and rows of similar width sit together. The longest come
   first, so an out-of-memory shows in the update's first micro-batch;
3. the micro-batches are dealt to the ranks as padded ones are (micro-batch j
   to rank j % world), so every rank runs as many (FSDP gathers the weights in
   every forward: all ranks must) and what a micro-batch holds does not depend on
   the number of ranks: 1 process, 2 ranks and 2 nodes compute the same
   micro-batches, and a run is bitwise the same wherever the sums meet in the
   same order (as for padded batches). Packing changes what a micro-batch holds,
   never how many an update has.

Every step is a pure function of the update's record indices and their lengths:
a chunked, resumed or preempted run packs each update exactly as one
uninterrupted run does. The loss is still normalized by the supervised tokens
of the whole global batch (the same records), so packing changes only the
order of the sums.

Inside a row, position ids restart at 0 at each record, and at the padding
that fills a row to the micro-batch's width (its own "record", which no loss
reads); the records must not see each other. The attention path (`PATHS`):
  flat    flash-attention's varlen kernel: the whole micro-batch as one row,
          no padding at all, the records' boundaries given (cu_seq_lens);
          also SDPA on a GPU with `tokens.torch_varlen`, through torch's own
          varlen kernel, for the same models as `records` (`GPU_VARLEN`);
  records the same flat row for SDPA on a CPU, run record by record with its
          causal kernel (`pipeline.model.packed_attention`), for the models
          that can run without any mask (`CPU_SDPA`);
  rows    SDPA, eager, flex_attention: transformers builds a block-causal mask
          (flex: a document BlockMask) from the position ids when no attention
          mask is given and no KV cache is used (`masking_utils.
          find_packed_sequence_indices`, transformers 5.17 and 5.24 alike).
          That mask is (width x width) per row, so rows stay at most
          `capacity` wide: the attention costs no more than a padded row's.
Packing is exact where the model builds its mask from those position ids
(`PACKABLE_FAMILIES`, each checked by tests/train/test_packing.py against the
records run one by one) and the implementation is one of `PATHS`. Elsewhere
(vision-language models, whose image inputs and position ids, Qwen2-VL's 3-D
ones, are per record; other families; other kernels) micro-batches stay padded.

No torch here: the plan runs this to print the path and the padding it saves.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.errors import UserError
from pipeline.planning.order import padding_fraction

# Decoder families (`config.model_type`) whose masks come from `create_causal_mask` /
# `create_sliding_window_causal_mask` with the position ids, and whose positions are the given
# ones: per-record losses of packed rows equal the records' own (tests/train/test_packing.py).
# Mixture-of-experts families route each token on its own; their load-balancing loss is given the
# real tokens of a packed row (`Batch.real_tokens`), as a padded batch's mask gives them. GPT-OSS builds
# its masks without the position ids: `pipeline.model.row_masks` builds them for it. Not listed:
# linear-attention and Mamba hybrids (their recurrences run across the records of a row), DeepSeek V4
# (its compressed attention pools across positions), and any family not checked.
PACKABLE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
                               "olmo2", "olmo3", "smollm3", "gemma4_text", "granite", "exaone4", "ernie4_5",
                               "seed_oss", "apertus", "hunyuan_v1_dense", "ministral", "ministral3", "glm", "glm4",
                               "arcee", "cohere2", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe",
                               "gpt_oss",
                               # checked on transformers 5.24's families of 2026 and the older ones people still
                               # tune (Phi-2, StarCoder2, StableLM, InternLM3, Qwen2-MoE, GraniteMoE, ...)
                               "gemma4_unified_text", "apertus1p5_text", "hy_v3", "hy_v4", "laguna", "cohere2_moe",
                               "exaone_moe", "kolibri1", "jais2", "mellum", "helium", "nanochat", "cwm",
                               "hyperclovax", "dory", "beam", "iquestcoder", "solar_open", "granite_swa",
                               "vaultgemma", "phi", "starcoder2", "stablelm", "internlm3", "qwen2_moe",
                               "ernie4_5_moe", "granitemoe", "minimax_m2", "flex_olmo"})

# attention implementation -> (layout, what keeps packed records apart)
PATHS = {
    "flash_attention_2": ("flat", "flash-attention varlen kernel (one row per micro-batch, no padding; record "
                                  "boundaries given as cu_seq_lens)"),
    "flash_attention_3": ("flat", "flash-attention 3 varlen kernel (one row per micro-batch, no padding; record "
                                  "boundaries given as cu_seq_lens)"),
    "flex_attention": ("rows", "flex_attention with a document mask (the BlockMask transformers builds from the "
                               "position ids)"),
    "sdpa": ("rows", "SDPA with a block-causal mask (transformers builds it from the position ids)"),
    "eager": ("rows", "eager attention with a block-causal mask (transformers builds it from the position ids)"),
}

# SDPA on a CPU, for a model that can attend without any mask (`pipeline.model.packed_attention`):
# its causal kernel record by record computes each record's lower triangle only, where the
# block-causal mask of a row makes the CPU kernel compute every pair of the row.
CPU_SDPA = ("records", "SDPA's causal kernel record by record (one flat row per micro-batch, no padding, no mask; "
                    "pipeline.model.packed_attention)")

# The same flat row on a GPU through torch's own flash-attention varlen kernel (tokens.torch_varlen).
GPU_VARLEN = ("flat", "torch's flash-attention varlen kernel (tokens.torch_varlen: one flat row per micro-batch, no "
                      "padding, no mask; record boundaries given as cu_seq_lens; pipeline.model.packed_attention)")

# What the rows' `why` adds on a GPU where that flat row would fit but tokens.torch_varlen is off: the
# measured case for it (an H200, Llama-3.2-1B LoRA, one micro-batch of 16 records per update).
VARLEN_HINT = ("; tokens.torch_varlen=true would train one flat row per micro-batch without the mask: 1.6x the "
               "tokens/s at 2048 tokens and 2x at 4096 on an H200 (bench/results/gpu_check.md)")

# The plan's padding report counts the run's first updates, at most this many.
REPORT_UPDATES = 1000


@dataclass(frozen=True)
class Packing:
    """How a run's text micro-batches are laid out: `layout` "rows", "flat" or "records" (packed, see the
    module docstring), or None (padded micro-batches of records); `why` says the attention path,
    or why micro-batches stay padded; `per_record`: the model must switch to attending record by
    record for it (`pipeline.model.packed_attention.use`)."""

    layout: str | None
    why: str
    per_record: bool = False

    @property
    def on(self) -> bool:
        return self.layout is not None

    def text(self) -> str:
        return f"packing: {'on, ' if self.on else 'off: '}{self.why}"


# Layer kinds (a config's `layer_types` / `layers_block_type` values) whose state runs from token to token
# across a packed row's records, and families made of such layers alone
_RECURRENT_KINDS = {"linear_attention": "linear-attention", "mamba": "Mamba", "conv": "short-convolution",
                    "recurrent": "recurrent"}
_RECURRENT_FAMILIES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv", "xlstm", "recurrent_gemma"})


def recurrent_layers(config) -> str | None:
    """The kinds of layers of a transformers `config` (a vision-language model's text config) that carry state
    from one token to the next, as words ("linear-attention", "Mamba"), or None where it has none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = [*(getattr(text, "layer_types", None) or ()), *(getattr(text, "layers_block_type", None) or ())]
    found = sorted({_RECURRENT_KINDS[k] for k in kinds if k in _RECURRENT_KINDS})
    if not found and getattr(text, "model_type", None) in _RECURRENT_FAMILIES:
        found = ["recurrent"]
    return " and ".join(found) or None


def decide(setting: str, *, implementation: str, model_type: str | None, vision_language: bool,
           device: str = "cuda", per_record: bool = False, where: str = "the model",
           recurrent: str | None = None, varlen: bool = False, varlen_unfit: str | None = None) -> Packing:
    """`tokens.packing` resolved for a model (see the module docstring for where packing is exact).

    auto: packed where exact, padded elsewhere; on: packed, UserError where it
    cannot keep records apart (a vision-language model, an attention
    implementation transformers builds no mask for), a warning in `why` for a
    family not checked; off: padded. `implementation` is the attention
    implementation the model runs (the resolved one, not `auto`); `device` the
    type of the training device; `per_record`: the model can attend record by
    record without a mask (`pipeline.model.packed_attention.runs_per_record`),
    which SDPA then does on a CPU (`CPU_SDPA`); `where` names the model in an error; `recurrent`:
    its layers that carry state across tokens (`recurrent_layers`), which no mask keeps apart;
    `varlen`: `tokens.torch_varlen` is on, so SDPA on a GPU runs a model that attends record by record
    through torch's varlen kernel (`GPU_VARLEN`), unless `varlen_unfit` says why it cannot
    (`pipeline.model.packed_attention.varlen_fits`), which the rows' `why` then adds; off, the rows' `why`
    on a GPU says what it would gain where it would fit (`VARLEN_HINT`).
    """
    setting, implementation = str(setting), str(implementation)
    if setting == "off":
        return Packing(None, "tokens.packing=off (padded micro-batches of optim.micro_batch records)")
    if recurrent:
        why = f"its {recurrent} layers carry their state from one record of a packed row into the next"
        if setting == "on":
            raise UserError(f"tokens.packing=on: {where}: {why}, which no attention mask stops; use "
                            "tokens.packing=auto or off")
        return Packing(None, why + " (padded micro-batches)")
    if vision_language:
        why = "a vision-language model: its image inputs and position ids (Qwen2-VL's 3-D ones) are per record"
        if setting == "on":
            raise UserError(f"tokens.packing=on: {where} is {why}, so its micro-batches are not packed; use "
                            "tokens.packing=auto or off")
        return Packing(None, why + " (padded micro-batches)")
    if implementation not in PATHS:
        why = f"attention implementation {implementation!r} has no known way to keep packed records apart"
        if setting == "on":
            raise UserError(f"tokens.packing=on: {why}; use one of {sorted(PATHS)} or tokens.packing=off")
        return Packing(None, why + " (padded micro-batches)")
    layout, path = PATHS[implementation]
    if model_type not in PACKABLE_FAMILIES:
        if setting == "auto":
            return Packing(None, f"model family {model_type!r} is not checked for packing (padded micro-batches; "
                                 "tokens.packing=on packs it anyway)")
        path += f"; model family {model_type!r} not checked for packing (tokens.packing=on)"
    elif implementation == "sdpa" and device == "cpu" and per_record:
        return Packing(*CPU_SDPA, per_record=True)
    elif implementation == "sdpa" and varlen:
        if per_record and not varlen_unfit:
            return Packing(*GPU_VARLEN, per_record=True)
        path += (f"; tokens.torch_varlen not used: "
                 f"{varlen_unfit or 'the model does not attend record by record without a mask'}")
    elif implementation == "sdpa" and device == "cuda" and per_record and not varlen_unfit:
        path += VARLEN_HINT
    return Packing(layout, path)


def row_capacity(lengths: np.ndarray) -> int:
    """Tokens a packed row holds at most: the longest record of the training data (its `lengths`),
    at most data.max_length. The plan and the trainer both derive it here."""
    return int(lengths.max())


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Positions 0..n-1 of `lengths` packed into rows of at most `capacity` tokens.

    Longest first (ties: lower position first); each goes into the row with the
    least room that still fits it (ties: the older row), or a new row. Rows are
    returned in the order they were opened, each with its positions in the order
    placed. ValueError if a length exceeds `capacity`.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens free, row number), sorted: best fit = first with enough room
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"a record of {n} tokens does not fit a row of {capacity}")
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, row = room.pop(k)
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        bisect.insort(room, (free - n, row))
    return rows


def pack_update(indices: Sequence[int], lengths: np.ndarray, *, capacity: int, world: int,
                micro: int) -> list[list[list[list[int]]]]:
    """One update's records `indices` as packed micro-batches: [rank][micro-batch][row] -> record indices.

    See the module docstring. The update has as many micro-batches as padded
    (`len(indices) / micro`, rounded up), dealt to the ranks as padded ones are:
    micro-batch j to rank j % `world`, so they are the same for any `world` that
    divides their count. Each holds 1..`micro` rows of at most `capacity` tokens;
    every record of `indices` is in exactly one row. `lengths[i]` is record i's tokens.
    """
    sizes = [int(lengths[i]) for i in indices]
    rows = best_fit_decreasing(sizes, capacity)
    places = max(1, -(-len(indices) // micro))
    if places % world:
        raise ValueError(f"{places} micro-batches per update do not split over {world} ranks")
    # Every micro-batch needs a row: split rows (the one with the most records gives up its last,
    # shortest one) until there are enough. Always possible: there are at least `places` records.
    while len(rows) < places:
        fullest = max(range(len(rows)), key=lambda r: (len(rows[r]), -r))
        rows.append([rows[fullest].pop()])
    rows.sort(key=lambda row: (-sum(sizes[p] for p in row), row[0]))  # positions are unique: a total order
    micro_batches = _cut([[int(indices[p]) for p in row] for row in rows], places)
    return [micro_batches[rank::world] for rank in range(world)]


def _cut(rows: list, parts: int) -> list[list]:
    """`rows` in order, cut into `parts` runs whose sizes differ by at most one (the larger first)."""
    size, extra = divmod(len(rows), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (p < extra)
        out.append(rows[start:end])
        start = end
    return out


def computed_tokens(micro_batch: list[list[int]], lengths: np.ndarray, layout: str) -> int:
    """Tokens a packed micro-batch computes, padding included: its rows padded to the widest
    ("rows"), or its tokens alone (one flat row: "flat", "records")."""
    widths = [int(lengths[row].sum()) for row in micro_batch]
    return len(widths) * max(widths) if layout == "rows" else sum(widths)


def padding_report(sampler, lengths: np.ndarray, steps: range, *, capacity: int, world: int, micro: int,
                   layout: str) -> dict:
    """Padding / tokens computed over updates `steps` (all ranks), padded micro-batches ("before":
    `sampler.rank_micro_batches`, what `tokens.packing=off` trains on) against packed ones ("after")."""
    real = computed = 0
    for step in steps:
        for share in pack_update(sampler.global_indices(step), lengths, capacity=capacity, world=world, micro=micro):
            for mb in share:
                real += sum(int(lengths[row].sum()) for row in mb)
                computed += computed_tokens(mb, lengths, layout)
    before = padding_fraction(sampler, lengths, steps, micro=micro, world=world)
    return {"before": before, "after": 1.0 - real / max(computed, 1), "updates": len(steps), "world": world}
