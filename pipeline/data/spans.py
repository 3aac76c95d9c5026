"""Chat rendering and labelling: conversations -> text -> tokens, supervised where the assistant speaks.

Which template, and which characters are supervised, is `pipeline.data.chat`'s
business: each record is rendered once for training (`ChatRender`), giving its
text and the supervised character spans (each assistant content plus the
end-of-turn marker the template closes it with). Those spans are mapped to the
tokens of the text, tokenized once, through the fast tokenizer's offset
mapping; a token that straddles a boundary counts as supervised. Tokenizers
without offsets fall back to tokenizing each span's prefix of the text and
checking that its ids are a prefix of the whole text's ids. Work is batched
(rendering, tokenizing, labelling with numpy), so the only per-record Python
is the template rendering itself. `pipeline.data.tokenize` applies the
too-long and duplicates policies and writes the cache.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np

from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.chat import ChatRender, Rendered, record_name
from pipeline.data.formats import Record
from pipeline.data.vision import ImageText
from pipeline.errors import DataError, UserError


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
