"""The label view: records of a token cache as trained, with the supervised tokens marked.

    python -m pipeline labels --cache results/<run>/data/train.safetensors \\
        --tokenizer results/<run>/tokenizer [-n 5] [--start 0] [--out labels.html]

Prints the first N records of each cache decoded token by token, the
supervised tokens (label != -100) marked: in colour on a terminal, between
``[[`` and ``]]`` otherwise (a log, a pipe), then the split's counts from the
``stats.json`` tokenization wrote next to the cache: supervised tokens, records
whose every end-of-turn marker is trained, records cut by ``max_length``,
reasoning not trained (by ``data.reasoning: drop`` or by the template).
``--out`` also writes the same as an HTML page (the report's label page):
supervised tokens highlighted, token boundaries shaded, special tokens boxed,
newlines shown as ``↵``, and, with ``--validation``, the chat warnings of the
dataset validation.

A run of 8 or more identical unsupervised special tokens (a vision-language
model's image tokens) is shown once with its count (``<image>×576``).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import layout
from pipeline.data.cache import IGNORE_INDEX, TokenCache
from pipeline.errors import UserError
from pipeline.storage import publish

OPEN, CLOSE = "[[", "]]"  # the supervised marks of the plain-text view
COLLAPSE = 8  # identical unsupervised special tokens in a row shown once, with their count
_ANSI_SUPERVISED, _ANSI_SPECIAL, _ANSI_RESET = "\x1b[1;32m", "\x1b[4m", "\x1b[0m"
# The warnings of validation.json that the label page repeats (validate.py's chat warnings).
CHAT_WARNINGS = ("reasoning_not_rendered", "eot_not_trained", "placeholders_trained", "stop_tokens_inside",
                 "markers_in_prompts")


@dataclass
class Token:
    """One token (or a collapsed run of identical ones) as shown: its text and what it is."""

    text: str
    supervised: bool
    special: bool
    position: int
    token_id: int
    count: int = 1


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text (special tokens written out), so that their concatenation
    is the record's text.

    Incremental decoding (as text-generation servers stream): a token's text is
    what it adds to the decode of the few tokens before it, so SentencePiece's
    leading spaces come out right; a token that ends inside a multi-byte
    character gets '' and the token that completes the character gets it.
    """
    def decode(part):
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    out: list[str] = []
    prefix, read = 0, 0  # decode ids[prefix:read] is the context already emitted
    for i in range(len(ids)):
        before = decode(ids[prefix:read])
        now = decode(ids[prefix:i + 1])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            out.append(now[len(before):])
            prefix, read = max(0, i + 1 - 4), i + 1  # a few tokens of context for the next one
        else:
            out.append("")
    if ids and out[-1] == "" and read < len(ids):  # ends inside a character: show what there is
        out[-1] = decode(ids[read:])
    return out


def special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items() if getattr(t, "special", False)}
    return ids


def record_tokens(tokenizer, ids: np.ndarray, labels: np.ndarray, specials: set[int] | None = None) -> list[Token]:
    """The tokens of one record as shown, long runs of identical unsupervised special tokens collapsed."""
    specials = special_ids(tokenizer) if specials is None else specials
    ids_list = [int(i) for i in ids]
    texts = token_texts(tokenizer, ids_list)
    tokens: list[Token] = []
    for pos, (tid, text, label) in enumerate(zip(ids_list, texts, labels)):
        tokens.append(Token(text, int(label) != IGNORE_INDEX, tid in specials, pos, tid))
    out: list[Token] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        j = i + 1
        if t.special and not t.supervised:
            while j < len(tokens) and tokens[j].token_id == t.token_id and not tokens[j].supervised:
                j += 1
        if j - i >= COLLAPSE:
            out.append(Token(t.text, False, True, t.position, t.token_id, count=j - i))
        else:
            out.extend(tokens[i:j])
        i = j
    return out


def _shown(token: Token) -> str:
    return token.text if token.count == 1 else f"{token.text}×{token.count}"


def marked_text(tokens: list[Token], *, color: bool = False) -> str:
    """The record's text with each run of supervised tokens marked ([[...]], or ANSI colour)."""
    parts: list[str] = []
    inside = False
    for t in tokens:
        if color:
            codes = (_ANSI_SUPERVISED if t.supervised else "") + (_ANSI_SPECIAL if t.special else "")
            parts.append(f"{codes}{_shown(t)}{_ANSI_RESET}" if codes else _shown(t))
            continue
        if t.supervised != inside:
            parts.append(OPEN if t.supervised else CLOSE)
            inside = t.supervised
        parts.append(_shown(t))
    if inside:
        parts.append(CLOSE)
    return "".join(parts)


def supervised_runs(tokenizer, ids: np.ndarray, labels: np.ndarray) -> list[str]:
    """The decoded text of each maximal run of supervised tokens (what the marks enclose)."""
    mask = np.asarray(labels) != IGNORE_INDEX
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tokenizer.decode([int(i) for i in ids[lo:hi]], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False) for lo, hi in zip(edges[::2], edges[1::2])]


# --- the split's counts ---------------------------------------------------------------------------


