"""Tokenize conversations with a chat template, masking all but the assistant turns.

Which template, and which characters are supervised, is `pipeline.data.chat`'s
business: each record is rendered once for training (`ChatRender`), giving its
text and the supervised character spans (each assistant content plus the
end-of-turn marker the template closes it with). Those spans are mapped to the
tokens of the text, tokenized once, through the fast tokenizer's offset
mapping; a token that straddles a boundary counts as supervised. Tokenizers
without offsets fall back to tokenizing each span's prefix of the text and
checking that its ids are a prefix of the whole text's ids.

Work is batched (rendering, tokenizing, labelling with numpy), so the only
per-record Python is the template rendering itself. A file is streamed: its
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
``turns``, ``assistant_turns``, ``tokens``, ``supervised_tokens``, ``tokens_per_record``
(p50 / p90 / p99 / max / mean, after truncation), ``max_tokens_before_truncation``,
``too_long``, ``truncated``, ``dropped``, ``dropped_unsupervised``, ``duplicates_dropped``, the chat
counts `CHAT_COUNTS` (``eot_trained``, ``reasoning_records``, ``reasoning_dropped``,
``reasoning_dropped_by_template``: records, see `encode_records`), and for a vision-language model
``images`` and ``dropped_image_cut``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.cache import IGNORE_INDEX, CacheWriter
from pipeline.data.chat import ChatRender, Rendered, builtin_names, record_name
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


def render(tokenizer, conversations: list[list[dict]], *, add_generation_prompt: bool,
           chat_template: str | None = None, tools: list[list[dict] | None] | None = None) -> tuple[list, dict[int, str]]:
    """Render many conversations to text; returns (texts, {position: error}) with None for failures.

    Renders the batch in one call; only if that raises are conversations
    rendered one by one, so the failing ones can be named. `chat_template`
    overrides the tokenizer's (a processor's own template). `tools`: per
    conversation, the function schemas the template is given (None: none);
    conversations with the same tools are rendered in one call.
    """
    if tools is not None and any(tools):
        groups: dict[str, list[int]] = {}
        for i, schema in enumerate(tools):
            groups.setdefault(json.dumps(schema, sort_keys=True), []).append(i)
        texts: list = [None] * len(conversations)
        errors: dict[int, str] = {}
        for members in groups.values():
            part, failed = _render_with(tokenizer, [conversations[i] for i in members], tools[members[0]],
                                        add_generation_prompt, chat_template)
            for j, i in enumerate(members):
                texts[i] = part[j]
            errors.update({members[j]: msg for j, msg in failed.items()})
        return texts, errors
    return _render_with(tokenizer, conversations, None, add_generation_prompt, chat_template)


def _render_with(tokenizer, conversations, tools, add_generation_prompt, chat_template) -> tuple[list, dict[int, str]]:
    """`render` of conversations that share their tools (None: no tools given)."""
    if not conversations:
        return [], {}
    kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if tools:
        kwargs["tools"] = tools
    try:
        return list(tokenizer.apply_chat_template(conversations, **kwargs)), {}
    except Exception:  # noqa: BLE001 -- a template may raise anything; located below
        pass
    texts: list[str | None] = []
    errors: dict[int, str] = {}
    for i, conversation in enumerate(conversations):
        try:
            texts.append(tokenizer.apply_chat_template(conversation, **kwargs))
        except Exception as err:  # noqa: BLE001
            texts.append(None)
            errors[i] = f"the chat template failed: {type(err).__name__}: {err}"
    return texts, errors


def _encode(tokenizer, texts: list[str], *, offsets: bool = False):
    # Exactly what apply_chat_template(tokenize=True) does: the template already
    # holds the special tokens, so the tokenizer must not add its own.
    return tokenizer(
        texts,
        add_special_tokens=False,
        return_offsets_mapping=offsets,
        return_attention_mask=False,
        return_token_type_ids=False,
        verbose=False,  # lengths over model_max_length are our policy's business, not a warning
    )


# Per-record facts of the training render that validation, tokenization and the label view count.
CHAT_COUNTS = ("eot_trained", "reasoning_records", "reasoning_dropped", "reasoning_dropped_by_template")


def chat_flags(rendered: Rendered) -> tuple[bool, bool, bool, bool]:
    """One record's `CHAT_COUNTS`: every end-of-turn marker trained; reasoning in the data; any of it
    not trained (the policy or the template dropped it); the template dropped some."""
    return (all(rendered.eot), rendered.reasoning > 0, rendered.reasoning_dropped > 0,
            bool(rendered.dropped_by_template))


def sequence_lengths(tokenizer, records: list[Record], images: ImageText | None = None, *,
                     reasoning: str = "auto") -> tuple[np.ndarray, dict[int, str], np.ndarray]:
    """(tokens in each record as trained (image tokens expanded), -1 where it fails; {position: error};
    bool [records, len(CHAT_COUNTS)]: each record's `chat_flags`, all False where it fails).

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
    return lengths, errors, flags


def chat_counts_text(stats: dict) -> str:
    """'end-of-turn trained in 96 of 96 records, reasoning in 0 (not trained in 0, by the template 0)'."""
    dropped = stats.get("reasoning_dropped", 0)
    by_template = stats.get("reasoning_dropped_by_template", 0)
    return (f"end-of-turn trained in {stats.get('eot_trained', 0)} of {stats.get('records', 0)} records, "
            f"reasoning in {stats.get('reasoning_records', 0)} (not trained in {dropped}: "
            f"{dropped - by_template} by data.reasoning=drop, {by_template} by the template)")


# --- labelling ------------------------------------------------------------------------------------


@dataclass
class _Batch:
    """One batch, tokenized: flat ids, tokens per record, and supervised token ranges [lo, hi)."""

    ids: np.ndarray
    lengths: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    span_record: np.ndarray  # batch position of each range's record


def chat_render(tokenizer, images: ImageText | None = None, *, reasoning: str = "auto",
                chat_template: str | None = None) -> ChatRender:
    """The training renderer for `tokenizer` (a vision-language model's processor `images`).

    `chat_template` defaults to the processor's template for a vision-language
    model, else the tokenizer's (the run's tokenizer carries the chosen one).
    """
    template = chat_template or (images.chat_template if images else tokenizer.chat_template)
    if not template:
        raise UserError("the tokenizer has no chat template: set data.chat_template "
                        "(see `python -m pipeline prepare-tokenizer --help`)")
    expand = None
    if images is not None:
        def expand(text, record):
            return images.expand(text, record.images)
    return ChatRender(tokenizer, template, reasoning, images.conversation if images else None, expand)


def _renderer(chat: ChatRender):
    """conversations -> (texts, errors) with the chat's template, no generation prompt."""
    def run(conversations, tools=None):
        return render(chat.tokenizer, conversations, add_generation_prompt=False, chat_template=chat.template,
                      tools=tools)
    return run


def _render_batch(chat: ChatRender, batch: list[Record], source: str) -> list[Rendered]:
    """Every record rendered for training; the first failure raises `DataError` naming its record."""
    rendered, errors = chat.render_records(batch, _renderer(chat))
    if errors:
        first = min(errors)
        raise DataError(f"{record_name(source, batch[first])}: {errors[first]}")
    return rendered


def _spans_from_offsets(tokenizer, rendered: list[Rendered]) -> _Batch | None:
    """Map character spans to tokens with the offset mapping; None if offsets are unusable."""
    full_texts = [r.text for r in rendered]
    enc = _encode(tokenizer, full_texts, offsets=True)
    ids_lists, off_lists = enc["input_ids"], enc["offset_mapping"]
    lengths = np.fromiter(map(len, ids_lists), dtype=np.int64, count=len(ids_lists))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(ids_lists), dtype=np.int64, count=total)
    offs = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(off_lists)),
                       dtype=np.int64, count=2 * total).reshape(-1, 2)
    # Shift every record's characters and tokens onto one global axis so one
    # searchsorted call labels the whole batch.
    char_base = np.zeros(len(full_texts), dtype=np.int64)
    np.cumsum([len(t) for t in full_texts[:-1]], out=char_base[1:])
    token_record = np.repeat(np.arange(len(full_texts)), lengths)
    starts = offs[:, 0] + char_base[token_record]
    ends = offs[:, 1] + char_base[token_record]
    if total and (np.any(np.diff(starts) < 0) or np.any(np.diff(ends) < 0)):
        return None  # offsets not monotonic (unusual normalizer): the prefix method is safer
    span_record = np.array([b for b, r in enumerate(rendered) for _ in r.spans], dtype=np.int64)
    a = np.array([lo for r in rendered for lo, _ in r.spans], dtype=np.int64) + char_base[span_record]
    e = np.array([hi for r in rendered for _, hi in r.spans], dtype=np.int64) + char_base[span_record]
    lo = np.searchsorted(ends, a, side="right")  # first token ending after the span starts
    hi = np.searchsorted(starts, e, side="left")  # first token starting at or after its end
    return _Batch(ids, lengths, lo, hi, span_record)


