"""A dataset's records as every stage sees them: `Record`, its `Problem`s, and what a file gave (`ParsedFile`).

`pipeline.data.normalize` makes a `Record` of every shape a dataset may hold
(`pipeline.data.shapes`); `pipeline.data.formats` reads a file's records. What
is here is what the later stages share: the placeholder of an image in a turn,
the role of a plain text record, the duplicates policies and the conversation
key that decides what a duplicate is, and how problems are written.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.data.kinds import describe_kind
from pipeline.errors import DataError


# Where an image sits in a turn's text (LLaVA's spelling; OpenAI image parts become one).
IMAGE_PLACEHOLDER = "<image>"


# What to do with a conversation identical to an earlier one of the same file:
# error (a problem), warn (kept, reported), drop (every copy after the first removed).
DUPLICATE_POLICIES = ("error", "warn", "drop")

# The role of a plain text record's one message: no chat template, every token trained.
TEXT_ROLE = "text"

@dataclass(frozen=True)
class Record:
    """One normalized sample.

    `messages` are ``{"role", "content"}`` dicts (content a string, with
    `IMAGE_PLACEHOLDER` where an image goes), system prompt (if any) first,
    then user / assistant alternating. `images` are resolved paths, in the
    order of their placeholders. `index` is
    the record's position in its file (0-based, counting rejected records too);
    `line` is its 1-based line number in a JSONL file, None in a JSON array.
    """

    id: str | None
    messages: list[dict[str, str]]
    images: list[str]
    index: int
    line: int | None
    tools: list[dict] | None = None  # function schemas given to the chat template (tool calling)

    @property
    def is_text(self) -> bool:
        """A plain text record (one `TEXT_ROLE` message): trained whole, no chat template."""
        return len(self.messages) == 1 and self.messages[0]["role"] == TEXT_ROLE


@dataclass(frozen=True)
class Problem:
    """One fault in a dataset file; `reason` is a stable code, `message` explains it.

    `index` / `line` / `id` locate the record (None for file-level faults such
    as invalid JSON in an array file); `field` names the offending key, e.g.
    ``conversations[2].from``; `kind` is the file kind it was read as
    (`kinds.KINDS`, or compressed: ``jsonl.gz``; None when that is not known).
    A dataset of several files (a hub pin's shards) numbers its records across
    them: `part` is then the record's own file and `part_index` its number there
    (`locate`), and `line` is a line of that file.
    """

    file: str
    reason: str
    message: str
    index: int | None = None
    line: int | None = None
    id: str | None = None
    field: str | None = None
    kind: str | None = None
    part: str | None = None
    part_index: int | None = None

    def where(self) -> str:
        """'train.jsonl (JSON Lines) record 3 (line 4, id 'x')' -- as much as is known; a record of a dataset of
        several files: 'hf://... (JSON Lines) record 9 (record 3 of data/b.jsonl, line 4)'."""
        parts = [] if self.part is None else [f"record {self.part_index} of {self.part}"]
        if self.line is not None:
            parts.append(f"line {self.line}")
        if self.id is not None:
            parts.append(f"id {self.id!r}")
        text = self.file + (f" ({describe_kind(self.kind)})" if self.kind else "")
        if self.index is not None:
            text += f" record {self.index}"
        elif self.line is not None:
            return f"{text} line {self.line}"  # a file-level fault at a known place
        if parts:
            text += f" ({', '.join(parts)})"
        return text

    def describe(self) -> str:
        """One line naming the file, the record, the field and the reason."""
        at = f" {self.field}" if self.field else ""
        return f"{self.where()}{at}: {self.reason}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def locate(problem: Problem, parts: list) -> Problem:
    """`problem` with its record's own file of a dataset of several (`parts`: [first record's number, file] per
    file, `readers.read_raw`) and its number there; as it was for a file-level fault or a dataset of one file."""
    if not parts or problem.index is None:
        return problem
    first, part = parts[bisect.bisect_right([start for start, _ in parts], problem.index) - 1]
    return replace(problem, part=part, part_index=problem.index - first)


@dataclass
class ParsedFile:
    """What `parse_file` found: clean records plus every problem, in file order."""

    path: Path
    layout: str  # the file kind (`pipeline.data.kinds`), or "unknown" (unreadable)
    sha256: str
    records: list[Record] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    records_seen: int = 0  # records in the file, including rejected ones
    # Records with a problem whose images could still be read: their image files are checked too,
    # so a record reports every defect at once (a missing placeholder and a missing file).
    rejected: list[Record] = field(default_factory=list)
    state: object = None  # `formats.FileState`: the file-level facts, once read (a shard's, for the merge)
    name: str = ""  # how problems name the file (`readers.display_name`: a hub pin by its URL), found once
    parts: list = field(default_factory=list)  # a dataset of several files: [first record, file] each (`locate`)

    def __post_init__(self) -> None:
        self.name = self.name or str(self.path)



def prompt_and_reference(record: Record) -> tuple[list[dict[str, str]], str]:
    """Split a record for held-out evaluation: (messages before the last assistant turn, its answer).

    The answer is the turn's content without its reasoning (a leading ``<think>...</think>``).
    """
    for i in range(len(record.messages) - 1, -1, -1):
        if record.messages[i]["role"] == "assistant":
            content = record.messages[i]["content"]
            return [dict(m) for m in record.messages[:i]], content.rpartition("</think>")[2].strip()
    raise DataError(f"record {record.index} (id {record.id!r}) has no assistant turn to use as reference")


def format_problems(problems: list[Problem], *, header: str, limit: int = 20) -> str:
    """A multi-line summary: header, the first `limit` problems, and the total count."""
    lines = [f"{header}: {len(problems)} problem(s)"]
    lines += [f"  {p.describe()}" for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"  ... and {len(problems) - limit} more")
    return "\n".join(lines)


def conversation_key(messages: list[dict[str, str]], *, loose: bool = False) -> str:
    """A hashable digest of normalized messages.

    Exact (the default), what a turn trains on counts as well as its text: its reasoning and its ``weight``
    (two samples of one question with different reasoning are not copies). ``loose=True`` compares what
    the conversation says across splits: the text with whitespace collapsed, so near-identical copies
    (re-wrapped lines, trailing spaces) compare equal.
    """
    def item(m):
        text = " ".join(m["content"].split()) if loose else m["content"]
        # Tool calls count (two turns that call different functions differ); a turn without them, its
        # reasoning or its weight has the digest it always had.
        head = (m["role"], text, m["tool_calls"]) if m.get("tool_calls") else (m["role"], text)
        extra = {} if loose else {k: m[k] for k in ("reasoning_content", "weight") if k in m}
        return (*head, extra) if extra else head

    items = [item(m) for m in messages]
    return hashlib.sha1(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def duplicate_of(records: list[Record]) -> dict[int, int]:
    """{position of a record: position of the earlier record it exactly repeats} (messages and images).

    Only copies appear as keys: the first occurrence of a conversation is not a duplicate.
    """
    first: dict[tuple, int] = {}
    copies: dict[int, int] = {}
    for position, record in enumerate(records):
        key = (conversation_key(record.messages), tuple(record.images))
        earlier = first.setdefault(key, position)
        if earlier != position:
            copies[position] = earlier
    return copies


def drop_duplicates(records: list[Record]) -> list[Record]:
    """`records` without the exact duplicates, each conversation kept at its first occurrence."""
    copies = duplicate_of(records)
    return [r for position, r in enumerate(records) if position not in copies]