def split_stats(cache: TokenCache, stats_path: Path | None) -> tuple[str, dict, dict]:
    """(split name, its stats from stats.json or {} without one, stats.json's settings).

    Raises `UserError` when stats.json describes another cache (other source or supervised tokens).
    """
    split = cache.metadata.get("split") or cache.path.stem
    if stats_path is None or not stats_path.is_file():
        return split, {}, {}
    report = json.loads(stats_path.read_text())
    stats = report.get("splits", {}).get(split)
    if stats is None:
        raise UserError(f"{stats_path} has no split {split!r} (the split of {cache.path})")
    if (stats.get("source_sha256") != cache.metadata.get("source_sha256")
            or str(stats.get("supervised_tokens")) != cache.metadata.get("supervised_tokens")):
        raise UserError(f"{stats_path} does not describe {cache.path} (another source or tokenization): "
                        "give the stats.json written with it (--stats)")
    return split, stats, {k: v for k, v in report.items() if k != "splits"}


def count_rows(cache: TokenCache, stats: dict, settings: dict) -> list[tuple[str, str]]:
    """(what, how many) of a split: from stats.json where there is one, else what the cache itself tells."""
    supervised = int(cache.metadata.get("supervised_tokens", -1))
    if supervised < 0:
        supervised = sum(int((cache[i][1] != IGNORE_INDEX).sum()) for i in range(len(cache)))
    records = len(cache)
    rows = [("records", str(records)), ("tokens", str(cache.num_tokens)),
            ("supervised tokens", f"{supervised} ({supervised / max(cache.num_tokens, 1):.1%} of the tokens)")]
    if not stats:
        return rows + [("end-of-turn, truncation, reasoning", "unknown: no stats.json next to the cache (--stats)")]
    max_length = settings.get("max_length", cache.metadata.get("max_length", "?"))
    dropped = stats.get("reasoning_dropped", 0)
    by_template = stats.get("reasoning_dropped_by_template", 0)
    rows += [
        ("records whose end-of-turn is trained", f"{stats.get('eot_trained', '?')} of {records}"),
        ("records cut by max_length", f"{stats.get('truncated', 0)} (max_length {max_length}, "
                                      f"too_long={settings.get('too_long', cache.metadata.get('too_long', '?'))})"),
        ("records with reasoning", str(stats.get("reasoning_records", 0))),
        ("records with reasoning not trained",
         f"{dropped} ({dropped - by_template} by data.reasoning=drop, {by_template} by the chat template)"),
        ("records training an unfilled {{name}} placeholder", str(stats.get("placeholders_trained", 0))),
        ("records with a stop token written inside a trained reply", str(stats.get("stop_tokens_inside", 0))),
        ("records with the template's turn markers written in a prompt", str(stats.get("markers_in_prompts", 0))),
    ]
    return rows


def chat_warnings(validation: Path | None) -> list[str]:
    """The chat warnings of validation.json (reasoning the template drops, untrained end-of-turn, unfilled
    placeholders trained, stop tokens inside replies, turn markers in prompts)."""
    if validation is None or not validation.is_file():
        return []
    report = json.loads(validation.read_text())
    return [w["message"] for w in report.get("warnings", []) if w.get("reason") in CHAT_WARNINGS]


# --- the views ------------------------------------------------------------------------------------


@dataclass
class SplitView:
    split: str
    cache: TokenCache
    records: list[tuple[int, list[Token]]]
    counts: list[tuple[str, str]]


def build_view(cache_path: Path, tokenizer, *, n: int, start: int, stats_path: Path | None) -> SplitView:
    cache = TokenCache(cache_path)
    split, stats, settings = split_stats(cache, stats_path)
    specials = special_ids(tokenizer)
    records = []
    for i in range(max(start, 0), min(start + n, len(cache))):
        ids, labels = cache[i]
        records.append((i, record_tokens(tokenizer, ids.numpy(), labels.numpy(), specials)))
    return SplitView(split, cache, records, count_rows(cache, stats, settings))


