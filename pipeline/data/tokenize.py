"""Tokenize conversations with a chat template, masking all but the assistant turns.

How a record becomes tokens and labels (the chat template's render, its
supervised spans mapped to tokens) is `pipeline.data.spans`; here the
too-long and duplicates policies, the stats, and the cache. A file is streamed: its
records are read one at a time (`formats.stream_file`; a JSON array is the
exception, parsed whole), encoded a batch at a time (`SplitEncoder`) and
appended to the cache on disk (`cache.CacheWriter`), so memory holds one batch
plus 8 bytes a record (its length) and, under ``duplicates: drop``, 24 bytes a
distinct conversation (`stream.DigestIndex`), whatever the file's size.

Vision-language models (`pipeline.data.vision`): the messages are rendered as
content parts with the processor's chat template, and every image token the
template writes is expanded to the processor's replacement for that image
before tokenizing. Image
tokens sit in user turns (validation refuses a placeholder anywhere else) and
are unsupervised whatever the template does. The cache also records each
record's image paths; `too_long=truncate` drops, instead of cutting, a record
whose image tokens would not all survive (counted as ``dropped_image_cut``).

With ``duplicates: drop`` the exact-duplicate conversations of a file (every
occurrence after the first, see `formats.duplicate_of`) are removed before
tokenizing, so the cache holds each conversation once; under ``error`` /
``warn`` every record is kept (rejecting duplicates is validation's job).

Outputs: one cache per split (see `pipeline.data.cache`) and ``stats.json``:
``{"tokenizer", "tokenizer_fingerprint", "max_length", "too_long", "duplicates",
"splits": {"train": {...}, "val": {...}}}`` where each split has ``cache``,
``source``, ``source_sha256``, ``records_in`` (records in the file), ``records``,
``turns``, ``assistant_turns``, ``untrained_turns`` (assistant turns the data marks ``"weight": 0``),
``tokens``, ``supervised_tokens``, ``tokens_per_record``
(p50 / p90 / p99 / max / mean, after truncation), ``max_tokens_before_truncation``,
``too_long``, ``truncated``, ``dropped``, ``dropped_unsupervised``, ``duplicates_dropped``, the chat
counts `CHAT_COUNTS` (``eot_trained``, ``reasoning_records``, ``reasoning_dropped``,
``reasoning_dropped_by_template``, ``placeholders_trained``, ``stop_tokens_inside``,
``markers_in_prompts``: records, see `encode_records`, `chat_findings` and
`chat.Rendered`), and for a vision-language model
``images`` and ``dropped_image_cut``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.cache import IGNORE_INDEX, CacheWriter
from pipeline.data.chat import Rendered, builtin_names, record_name
from pipeline.data.spans import _encode, _label_batch, _renderer, chat_render, render  # noqa: F401 (render: here too)
from pipeline.data.formats import DUPLICATE_POLICIES, Record, format_problems, stream_file
from pipeline.data.shapes import FieldMap
from pipeline.data.stream import DigestIndex, batched, sample_digest
from pipeline.data.vision import ImageText, is_vision_language, load_image_text
from pipeline.errors import DataError, UserError

TOO_LONG_POLICIES = ("error", "truncate", "drop")
BATCH_SIZE = 2048

# Files that define a tokenizer's behaviour; weights and model config are left out.
_TOKENIZER_FILE_PREFIXES = (
    "tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges", "spiece", "sentencepiece",
    "preprocessor_config", "processor_config",  # a vision-language processor: how images expand into tokens
    "generation_config",  # the model's stop tokens, which end a trained turn (`pipeline.data.turns.model_stops`)
)


# --- the tokenizer --------------------------------------------------------------------------------


def load_tokenizer(tokenizer_dir: str | Path):
    """`AutoTokenizer.from_pretrained(tokenizer_dir)`; a `UserError` if it fails or has no chat template."""
    if not Path(tokenizer_dir).is_dir():
        # Checked here: given a missing path, transformers would try the Hub and blame the repo id.
        raise UserError(f"tokenizer directory not found: {tokenizer_dir}")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as err:  # transformers raises many types for a bad dir
        raise UserError(f"cannot load a tokenizer from {tokenizer_dir}: {err}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer in {tokenizer_dir} has no chat template (a base model?): set "
                        f"data.chat_template to a built-in template ({builtin_names()}) or a .jinja file")
    return tokenizer


def load_chat(model_dir: str | Path) -> tuple[object, ImageText | None]:
    """(tokenizer, the processor's `ImageText` for a vision-language model, else None)."""
    if Path(model_dir).is_dir() and is_vision_language(model_dir):
        images = load_image_text(model_dir)
        return images.tokenizer, images
    return load_tokenizer(model_dir), None


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """sha256 over the names and bytes of the tokenizer's files (not the weights)."""
    digest = hashlib.sha256()
    files = sorted(
        p for p in Path(tokenizer_dir).iterdir()
        if p.is_file() and p.name.lower().startswith(_TOKENIZER_FILE_PREFIXES)
    )
    if not files:
        raise UserError(f"no tokenizer files in {tokenizer_dir}")
    for p in files:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


# The chat counts a warning names the first finding of (`chat_findings`).
FOUND = ("placeholders_trained", "stop_tokens_inside", "markers_in_prompts")
# Per-record facts of the training render that validation, tokenization and the label view count.
CHAT_COUNTS = ("eot_trained", "reasoning_records", "reasoning_dropped", "reasoning_dropped_by_template", *FOUND)
# Code in a reply (a fenced block, an inline span): a template there is an answer, not a placeholder left open.
_CODE = re.compile(r"(```|~~~).*?(?:\1|\Z)|`[^`\n]*`", re.DOTALL)
# `{{name}}` / `{{ name }}` not written as part of LaTeX (`\frac{{a}}`, `x^{{n}}`) or a longer brace run.
_PLACEHOLDER = re.compile(r"(?<![\w\\^_{])\{\{\s*([A-Za-z_]\w*)\s*\}\}(?!\})")


def trained_placeholder(rendered: Rendered) -> str:
    """The first `{{name}}` placeholder the trained text of `rendered` holds outside code ('' if none):
    what a dataset meant to be filled in before training (LLaMA-Factory's identity data: ``{{name}}``,
    ``{{author}}``) and would teach the model to write as it stands."""
    trained = "\n".join(rendered.text[lo:hi] for lo, hi in rendered.spans)
    found = _PLACEHOLDER.search(_CODE.sub(" ", trained)) if "{{" in trained else None
    return found.group() if found else ""


def chat_findings(rendered: Rendered) -> dict[str, str]:
    """What one record holds, by the `FOUND` count it makes: the unfilled placeholder trained
    (`trained_placeholder`), the stop token inside a trained reply (`Rendered.stop_inside`), the template's
    turn marker in a prompt (`Rendered.marked_prompt`); the first of each kind, only those it holds."""
    found = (trained_placeholder(rendered), next(filter(None, rendered.stop_inside), ""), rendered.marked_prompt)
    return {name: what for name, what in zip(FOUND, found) if what}


def chat_flags(rendered: Rendered) -> tuple[bool, ...]:
    """One record's `CHAT_COUNTS`: every end-of-turn marker trained; reasoning in the data; any of it
    not trained (the policy or the template dropped it); the template dropped some; then whether it makes
    each `FOUND` count (`chat_findings`)."""
    found = chat_findings(rendered)
    return (all(rendered.eot), rendered.reasoning > 0, rendered.reasoning_dropped > 0,
            bool(rendered.dropped_by_template), *(name in found for name in FOUND))


def sequence_lengths(tokenizer, records: list[Record], images: ImageText | None = None, *,
                     reasoning: str = "auto", found: dict | None = None
                     ) -> tuple[np.ndarray, dict[int, str], np.ndarray]:
    """(tokens in each record as trained (image tokens expanded), -1 where it fails; {position: error};
    bool [records, len(CHAT_COUNTS)]: each record's `chat_flags`, all False where it fails). `found`, if
    given, gets {position: `chat_findings`} of the records that hold any.

    The flags come from the same training render the lengths do, so validation
    counts exactly what tokenization will.
    """
    chat = chat_render(tokenizer, images, reasoning=reasoning)
    lengths = np.full(len(records), -1, dtype=np.int64)
    flags = np.zeros((len(records), len(CHAT_COUNTS)), dtype=bool)
    errors: dict[int, str] = {}
    for start in range(0, len(records), BATCH_SIZE):
        batch = records[start:start + BATCH_SIZE]
        rendered, failed = chat.render_records(batch, _renderer(chat))
        errors.update({start + i: msg for i, msg in failed.items()})
        ok = [i for i, r in enumerate(rendered) if r is not None]
        if ok:
            ids = _encode(tokenizer, [rendered[i].text for i in ok])["input_ids"]
            lengths[[start + i for i in ok]] = [len(x) for x in ids]
            flags[[start + i for i in ok]] = [chat_flags(rendered[i]) for i in ok]
            if found is not None:
                found.update({start + i: chat_findings(rendered[i]) for i in ok
                              if flags[start + i, -len(FOUND):].any()})
    return lengths, errors, flags


def chat_counts_text(stats: dict) -> str:
    """'end-of-turn trained in 96 of 96 records, reasoning in 0 (not trained in 0, by the template 0)'."""
    dropped = stats.get("reasoning_dropped", 0)
    by_template = stats.get("reasoning_dropped_by_template", 0)
    return (f"end-of-turn trained in {stats.get('eot_trained', 0)} of {stats.get('records', 0)} records, "
            f"reasoning in {stats.get('reasoning_records', 0)} (not trained in {dropped}: "
            f"{dropped - by_template} by data.reasoning=drop, {by_template} by the template)")



# --- one split ------------------------------------------------------------------------------------


@dataclass
class EncodedSplit:
    """A split's flat arrays (the cache tensors) and its statistics."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    stats: dict
    images: list[list[str]] | None = None  # per kept record, its image paths (vision-language models)


def encode_records(
    records: list[Record], tokenizer, *, max_length: int, too_long: str, source: str = "",
    images: ImageText | None = None, reasoning: str = "auto",
) -> EncodedSplit:
    """Tokenize and label `records`, applying the too-long policy.

    ``error`` raises `DataError` naming the over-long records; ``truncate``
    keeps the first `max_length` tokens; ``drop`` removes the record. A
    truncated record left with no supervised token is dropped too (it would
    teach nothing) and counted as ``dropped_unsupervised``; so is one whose
    truncation would cut its image tokens (``dropped_image_cut``). `images`:
    the processor of a vision-language model (see the module docstring).
    `reasoning`: `pipeline.data.chat.REASONING_POLICIES`. The stats count, over
    the kept records, those with reasoning in the data (``reasoning_records``),
    those with any of it not trained (``reasoning_dropped``; by the template
    itself: ``reasoning_dropped_by_template``), and those whose every
    end-of-turn marker is trained (``eot_trained``).

    All in memory; `SplitEncoder` is the same batch by batch into a `CacheWriter`.
    """
    sink = _Arrays()
    encoder = SplitEncoder(tokenizer, sink, max_length=max_length, too_long=too_long, source=source, images=images,
                           reasoning=reasoning)
    for start in range(0, len(records), BATCH_SIZE):
        encoder.add(records[start:start + BATCH_SIZE])
    stats = encoder.finish()
    return EncodedSplit(*sink.arrays(), stats, sink.images if images is not None else None)


class _Arrays:
    """A `CacheWriter` stand-in that keeps the batches in memory (`encode_records`)."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.images: list[list[str]] = []

    def append(self, input_ids, labels, lengths, images=None) -> None:
        self.ids.append(input_ids)
        self.labels.append(labels)
        self.lengths.append(lengths)
        self.images += images or []

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        def joined(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        lengths = joined(self.lengths, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return joined(self.ids, np.int32), joined(self.labels, np.int32), offsets


class SplitEncoder:
    """Tokenize and label a split batch by batch (`add`), handing each batch's kept records to `sink`
    (``sink.append(input_ids, labels, lengths, images)``: a `CacheWriter`); `finish` gives the stats.

    What it keeps between batches is running counts and one length per kept
    record (the exact percentiles of ``tokens_per_record``), so a split of any
    size is encoded in bounded memory. The policies are `encode_records`'.
    """

    def __init__(self, tokenizer, sink, *, max_length: int, too_long: str, source: str = "",
                 images: ImageText | None = None, reasoning: str = "auto"):
        self.chat = chat_render(tokenizer, images, reasoning=reasoning)
        if too_long not in TOO_LONG_POLICIES:
            raise UserError(f"too_long must be one of {', '.join(TOO_LONG_POLICIES)}, not {too_long!r}")
        self.sink, self.max_length, self.too_long, self.source, self.images = sink, max_length, too_long, source, images
        self.over: list[str] = []
        self.counts = {"too_long": 0, "truncated": 0, "dropped": 0, "dropped_unsupervised": 0}
        if images is not None:
            self.counts["dropped_image_cut"] = 0
        self.kept_lengths: list[np.ndarray] = []
        self.kept_index: list[np.ndarray] = []  # file index of each kept record (a shard's merge puts them in order)
        self.records_in = self.turns = self.assistant_turns = self.untrained_turns = 0
        self.tokens = self.supervised = self.raw_max = 0
        self.image_count = 0
        self.chat_counts = dict.fromkeys(CHAT_COUNTS, 0)

    def add(self, batch: list[Record]) -> None:
        """Encode one batch; a template failure raises `DataError` naming its record."""
        if not batch:
            return
        images, max_length, counts = self.images, self.max_length, self.counts
        self.records_in += len(batch)
        tokens, labels, rendered = _label_batch(self.chat, batch, self.source, images)
        lengths = tokens.lengths
        self.raw_max = max(self.raw_max, int(lengths.max(initial=0)))
        too_long_rec = lengths > max_length
        counts["too_long"] += int(too_long_rec.sum())
        if self.too_long == "error":
            self.over += [(batch[b].index, f"{record_name(self.source, batch[b])}: {lengths[b]} tokens")
                          for b in np.flatnonzero(too_long_rec)]
            if self.over:
                return  # keep scanning so the error lists every offender
        keep = ~too_long_rec if self.too_long == "drop" else np.ones(len(batch), dtype=bool)
        token_record = np.repeat(np.arange(len(batch)), lengths)
        position = np.arange(tokens.ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        kept_tokens = position < max_length
        supervised = np.bincount(token_record[kept_tokens], weights=labels[kept_tokens] != IGNORE_INDEX,
                                 minlength=len(batch))
        unsupervised = keep & (supervised == 0)
        keep &= ~unsupervised
        cut = np.zeros(len(batch), dtype=bool)
        if images is not None:  # an image is all of its tokens or none: never cut one
            is_image = tokens.ids == images.image_token_id
            cut = keep & (np.bincount(token_record[kept_tokens & is_image], minlength=len(batch))
                          < np.bincount(token_record[is_image], minlength=len(batch)))
            keep &= ~cut
            counts["dropped_image_cut"] += int(cut.sum())
        kept_tokens &= keep[token_record]
        counts["dropped"] += int((too_long_rec & ~keep & ~unsupervised & ~cut).sum())
        counts["dropped_unsupervised"] += int(unsupervised.sum())
        counts["truncated"] += int((too_long_rec & keep).sum())
        kept_labels = labels[kept_tokens].astype(np.int32)
        kept_lengths = np.minimum(lengths[keep], max_length)
        kept_images = [batch[b].images for b in np.flatnonzero(keep)] if images is not None else None
        self.sink.append(tokens.ids[kept_tokens].astype(np.int32), kept_labels, kept_lengths, kept_images)
        self.kept_lengths.append(kept_lengths)
        self.kept_index.append(np.array([batch[b].index for b in np.flatnonzero(keep)], dtype=np.int64))
        self.tokens += int(kept_lengths.sum())
        self.supervised += int((kept_labels != IGNORE_INDEX).sum())
        self.image_count += sum(map(len, kept_images or []))
        for b in np.flatnonzero(keep):
            self.turns += len(batch[b].messages)
            self.assistant_turns += sum(m["role"] == "assistant" for m in batch[b].messages)
            self.untrained_turns += sum(m.get("weight") == 0 for m in batch[b].messages)
            for key, flag in zip(CHAT_COUNTS, chat_flags(rendered[b])):
                self.chat_counts[key] += flag

    def counters(self) -> dict:
        """What `split_stats` makes the stats of (besides the kept records' lengths); shards' counters add up."""
        return {"records_in": self.records_in, "turns": self.turns, "assistant_turns": self.assistant_turns,
                "untrained_turns": self.untrained_turns,
                "tokens": self.tokens, "supervised_tokens": self.supervised, "max_tokens_before_truncation": self.raw_max,
                **self.counts, **self.chat_counts, **({"images": self.image_count} if self.images is not None else {}),
                "over": self.over}

    def finish(self) -> dict:
        """The split's stats; `DataError` listing the over-long records under too_long=error."""
        lengths = np.concatenate(self.kept_lengths) if self.kept_lengths else np.zeros(0, dtype=np.int64)
        return split_stats(self.counters(), lengths, source=self.source, max_length=self.max_length)


def split_stats(counters: dict, lengths: np.ndarray, *, source: str, max_length: int) -> dict:
    """A split's stats from its `SplitEncoder.counters` (one encoder's, or every shard's summed) and the token
    count of each kept record; `DataError` listing the over-long records (`counters["over"]`, (index, text)) first."""
    over = [text for _, text in sorted(counters["over"], key=lambda entry: entry[0])]
    if over:
        raise DataError(
            f"{len(over)} record(s) of {source} exceed max_length={max_length} (policy 'error'):\n  "
            + "\n  ".join(over[:20]) + (f"\n  ... and {len(over) - 20} more" if len(over) > 20 else "")
        )
    c = counters
    stats = {
        "records_in": c["records_in"],
        "records": int(lengths.size),
        "turns": c["turns"],
        "assistant_turns": c["assistant_turns"],
        "untrained_turns": c["untrained_turns"],
        "tokens": c["tokens"],
        "supervised_tokens": c["supervised_tokens"],
        "tokens_per_record": _percentiles(lengths),
        "max_tokens_before_truncation": c["max_tokens_before_truncation"],
        **{key: c[key] for key in ("too_long", "truncated", "dropped", "dropped_unsupervised")},
        **({"dropped_image_cut": c["dropped_image_cut"]} if "dropped_image_cut" in c else {}),
        **{key: c.get(key, 0) for key in CHAT_COUNTS},  # a part by an older version lacks the later ones
    }
    if "images" in c:
        stats["images"] = c["images"]
    return stats


def _percentiles(lengths: np.ndarray) -> dict:
    if lengths.size == 0:
        return {"p50": 0, "p90": 0, "p99": 0, "max": 0, "mean": 0.0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": int(lengths.max()),
            "mean": round(float(lengths.mean()), 2)}


def tokenize_file(
    path: str | Path, tokenizer, *, out_path: str | Path, max_length: int, too_long: str, fingerprint: str, split: str,
    duplicates: str = "error", images: ImageText | None = None, reasoning: str = "auto",
    fields: FieldMap | None = None, drop: np.ndarray | None = None,
) -> dict:
    """Read, tokenize and cache one dataset file, streamed; returns its stats (also stored in the cache metadata).

    ``duplicates="drop"`` removes exact-duplicate conversations first (counted
    as ``duplicates_dropped``): those of `drop` (record indices: validation's
    ``--out-drop``, found across shards) when given, else found here. Raises `DataError` if no record is left.
    `images`: a vision-language model's processor; the cache then holds each
    record's image paths too. `fields`: the dataset's own key and role names.

    Records stream from the file in batches and each batch's tokens go to the
    cache's spool files (`CacheWriter`): memory holds one batch, a length per
    record and a 24-byte digest per distinct conversation (``drop``), never
    the split. A file with problems fails as `load_records` would (every
    problem listed, before any encoding error), and nothing is written.
    """
    path = Path(path)
    with CacheWriter(out_path) as writer:
        parsed, encoder, records_in, kept, failed = encode_file(
            path, tokenizer, writer, max_length=max_length, too_long=too_long, duplicates=duplicates, images=images,
            reasoning=reasoning, fields=fields, drop=drop)
        if parsed.problems:
            raise DataError(format_problems(parsed.problems, header=f"{path} is not a valid dataset"))
        if failed is not None:
            raise failed
        encoded = encoder.finish()
        if encoded["records"] == 0:
            copies = f"dropping {records_in - kept} duplicate(s) and " if kept < records_in else ""
            raise DataError(f"{path}: no records left after {copies}applying too_long={too_long!r} "
                            f"at max_length={max_length}")
        stats = {"source": str(path), "source_sha256": parsed.sha256, **encoded,
                 "records_in": records_in, "duplicates_dropped": records_in - kept}
        writer.close({
            "split": split,
            "source": str(path),
            "source_sha256": parsed.sha256,
            "tokenizer_fingerprint": fingerprint,
            "max_length": str(max_length),
            "too_long": too_long,
            "duplicates": duplicates,
            "reasoning": reasoning,
            "records": str(encoded["records"]),
            "supervised_tokens": str(encoded["supervised_tokens"]),
        })
    return stats


def encode_file(path: Path, tokenizer, sink, *, max_length: int, too_long: str, duplicates: str,
                images: ImageText | None, reasoning: str, fields: FieldMap | None, drop: np.ndarray | None = None,
                owns=None) -> tuple:
    """Encode the records of `path` (those `owns` keeps: a shard's) into `sink`, without the duplicates
    ``duplicates="drop"`` removes; (parsed file, encoder, records read, records encoded, first encoding error)."""
    if duplicates not in DUPLICATE_POLICIES:
        raise UserError(f"duplicates must be one of {', '.join(DUPLICATE_POLICIES)}, not {duplicates!r}")
    parsed, records = stream_file(path, fields, owns=owns, fingerprint=owns is None, finish=owns is None)
    encoder = SplitEncoder(tokenizer, sink, max_length=max_length, too_long=too_long, source=str(path),
                           images=images, reasoning=reasoning)
    if duplicates != "drop":
        drop = None
    elif drop is None:
        drop = _DROP_HERE
    return (parsed, encoder, *_encode_stream(records, encoder, parsed, drop))


_DROP_HERE = np.zeros(0, dtype=np.int64)  # duplicates=drop without a list: found while reading


def _encode_stream(records, encoder: SplitEncoder, parsed, drop: np.ndarray | None
                   ) -> tuple[int, int, DataError | None]:
    """Feed `records` to `encoder` in batches, without exact duplicates (`drop`: those indices; `_DROP_HERE`:
    found here; None: none dropped); returns (records read, records encoded, the first encoding error or None).

    After a problem of the file or an encoding error the rest is only read
    (no longer encoded), so the file's every problem is still found. The
    batches are those `encode_records` makes of the records kept.
    """
    read = [0]
    kept = 0
    failed: DataError | None = None
    if drop is _DROP_HERE:
        kept_records = _unique(records, read)
    elif drop is not None:
        kept_records = (r for r in _counted(records, read) if not _in(r.index, drop))
    else:
        kept_records = _counted(records, read)
    for batch in batched(kept_records, BATCH_SIZE):
        kept += len(batch)
        if parsed.problems or failed is not None:
            continue
        try:
            encoder.add(batch)
        except DataError as err:  # reported after the file's own problems, as load_records would first
            failed = err
    return read[0], kept, failed


def _in(index: int, sorted_indices: np.ndarray) -> bool:
    at = np.searchsorted(sorted_indices, index)
    return bool(at < sorted_indices.size and sorted_indices[at] == index)


def _counted(records, read: list[int]):
    for record in records:
        read[0] += 1
        yield record


def _unique(records, read: list[int]):
    """`records` less the exact duplicates of earlier ones (`formats.drop_duplicates`, streamed)."""
    seen = DigestIndex()
    for batch in batched(records, BATCH_SIZE):
        read[0] += len(batch)
        earlier = seen.first([sample_digest(r) for r in batch], [r.index for r in batch])
        yield from (r for r, e in zip(batch, earlier) if e is None)
