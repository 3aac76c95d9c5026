"""A split's verdict from its scans: the checks across records, its problems in file order, its stats.

`pipeline.data.scan` checks records one at a time (in one scan, or one per
shard); this module merges those facts in file order and decides what needs
more than one record: a repeated ``id``, an exact duplicate (under the
duplicates policy: a problem, a warning, or a copy that tokenization drops and
every later check leaves out), a conversation that occurs in an earlier split,
the file-level problems, the length and chat statistics and warnings, and
whether any record is left to train on. Its digests of a split (`SplitIndex`)
are what the later splits are checked against.

The problems come out as one scan in one process found them: file-level first,
then by record, and a record's own in the order of the checks (structure,
repeated id, duplicate, images, split rule, overlap, length).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from pipeline.data import readers
from pipeline.data.chat import REASONING_SETTING, SETTING, suggest_builtin
from pipeline.data.formats import FileState, Problem, file_problems
from pipeline.data.images import check_image, file_digest
from pipeline.data.scan import SplitFacts
from pipeline.data.stream import DigestIndex
from pipeline.data.tokenize import CHAT_COUNTS

# Image content digests, by path: a split-overlap candidate's images are read once.
_file_digest = functools.lru_cache(maxsize=1 << 16)(file_digest)
_verdict = functools.lru_cache(maxsize=1 << 16)(check_image)
REASONING_NOT_RENDERED = "reasoning_not_rendered"
EOT_NOT_TRAINED = "eot_not_trained"
PLACEHOLDERS_TRAINED = "placeholders_trained"
STOP_TOKENS_INSIDE = "stop_tokens_inside"
MARKERS_IN_PROMPTS = "markers_in_prompts"


@dataclass
class SplitIndex:
    """A split's kept conversations, loosely compared, for the later splits' overlap check: the ones without
    images as digests; those with images by digest and image paths (compared by the images' content)."""

    texts: DigestIndex = field(default_factory=DigestIndex)
    with_images: dict = field(default_factory=dict)  # loose digest -> [(image paths, record index)]


@dataclass
class SplitVerdict:
    """One split merged: its problems (file order), kept duplicates, overlaps (earlier split, problem), stats."""

    problems: list
    copies: list
    overlaps: list
    stats: dict
    warnings: list
    index: SplitIndex
    dropped: np.ndarray  # record indices of the copies that duplicates=drop removes
    note: str | None = None  # no usable record, when each record's own problem is listed already


class _Records:
    """The clean records of every shard of a split, in file order: arrays, ids and image paths."""

    def __init__(self, scans: list[SplitFacts]):
        arrays = {k: np.concatenate([s.arrays[k] for s in scans]) for k in scans[0].arrays}
        order = np.argsort(arrays["index"], kind="stable")
        self.a = {k: v[order] for k, v in arrays.items()}
        ids = [i for s in scans for i in s.ids]
        self.ids = [ids[j] for j in order]
        self.paths = {k: v for s in scans for k, v in s.image_paths.items()}
        self.examples = {}  # count -> {record index: what it holds} (`SplitFacts.examples`)
        for s in scans:
            for name, found in s.examples.items():
                self.examples.setdefault(name, {}).update(found)
        self.file, self.kind = readers.display_name(scans[0].path), scans[0].kind  # a hub pin: its URL

    def problem(self, position: int, reason: str, message: str, field_: str | None = None) -> Problem:
        line = int(self.a["line"][position])
        return Problem(self.file, reason, message, index=int(self.a["index"][position]),
                       line=None if line < 0 else line, id=self.ids[position], field=field_, kind=self.kind)


def merge_split(scans: list[SplitFacts], earlier: dict[str, SplitIndex], *, duplicates: str, max_length: int,
                too_long: str, last: bool, measured: bool, template: str) -> SplitVerdict:
    """The verdict of one split from its scans (one per shard, any order), checked against the `earlier` splits.

    `last`: no later split is checked against this one; `measured`: the records were measured (a tokenizer was
    loaded for some split), so the length and chat stats are given; `template`: the chat template they were."""
    recs = _Records(scans)
    a, name = recs.a, scans[0].split
    kind = scans[0].kind
    states = [FileState.from_dict(s.state) for s in scans]
    parse = file_problems(recs.file, kind, states, [p for s in scans for p in s.parse])
    records_seen = scans[0].records_seen

    found = _duplicate_ids(recs)
    copies = _duplicate_samples(recs)
    dropped = np.array(sorted(p.index for p in copies), dtype=np.int64) if duplicates == "drop" else np.zeros(0, int)
    kept = ~np.isin(a["index"], dropped)
    if duplicates == "error":
        found += copies
    gone = set(dropped.tolist())
    found += [p for s in scans for p in s.checks if p.index not in gone]
    overlaps = _overlaps(recs, kept, earlier)
    found += [p for _, p in overlaps]
    found += [p for s in scans for p in s.measured if p.index not in gone]
    index = SplitIndex() if last else _index(recs, kept)

    lengths, flags = a["length"][kept], a["flags"][kept]
    over_long = set(a["index"][kept & (a["length"] > max_length)].tolist())
    parse_broken = {p.index for p in parse if p.index is not None}
    found_at = {p.index for p in found}
    broken = parse_broken | {p.index for p in found if p.reason != "split_overlap"}
    causes = {"problem": len(broken), "duplicate": len(gone - broken), "too_long": len(over_long - broken - gone)}
    stats = {"path": recs.file, "kind": kind, "sha256": "", "records": records_seen,
             "images": int(a["images"][kept].sum()), "duplicates": len(copies), "duplicates_dropped": len(gone),
             "overlaps": dict(Counter(other for other, _ in overlaps))}
    warnings, note = [], None
    if measured:
        stats.update(length_stats(lengths, max_length, too_long))
        stats.update(_chat_stats(lengths, flags))
        if name != "test":  # held-out prompts are not trained: what the template drops there costs nothing
            warnings = _chat_warnings(recs, kept, name, template)
    stats["records_valid"] = records_seen - len(parse_broken | found_at)
    if too_long != "drop":
        causes["too_long"] = 0
    stats["records_usable"] = records_seen - sum(causes.values())
    if records_seen and not stats["records_usable"]:
        why = f"no usable record is left: {_unusable_text(records_seen, causes, max_length)}"
        if causes["problem"] == records_seen:
            note = f"{recs.file}: {why}"  # each record's own problem is listed already
        else:
            found.append(Problem(recs.file, "no_usable_records", why, kind=kind))
    problems = parse + found
    problems.sort(key=lambda p: -1 if p.index is None else p.index)  # stable: file-level first, then by record
    stats["problems"] = len(problems)
    return SplitVerdict(problems, copies, overlaps, stats, warnings, index, dropped, note)


def _duplicate_ids(recs: _Records) -> list[Problem]:
    """Every record whose id an earlier record already uses: an id is meant to be unique, whatever the policy."""
    with_id = np.flatnonzero(recs.a["has_id"])
    earlier = DigestIndex().first(recs.a["id_digest"][with_id].tolist(), recs.a["index"][with_id].tolist())
    return [recs.problem(int(p), "duplicate_id", f"id {recs.ids[p]!r} is also used by record {e}", "id")
            for p, e in zip(with_id, earlier) if e is not None]


def _duplicate_samples(recs: _Records) -> list[Problem]:
    """Every record identical to an earlier one (same messages and images); the duplicates policy decides their fate."""
    earlier = DigestIndex().first(recs.a["sample"].tolist(), recs.a["index"].tolist())
    return [recs.problem(p, "duplicate_sample", f"same conversation as record {e}")
            for p, e in enumerate(earlier) if e is not None]


def _index(recs: _Records, kept: np.ndarray) -> SplitIndex:
    """The kept records' loose digests, for the later splits."""
    out = SplitIndex()
    plain = np.flatnonzero(kept & (recs.a["images"] == 0))
    out.texts.first(recs.a["loose"][plain].tolist(), recs.a["index"][plain].tolist())
    for p in np.flatnonzero(kept & (recs.a["images"] > 0)):
        paths = tuple(recs.paths[int(recs.a["index"][p])])
        entries = out.with_images.setdefault(bytes(recs.a["loose"][p]), [])
        if all(other != paths for other, _ in entries):
            entries.append((paths, int(recs.a["index"][p])))
    return out


def _overlaps(recs: _Records, kept: np.ndarray, earlier: dict[str, SplitIndex]) -> list[tuple[str, Problem]]:
    """(earlier split, problem) per kept record whose conversation occurs in an earlier split (val: train; test:
    train or val), whitespace-insensitive; a record with images matches only one with the same image content (under
    any file name). A record is matched to the first split it occurs in, and to that split's first such record."""
    a = recs.a
    matches: dict[int, tuple[str, int]] = {}
    for other, prior in earlier.items():
        plain = [int(p) for p in np.flatnonzero(kept & (a["images"] == 0)) if int(p) not in matches]
        for p, index in zip(plain, prior.texts.first(a["loose"][plain].tolist(), [0] * len(plain), add=False)):
            if index is not None:
                matches[p] = (other, index)
        for p in np.flatnonzero(kept & (a["images"] > 0)):
            p = int(p)
            key = bytes(a["loose"][p])
            if p in matches or key not in prior.with_images:
                continue
            mine = _image_key(recs.paths[int(a["index"][p])])
            index = next((index for paths, index in prior.with_images[key] if _image_key(paths) == mine), None)
            if index is not None:
                matches[p] = (other, index)
    return [(other, recs.problem(p, "split_overlap", f"same conversation as {other} record {index}"))
            for p, (other, index) in sorted(matches.items())]


def _image_key(paths) -> tuple[str, ...]:
    """The images' content digests (an unreadable image: its path), to compare records across splits."""
    return tuple(path if _verdict(path) is not None else _file_digest(path) for path in paths)


def overlap_notes(files: dict[str, dict], overlaps: list[tuple[str, str, Problem]]) -> list[str]:
    """One line per pair of splits that share conversations, e.g. 'val: 128 of 128 records also occur in train'.

    Says so when both splits are the same file (same resolved path) or copies
    of it (same sha256): the usual cause of a complete overlap.
    """
    from pathlib import Path

    notes = []
    for (split, other), n in Counter((split, other) for split, other, _ in overlaps).items():
        mine, source = files[split], files[other]
        note = f"{split}: {n} of {mine['records']} records also occur in {other}"
        if Path(mine["path"]).resolve() == Path(source["path"]).resolve():
            note += f" (same file as {other}: {source['path']})"
        elif mine["sha256"] == source["sha256"]:
            note += f" ({split} is a copy of {other}: same content as {source['path']})"
        notes.append(note)
    return notes


# Why a record does not reach the token cache, as (one record, several records).
_UNUSABLE_PHRASES = {
    "problem": ("has a problem", "have problems"),
    "duplicate": ("is a copy of an earlier record and duplicates=drop",
                  "are copies of earlier records and duplicates=drop"),
    "too_long": ("is over max_length {max_length} and too_long=drop",
                 "are over max_length {max_length} and too_long=drop"),
}


def _unusable_text(total: int, causes: dict[str, int], max_length: int) -> str:
    """Why none of `total` records is usable, e.g. 'all 200 records are over max_length 128 and too_long=drop'."""
    def phrase(cause: str, n: int) -> str:
        return _UNUSABLE_PHRASES[cause][n != 1].format(max_length=max_length)

    present = [(cause, n) for cause, n in causes.items() if n]
    if len(present) == 1:
        subject = "its only record" if total == 1 else f"all {total} records"
        return f"{subject} {phrase(present[0][0], total)}"
    return f"of its {total} records, " + ", ".join(f"{n} {phrase(cause, n)}" for cause, n in present)


def length_stats(lengths: np.ndarray, max_length: int, too_long: str) -> dict:
    measured = lengths[lengths >= 0]
    over = int((measured > max_length).sum())
    stats: dict = {"too_long": over}
    if too_long != "error":
        stats["truncated" if too_long == "truncate" else "dropped"] = over
    if measured.size:
        p50, p90, p99 = np.percentile(measured, [50, 90, 99])
        stats["tokens_per_record"] = {"p50": float(p50), "p90": float(p90), "p99": float(p99),
                                      "max": int(measured.max())}
    return stats


def _chat_stats(lengths: np.ndarray, flags: np.ndarray) -> dict:
    """The `CHAT_COUNTS` of one split's records as rendered for training, those with an end-of-turn marker
    not trained, and those whose reasoning the policy dropped."""
    counts = {key: int(n) for key, n in zip(CHAT_COUNTS, flags.sum(axis=0))}
    counts["eot_not_trained"] = int((lengths >= 0).sum()) - counts["eot_trained"]
    counts["reasoning_dropped_by_policy"] = counts["reasoning_dropped"] - counts["reasoning_dropped_by_template"]
    return counts


def _reasoning_fix(template: str) -> str:
    """How to train the reasoning a template drops: the built-in template of its family that renders it."""
    if "<｜Assistant｜>" in template:
        fit = "deepseek-r1"
    elif "<|channel|>" in template:
        fit = "gpt-oss"
    elif "<think>" in template or "<|im_start|>" in template:
        fit = "qwen3-thinking"
    else:
        return (f"set {SETTING} to a built-in template that renders it (qwen3-thinking, deepseek-r1, gpt-oss) or "
                "a .jinja file that does, to train it")
    return f"set {SETTING}: {fit} to train it"


def _chat_warnings(recs: _Records, kept: np.ndarray, split: str, template: str) -> list[Problem]:
    """File-level warnings (one per kind, with the record count and the first record) for kept records whose
    reasoning the template does not render, those with an end-of-turn marker that is not trained, those
    that train an unfilled `{{name}}` placeholder, those whose trained reply holds a stop token's text, and
    those with the template's turn markers written in a prompt turn (data rendered already)."""
    lengths, flags = recs.a["length"], recs.a["flags"]
    hits = {REASONING_NOT_RENDERED: flags[:, CHAT_COUNTS.index("reasoning_dropped_by_template")],
            EOT_NOT_TRAINED: (lengths >= 0) & ~flags[:, CHAT_COUNTS.index("eot_trained")],
            PLACEHOLDERS_TRAINED: flags[:, CHAT_COUNTS.index(PLACEHOLDERS_TRAINED)],
            STOP_TOKENS_INSIDE: flags[:, CHAT_COUNTS.index(STOP_TOKENS_INSIDE)],
            MARKERS_IN_PROMPTS: flags[:, CHAT_COUNTS.index(MARKERS_IN_PROMPTS)]}
    found = []
    for reason, message in (
        (REASONING_NOT_RENDERED,
         "{n} record(s) of {split} have reasoning the chat template does not render (it is not trained): "
         f"{_reasoning_fix(template)}, or {REASONING_SETTING}: drop to silence this"),
        (EOT_NOT_TRAINED,
         "{n} record(s) of {split} have an assistant turn whose end-of-turn marker is not trained (the chat "
         "template writes no token generation stops on right after the content, and another turn follows), so "
         "the model is not taught to stop there: "
         f"{suggest_builtin(template)}"),
        (PLACEHOLDERS_TRAINED,
         "{n} record(s) of {split} train on text holding a template placeholder left unfilled ({{{{name}}}} or "
         "{{{{ name }}}} outside code), which the model learns to write as it stands: fill it in before training "
         "(LLaMA-Factory's identity data asks for its {{{{name}}}} and {{{{author}}}} to be replaced); template "
         "code meant as written is not counted inside a code fence or backticks"),
        (STOP_TOKENS_INSIDE,
         "{n} record(s) of {split} have a trained reply whose text holds a token generation stops on (the "
         "end-of-turn marker or the eos, written out in the data), which the tokenizer reads as that token: the "
         "model learns to stop there, in mid-reply; remove it from the data"),
        (MARKERS_IN_PROMPTS,
         "{n} record(s) of {split} have a turn left as prompt (system, user, tool, or a reply marked untrained) "
         "whose text holds the chat template's own turn markers (its role header or end-of-turn tokens, written "
         "out in the data), which read exactly as the template's own, so the model is shown turns the data does "
         "not give as turns: the text looks rendered with a chat template already, and is rendered again; give "
         "each turn's plain text, one message per turn"),
    ):
        positions = np.flatnonzero(hits[reason] & kept)
        if positions.size:
            where = recs.problem(int(positions[0]), reason, "").where()
            what = recs.examples.get(reason, {}).get(int(recs.a["index"][positions[0]]))
            where += f", holding {what!r}" if what else ""
            found.append(Problem(recs.file, reason, message.format(n=positions.size, split=split) + f" (first: {where})",
                                 kind=recs.kind))
    return found