def text_view(view: SplitView, *, color: bool) -> str:
    lines = []
    for i, tokens in view.records:
        supervised = sum(t.count for t in tokens if t.supervised)
        lines.append(f"=== {view.split} record {i} of {len(view.cache)}: {sum(t.count for t in tokens)} tokens, "
                     f"{supervised} supervised ===")
        lines.append(marked_text(tokens, color=color))
    lines.append(f"--- {view.split}: counts ({view.cache.path}) ---")
    lines += [f"  {what}: {value}" for what, value in view.counts]
    return "\n".join(lines)


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em 1.6em; color: #1f2933; }
h1 { font-size: 1.35em; margin-bottom: .2em; } h2 { font-size: 1.1em; margin-top: 1.6em; }
h3 { font-size: .95em; margin: 1.2em 0 .3em; color: #334e68; }
p.note { color: #52606d; font-size: .9em; max-width: 60em; }
table { border-collapse: collapse; font-size: .92em; margin: .6em 0; }
th, td { border-bottom: 1px solid #d9e2ec; padding: .35em .8em; text-align: right; }
td.l { text-align: left; }
ul.warn { background: #fff4e5; border-left: 4px solid #f0a202; padding: .6em 1.2em .6em 2em; max-width: 60em; }
pre.rec { white-space: pre-wrap; word-break: break-all; font-size: .88em; line-height: 1.55;
          background: #fbfcfd; border: 1px solid #d9e2ec; padding: .6em .8em; max-width: 80em; }
pre.rec span.t.o { background: #f0f4f8; }
pre.rec span.s { background: #b7ebc6; } pre.rec span.s.o { background: #8fdca6; }
pre.rec span.sp { outline: 1px solid #829ab1; border-radius: 2px; color: #243b53; font-weight: 600; }
pre.rec span.nl { color: #9fb3c8; }
.key span { padding: 0 .3em; }
"""


def _token_html(t: Token, odd: bool) -> str:
    classes = ["t", "s" if t.supervised else "u"] + (["o"] if odd else []) + (["sp"] if t.special else [])
    title = f"#{t.position} id {t.token_id}" + (f" ×{t.count}" if t.count > 1 else "") + (
        " supervised" if t.supervised else "")
    text = html.escape(_shown(t)).replace("\n", '<span class="nl">↵</span>\n')
    return f'<span class="{" ".join(classes)}" title="{title}">{text}</span>'


def html_view(views: list[SplitView], *, title: str, warnings: list[str]) -> str:
    body = [
        '<p class="note">The first records of each split as the trainer sees them, decoded token by token. '
        '<span class="key"><span style="background:#b7ebc6">green</span></span>: supervised tokens (their label '
        'is the token, the loss is computed on them); the rest is context only (label -100). Shading alternates '
        'token by token; <span style="outline:1px solid #829ab1">boxed</span>: special tokens; ↵: a newline. '
        'Hover a token for its position and id.</p>',
    ]
    if warnings:
        body.append('<ul class="warn">' + "".join(f"<li>{html.escape(w)}</li>" for w in warnings) + "</ul>")
    for view in views:
        body.append(f"<h2>{html.escape(view.split)}</h2>")
        body.append("<table><tbody>" + "".join(
            f'<tr><td class="l">{html.escape(what)}</td><td class="l">{html.escape(value)}</td></tr>'
            for what, value in view.counts) + "</tbody></table>")
        for i, tokens in view.records:
            supervised = sum(t.count for t in tokens if t.supervised)
            body.append(f"<h3>record {i}: {sum(t.count for t in tokens)} tokens, {supervised} supervised</h3>")
            body.append('<pre class="rec">' + "".join(_token_html(t, k % 2 == 1) for k, t in enumerate(tokens))
                        + "</pre>")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n" + "\n".join(body)
            + "\n</body></html>\n")


# --- CLI ------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline labels", description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True, type=Path, nargs="+",
                   help="token cache(s): results/<run>/data/train.safetensors (and val.safetensors)")
    p.add_argument("--tokenizer", required=True, type=Path, help="the run's tokenizer: results/<run>/tokenizer")
    p.add_argument("-n", type=int, default=5, help="records shown per cache (default 5)")
    p.add_argument("--start", type=int, default=0, help="the first record shown (default 0)")
    p.add_argument("--stats", type=Path, help="stats.json of the tokenization (default: the one next to each cache)")
    p.add_argument("--validation", type=Path, help="validation.json: its chat warnings go on the HTML page")
    p.add_argument("--out", type=Path, help="also write the view as an HTML page")
    p.add_argument("--title", default="", help="the HTML page's title (default: Labels of <the cache's dir>)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colour for the supervised tokens; auto: when stdout is a terminal, else [[...]]")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.n < 0 or args.start < 0:
        raise UserError("-n and --start must not be negative")
    for path in args.cache:
        if not path.is_file():
            raise UserError(f"token cache not found: {path}")
    from pipeline.data.tokenize import load_chat, tokenizer_fingerprint

    tokenizer, _ = load_chat(args.tokenizer)
    fingerprint = tokenizer_fingerprint(args.tokenizer)
    views = []
    for path in args.cache:
        stats_path = args.stats or path.parent / layout.STATS_FILE  # each cache's own, by default
        view = build_view(path, tokenizer, n=args.n, start=args.start, stats_path=stats_path)
        cached = view.cache.metadata.get("tokenizer_fingerprint")
        if cached and cached != fingerprint:
            raise UserError(f"{path} was tokenized with another tokenizer than {args.tokenizer}: "
                            "give the run's tokenizer (results/<run>/tokenizer)")
        views.append(view)
    splits = [v.split for v in views]
    for view in views:  # several training datasets: each cache in a dir named after its dataset
        if splits.count(view.split) > 1:
            view.split = f"{view.split}:{view.cache.path.parent.name}"
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print("\n\n".join(text_view(v, color=color) for v in views))
    if not color:
        print(f"(supervised tokens are between {OPEN} and {CLOSE})")
    if args.out is not None:
        title = args.title or f"Labels of {args.cache[0].parent.parent.name or args.cache[0].parent}"
        publish.write_text(args.out, html_view(views, title=title, warnings=chat_warnings(args.validation)))
        print(f"wrote {args.out}")
    return 0