def _spans_from_prefixes(tokenizer, rendered: list[Rendered], batch: list[Record], source: str) -> _Batch:
    """Tokenize each span's prefix of the text; its ids must be a prefix of the whole text's ids."""
    full_ids = _encode(tokenizer, [r.text for r in rendered])["input_ids"]
    owners = [(b, lo, hi) for b, r in enumerate(rendered) for lo, hi in r.spans]
    start_ids = _encode(tokenizer, [rendered[b].text[:lo] for b, lo, _ in owners])["input_ids"] if owners else []
    end_ids = _encode(tokenizer, [rendered[b].text[:hi] for b, _, hi in owners])["input_ids"] if owners else []
    lengths = np.array([len(x) for x in full_ids], dtype=np.int64)
    record_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    lo, hi = [], []
    for (b, _, _), p_ids, t_ids in zip(owners, start_ids, end_ids):
        ids = full_ids[b]
        if ids[:len(p_ids)] != p_ids or ids[:len(t_ids)] != t_ids:
            raise DataError(
                f"{record_name(source, batch[b])}: the tokenizer splits the conversation differently from its "
                "prefixes, so the assistant tokens cannot be located"
            )
        lo.append(record_start[b] + len(p_ids))
        hi.append(record_start[b] + len(t_ids))
    ids = np.fromiter(itertools.chain.from_iterable(full_ids), dtype=np.int64, count=int(lengths.sum()))
    span_record = np.array([b for b, _, _ in owners], dtype=np.int64)
    return _Batch(ids, lengths, np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64), span_record)


def _supports_offsets(tokenizer) -> bool:
    return bool(getattr(tokenizer, "is_fast", False))


def _label_batch(chat: ChatRender, batch: list[Record], source: str, images: ImageText | None = None
                 ) -> tuple[_Batch, np.ndarray, list[Rendered]]:
    tokenizer = chat.tokenizer
    rendered = _render_batch(chat, batch, source)
    tokens = _spans_from_offsets(tokenizer, rendered) if _supports_offsets(tokenizer) else None
    if tokens is None:
        tokens = _spans_from_prefixes(tokenizer, rendered, batch, source)
    empty = tokens.hi <= tokens.lo
    if np.any(empty):
        b = int(tokens.span_record[np.argmax(empty)])
        raise DataError(f"{record_name(source, batch[b])}: an assistant turn maps to no tokens")
    # +1 where a supervised range opens, -1 where it closes; ranges are disjoint.
    total = tokens.ids.size
    depth = np.cumsum(np.bincount(tokens.lo, minlength=total + 1) - np.bincount(tokens.hi, minlength=total + 1))
    labels = np.where(depth[:total] > 0, tokens.ids, IGNORE_INDEX)
    if images is not None:  # an image's tokens are input, never a target, whatever the template did
        labels[tokens.ids == images.image_token_id] = IGNORE_INDEX
    return tokens, labels, rendered


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
        self.records_in = self.turns = self.assistant_turns = self.tokens = self.supervised = self.raw_max = 0
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
            for key, flag in zip(CHAT_COUNTS, chat_flags(rendered[b])):
                self.chat_counts[key] += flag

    def counters(self) -> dict:
        """What `split_stats` makes the stats of (besides the kept records' lengths); shards' counters add up."""
        return {"records_in": self.records_in, "turns": self.turns, "assistant_turns": self.assistant_turns,
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
        "tokens": c["tokens"],
        "supervised_tokens": c["supervised_tokens"],
        "tokens_per_record": _percentiles(lengths),
        "max_tokens_before_truncation": c["max_tokens_before_truncation"],
        **{key: c[key] for key in ("too_long", "truncated", "dropped", "dropped_unsupervised")},
        **({"dropped_image_cut": c["dropped_image_cut"]} if "dropped_image_cut" in c else {}),
        **{key: c[key] for key in CHAT_COUNTS},
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
