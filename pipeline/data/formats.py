"""Reading chat datasets: every file kind and record shape, normalized to one `Record`.

Which files (`pipeline.data.readers`): JSON arrays, JSON Lines, Parquet, and
Arrow (IPC files, or a ``datasets`` ``save_to_disk`` directory), chosen by the
name and confirmed by the content; the file kind is named in every problem.
Which records (`pipeline.data.shapes`): OpenAI ``messages``, ShareGPT/LLaVA
``conversations``, TRL ``prompt`` / ``completion`` (strings or message lists)
Alpaca ``instruction`` / ``input`` / ``output`` and plain ``text``, each with optional
``id``, ``system`` and ``image`` / ``images`` (a text record: ``id`` only); a `FieldMap` (``data.columns`` /
``data.roles``) maps a dataset's own key and role names onto these. A file in
which no record has a shape gets one problem naming the keys it has.

Turns: ``content`` is a string or, in a message list, a list of content parts
(an assistant turn may carry its reasoning as ``reasoning_content``, kept in
the normalized message under that key): ``{"type": "text", "text": ...}`` and
``{"type": "image", "image" | "path" | "url": "a.png"}`` or
``{"type": "image_url", "image_url": {"url": "a.png"}}`` (local files only).

Images: an image's place in the conversation is the placeholder `IMAGE_PLACEHOLDER`
(``<image>``) in a user turn's text, LLaVA's convention; an OpenAI image part
becomes one. A record must hold exactly as many placeholders as images, all in
user turns (the model's processor puts each image's tokens where its
placeholder is, and a label never covers them).

Every record is normalized to a `Record`: roles mapped to user / assistant /
system, the system prompt first, content parts joined into one string with a
placeholder per image, image paths resolved against the dataset file's
directory (a ``save_to_disk`` directory's parent). `parse_file` never raises
on bad content: it returns the well-formed records and a `Problem` for every
fault it finds, so validation can report all of them at once (`ParsedFile.rejected`
keeps the images of a rejected record, so a missing image file is reported too).

Plain text records become one message of the role `TEXT_ROLE` (`Record.is_text`);
the chat renderer trains all of it, no template. Tool calls are kept on their
messages: an assistant message's ``tool_calls`` (arguments parsed to an object),
a ``tool`` message's ``tool_call_id`` / ``name``, the record's ``tools``. `load_records`
is the strict front door for the stages that only want clean data.

Exact duplicates (same messages and images) are found by `duplicate_of`; what
happens to them is the user's ``duplicates`` policy (`DUPLICATE_POLICIES`),
applied by validation and, for ``drop``, by tokenization (`drop_duplicates`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.data import readers
from pipeline.data.readers import KindError, Unreadable, describe_kind, json_type as _json_type
from pipeline.data.shapes import ROLE_ALIASES, FieldMap, accepted_text, detect
from pipeline.errors import DataError

__all__ = ["ROLE_ALIASES", "FieldMap"]  # re-exported: callers read roles and mappings from here

# Where an image sits in a turn's text (LLaVA's spelling; OpenAI image parts become one).
IMAGE_PLACEHOLDER = "<image>"

# Image references that are not local files.
_REMOTE_SCHEMES = ("http://", "https://", "data:")

# What to do with a conversation identical to an earlier one of the same file:
# error (a problem), warn (kept, reported), drop (every copy after the first removed).
DUPLICATE_POLICIES = ("error", "warn", "drop")

# The role of a plain text record's one message: no chat template, every token trained.
TEXT_ROLE = "text"

# Records of an unknown shape whose keys the file-level problem lists.
_KEYS_SHOWN = 12


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
    (`readers.KINDS`; None when that is not known).
    """

    file: str
    reason: str
    message: str
    index: int | None = None
    line: int | None = None
    id: str | None = None
    field: str | None = None
    kind: str | None = None

    def where(self) -> str:
        """'train.jsonl (JSON Lines) record 3 (line 4, id 'x')' -- as much as is known."""
        parts = []
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


@dataclass
class ParsedFile:
    """What `parse_file` found: clean records plus every problem, in file order."""

    path: Path
    layout: str  # the file kind, a key of `readers.KINDS`, or "unknown" (unreadable)
    sha256: str
    records: list[Record] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    records_seen: int = 0  # records in the file, including rejected ones
    # Records with a problem whose images could still be read: their image files are checked too,
    # so a record reports every defect at once (a missing placeholder and a missing file).
    rejected: list[Record] = field(default_factory=list)


def parse_file(path: str | Path, fields: FieldMap | None = None) -> ParsedFile:
    """Read and normalize every record of `path`, collecting (not raising) problems.

    A missing or unreadable path, or one that is no dataset kind, is itself a
    problem (reason ``file_not_found``, ``not_parquet``, ...). `fields`: the
    user's key and role names (`FieldMap`; none by default). All records in
    memory: `stream_file` is the same reading one record at a time.
    """
    parsed, records = stream_file(path, fields)
    parsed.records = list(records)
    return parsed


def stream_file(path: str | Path, fields: FieldMap | None = None) -> tuple[ParsedFile, Iterator[Record]]:
    """(`ParsedFile` without its records, the records one at a time): `parse_file` in bounded memory.

    The ParsedFile's `problems` and `records_seen` are complete once the
    iterator is exhausted (file-level faults such as a missing file are there
    at once, and the iterator is then empty).
    """
    path = Path(path)
    fields = fields or FieldMap()
    name = str(path)
    parsed = ParsedFile(path, "unknown", "")
    if not path.exists():
        parsed.problems.append(Problem(name, "file_not_found", "no such file or directory"))
        return parsed, iter(())
    try:
        kind = readers.sniff(path)
    except KindError as err:
        parsed.problems.append(Problem(name, err.reason, str(err)))
        return parsed, iter(())
    parsed.layout = kind
    parsed.sha256 = readers.fingerprint(path)
    unshaped = _unshaped_columns(path, kind, fields)
    if unshaped is not None:
        parsed.problems.append(Problem(name, "unknown_shape", unshaped, kind=kind))
        return parsed, iter(())
    return parsed, _scan(parsed, kind, fields)


def _scan(parsed: ParsedFile, kind: str, fields: FieldMap) -> Iterator[Record]:
    """The clean records of `parsed.path`; its problems and count go to `parsed` on the way."""
    path, name = parsed.path, str(parsed.path)
    base_dir = os.path.dirname(os.path.abspath(path))
    faults: list[tuple] = []
    shaped = 0
    unknown: list[Problem] = []  # one per record with no shape: one line for the file if no record has one
    keys: dict[str, None] = {}
    tally = _ShapeTally()
    for index, (line, raw) in enumerate(readers.read_raw(path, kind, faults)):
        parsed.records_seen += 1
        if isinstance(raw, Unreadable):
            parsed.problems.append(Problem(name, raw.reason, raw.message, index=index, line=line, kind=kind))
            continue
        record, problems = _normalize_record(raw, index=index, line=line, file=name, kind=kind, base_dir=base_dir,
                                             fields=fields)
        if any(p.reason == "missing_turns" for p in problems):
            unknown += problems
            keys.update(dict.fromkeys(raw))
        elif isinstance(raw, dict):
            shaped += 1
        parsed.problems.extend(problems)
        if record is None:
            continue
        tally.see(record)
        if not problems:
            yield record
        elif record.images:  # kept so validation also reports its missing images (a record reports every defect)
            parsed.rejected.append(record)
    parsed.problems += tally.problems(name, kind)
    parsed.problems += [Problem(name, reason, message, line=line, kind=kind) for reason, message, line in faults]
    if unknown and not shaped:
        dropped = {id(p) for p in unknown}
        parsed.problems = [p for p in parsed.problems if id(p) not in dropped]
        parsed.problems.append(Problem(name, "unknown_shape", _unknown_shape_text(list(keys)), kind=kind))
    if not parsed.records_seen and not parsed.problems:
        parsed.problems.append(Problem(name, "no_records", "the file holds no records", kind=kind))


class _ShapeTally:
    """Plain text records vs conversations among a file's clean records, counted as they stream past.

    A file holding both is refused rather than guessed: a text record is
    trained whole and a conversation only in its answers, so a mixed file is
    most often a conversation whose keys were not mapped (data.columns).
    """

    def __init__(self) -> None:
        self.text = self.chat = 0
        self.first_text: int | None = None
        self.first_chat: int | None = None

    def see(self, record: Record) -> None:
        if record.is_text:
            self.text += 1
            self.first_text = record.index if self.first_text is None else self.first_text
        else:
            self.chat += 1
            self.first_chat = record.index if self.first_chat is None else self.first_chat

    def problems(self, file: str, kind: str) -> list[Problem]:
        if not (self.text and self.chat):
            return []
        return [Problem(file, "mixed_shapes", f"{self.text} plain text record(s) (first: record {self.first_text}) "
                        f"and {self.chat} conversation(s) (first: record {self.first_chat}) in one file: a file "
                        "holds one kind; put the text records in a file of their own (a data mix can combine them)",
                        kind=kind)]


def _unshaped_columns(path: Path, kind: str, fields: FieldMap) -> str | None:
    """For Parquet / Arrow, the one-line problem when the schema's columns make no shape (no row read)."""
    names = readers.columns(path, kind)
    if names is None or detect(fields.view(dict.fromkeys(names))) is not None:
        return None
    return _unknown_shape_text(names, "columns")


def _unknown_shape_text(keys: list[str], what: str = "keys") -> str:
    shown = ", ".join(repr(k) for k in keys[:_KEYS_SHOWN]) + (" ..." if len(keys) > _KEYS_SHOWN else "")
    return (f"no record has a shape this pipeline reads: the {what} are {shown or 'none'}; accepted: "
            f"{accepted_text()}; if your keys are named otherwise, map them with data.columns "
            "(e.g. {prompt: question, completion: answer})")


def load_records(path: str | Path, fields: FieldMap | None = None) -> list[Record]:
    """All records of `path`, normalized; raises `DataError` listing the problems if any."""
    parsed = parse_file(path, fields)
    if parsed.problems:
        raise DataError(format_problems(parsed.problems, header=f"{path} is not a valid dataset"))
    return parsed.records


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

    ``loose=True`` also collapses whitespace in the text, so near-identical
    copies (re-wrapped lines, trailing spaces) compare equal across splits.
    """
    def text(m):
        return " ".join(m["content"].split()) if loose else m["content"]

    # Tool calls count (two turns that call different functions differ); without them the digest
    # is what it always was.
    items = [(m["role"], text(m), m["tool_calls"]) if m.get("tool_calls") else (m["role"], text(m))
             for m in messages]
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


# --- one record -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    """One turn as a shape gives it: its role and text, where each is in the record (None: not from the
    data), the turn dict itself for its extra keys (reasoning), and whether content parts may stand for its text."""

    role: object
    text: object
    role_at: str | None
    text_at: str
    source: dict | None = None
    parts: bool = False


def _normalize_record(
    raw: object, *, index: int, line: int | None, file: str, kind: str | None, base_dir: str,
    fields: FieldMap | None = None,
) -> tuple[Record | None, list[Problem]]:
    """Normalize one parsed JSON value; returns (record or None, every problem found).

    A record with problems is still returned when its turns and images could be
    read (None otherwise), so its image files are checked too; only a record
    without problems is clean.
    """
    fields = fields or FieldMap()
    problems: list[Problem] = []

    def problem(reason: str, message: str, field_: str | None = None, id_: str | None = None) -> None:
        problems.append(Problem(file, reason, message, index=index, line=line, id=id_, field=field_, kind=kind))

    if not isinstance(raw, dict):
        problem("not_object", f"a record must be a JSON object, found a JSON {_json_type(raw)}")
        return None, problems
    view = fields.view(raw)
    key = fields.key

    record_id = view.get("id")
    if isinstance(record_id, int) and not isinstance(record_id, bool):
        record_id = str(record_id)  # LLaVA exports often use numeric ids
    elif record_id is not None and not isinstance(record_id, str):
        problem("bad_id", f"id must be a string or an integer, found a JSON {_json_type(record_id)}", key("id"))
        record_id = None

    def located(reason: str, message: str, field_: str | None = None) -> None:
        problem(reason, message, field_, record_id)

    shape = detect(view)
    if shape is None:
        found = ", ".join(repr(k) for k in list(raw)[:_KEYS_SHOWN]) or "none"
        located("missing_turns", f"record has no accepted shape (its keys: {found}); accepted: {accepted_text()}")
        return None, problems
    if shape == "ambiguous":
        located("ambiguous_format", f"record has both {key('conversations')!r} and {key('messages')!r}")
        return None, problems
    if shape == "text":
        return _text_record(view, fields, located, record_id, index, line), problems
    turns, whole = _SHAPE_TURNS[shape](view, fields, located)
    if turns is None:
        return None, problems

    messages: list[dict[str, str]] = []
    part_images: list[str] = []  # images of OpenAI content parts, in order
    parts_ok = True
    turn_at: list[tuple[str | None, str] | None] = []  # message position -> (role field, text field); None: system
    roles_known = True
    for turn in turns:
        if turn is None:  # not an object: reported by the shape
            roles_known = False
            continue
        role = turn.role
        canonical = fields.role(role) if isinstance(role, str) else None
        if canonical is None:
            shown = "missing" if role is None else repr(role)
            located("unknown_role", f"role {shown} is not one of {fields.role_names()}", turn.role_at)
            roles_known = False
        text = turn.text
        if turn.parts and isinstance(text, list):  # OpenAI content parts
            text = _content_parts(text, turn.text_at, base_dir, part_images, located)
            if text is None:  # reported; the record's images are then unknown too
                parts_ok = False
                messages.append({"role": canonical or "", "content": ""})
                turn_at.append((turn.role_at, turn.text_at))
                continue
        calls = _tool_calls(turn, canonical, located)
        if text is not None and not isinstance(text, str):
            located("text_not_string", f"text must be a string, found a JSON {_json_type(text)}", turn.text_at)
        elif (text is None or not text.strip()) and calls is None:  # a turn that calls tools may say nothing
            located("empty_text", "text is missing or blank", turn.text_at)
        messages.append({"role": canonical or "", "content": text if isinstance(text, str) else ""})
        turn_at.append((turn.role_at, turn.text_at))
        if calls:
            messages[-1]["tool_calls"] = calls
        if canonical == "tool":  # which call a result answers, for the templates that show it
            messages[-1].update({k: turn.source[k] for k in ("tool_call_id", "name")
                                 if isinstance(turn.source.get(k), str)})
        reasoning = turn.source.get("reasoning_content") if turn.source else None
        if reasoning is not None:
            at = f"{turn.text_at.rpartition('.')[0] or turn.text_at}.reasoning_content"
            if canonical != "assistant" or not isinstance(reasoning, str):
                located("bad_reasoning", "reasoning_content must be a string, in an assistant turn", at)
            elif reasoning.strip():
                messages[-1]["reasoning_content"] = reasoning

    system = view.get("system")
    if system is not None and not isinstance(system, str):
        located("bad_system", f"'system' must be a string, found a JSON {_json_type(system)}", key("system"))
    elif system and system.strip():
        if messages and messages[0]["role"] == "system":
            located("bad_system", "record has both a 'system' field and a leading system turn", key("system"))
        else:
            messages.insert(0, {"role": "system", "content": system})
            turn_at.insert(0, None)

    if roles_known:
        violation = _order_violation(messages)
        if violation is not None:
            k, message = violation
            located("bad_role_order", message, key("system") if turn_at[k] is None else turn_at[k][0] or turn_at[k][1])
        elif not any(m["role"] == "assistant" for m in messages):
            located("no_assistant_turn", "the conversation has no assistant turn to learn from", whole)

    images = _images(view, base_dir, located, fields)
    if part_images and images:
        located("bad_image_field", "images given both as content parts and in the record's image field",
                key("image"))
    field_ = next((key(k) for k in ("image", "images") if view.get(k) is not None), whole)  # where the images are
    images = part_images or images
    if parts_ok:
        texts_at = [key("system") if at is None else at[1] for at in turn_at]
        _placeholder_problems(messages, texts_at, images, field_, located)
    tools = _tools(view, fields, located)
    return Record(id=record_id, messages=messages, images=images, index=index, line=line, tools=tools), problems


def _text_record(view: dict, fields: FieldMap, located: Located, record_id, index: int, line: int | None
                 ) -> Record:
    """A plain text record: its text as one `TEXT_ROLE` message; images and a system prompt are refused."""
    at = fields.key("text")
    text = view.get("text")
    if not isinstance(text, str):
        located("text_not_string", f"text must be a string, found a JSON {_json_type(text)}", at)
    elif not text.strip():
        located("empty_text", "text is missing or blank", at)
    for extra in ("image", "images", "system", "tools"):
        if view.get(extra) is not None:
            located("bad_text_record", f"a plain text record has no {extra!r} (it is trained as it is, without a "
                    "chat template); give a conversation instead", fields.key(extra))
    return Record(id=record_id, messages=[{"role": TEXT_ROLE, "content": text if isinstance(text, str) else ""}],
                  images=[], index=index, line=line)


def _tool_calls(turn: _Turn, role: str | None, located: Located) -> list[dict] | None:
    """A turn's ``tool_calls`` normalized (arguments parsed to an object), None when it has none.

    Only an assistant turn may call tools; each call is OpenAI's ``{"type": "function",
    "function": {"name", "arguments"}}`` (``type`` optional), arguments an object or its JSON text.
    """
    calls = turn.source.get("tool_calls") if turn.source else None
    if calls is None:
        return None
    at = f"{turn.text_at.rpartition('.')[0] or turn.text_at}.tool_calls"
    if role != "assistant":
        located("bad_tool_call", "only an assistant turn may have tool_calls", at)
        return None
    if not isinstance(calls, list) or not calls:
        located("bad_tool_call", f"tool_calls must be a non-empty list, found a JSON {_json_type(calls)}", at)
        return None
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                arguments = None
        if (not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict)
                or call.get("type", "function") != "function"):
            located("bad_tool_call", "a tool call is {\"type\": \"function\", \"function\": {\"name\": a string, "
                    "\"arguments\": an object or its JSON text}}", f"{at}[{j}]")
            return None
        out.append({"type": "function", "function": {"name": name, "arguments": arguments},
                    **({"id": call["id"]} if isinstance(call.get("id"), str) else {})})  # Mistral's templates show it
    return out


def _tools(view: dict, fields: FieldMap, located: Located) -> list[dict] | None:
    """The record's ``tools`` (function schemas for the chat template), None when it has none."""
    tools = view.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        located("bad_tools", f"tools must be a list of function schemas (objects), found a JSON {_json_type(tools)}",
                fields.key("tools"))
        return None
    return tools or None


# --- the shapes: each gives its turns (None for one that is not an object) and the field that names them all ---

Located = Callable[..., None]


def _turn_list(view: dict, list_key: str, fields: FieldMap, located: Located, *, role_key: str, text_key: str,
               parts: bool) -> list[_Turn | None] | None:
    """The turns of a list of turn objects (`list_key`, our name); None (reported) when it is no non-empty list."""
    name = fields.key(list_key)
    turns = view[list_key]
    if not isinstance(turns, list):
        located("turns_not_list", f"{name!r} must be a list of turns, found a JSON {_json_type(turns)}", name)
        return None
    if not turns:
        located("empty_turns", f"{name!r} is empty", name)
        return None
    role_key, text_key = fields.columns.get("role", role_key), fields.columns.get("content", text_key)
    out: list[_Turn | None] = []
    for j, turn in enumerate(turns):
        where = f"{name}[{j}]"
        if not isinstance(turn, dict):
            located("turn_not_object", f"turn {j} must be a JSON object, found a JSON {_json_type(turn)}", where)
            out.append(None)
            continue
        out.append(_Turn(turn.get(role_key), turn.get(text_key), f"{where}.{role_key}", f"{where}.{text_key}",
                         turn, parts))
    return out


def _messages_turns(view, fields, located):
    turns = _turn_list(view, "messages", fields, located, role_key="role", text_key="content", parts=True)
    return turns, fields.key("messages")


def _conversations_turns(view, fields, located):
    turns = _turn_list(view, "conversations", fields, located, role_key="from", text_key="value", parts=False)
    return turns, fields.key("conversations")


def _prompt_completion_turns(view, fields, located):
    """Strings: one user and one assistant turn. Message lists: the prompt's turns, then the completion's."""
    prompt, completion = view.get("prompt"), view.get("completion")
    p_name, c_name = fields.key("prompt"), fields.key("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        head = _turn_list(view, "prompt", fields, located, role_key="role", text_key="content", parts=True)
        tail = _turn_list(view, "completion", fields, located, role_key="role", text_key="content", parts=True)
        return (None if head is None or tail is None else head + tail), c_name
    if isinstance(prompt, list) or isinstance(completion, list):
        located("bad_prompt_completion", f"{p_name!r} and {c_name!r} must both be strings or both be message "
                f"lists, found a JSON {_json_type(prompt)} and a JSON {_json_type(completion)}", p_name)
        return None, c_name
    return [_Turn("user", prompt, None, p_name), _Turn("assistant", completion, None, c_name)], c_name


def _alpaca_turns(view, fields, located):
    """The instruction (a blank line, then the input when there is one) as the user turn; the output as the answer."""
    instruction, extra = view.get("instruction"), view.get("input")
    if extra is not None and not isinstance(extra, str):
        located("text_not_string", f"text must be a string, found a JSON {_json_type(extra)}", fields.key("input"))
    elif isinstance(instruction, str) and extra and extra.strip():
        instruction = f"{instruction}\n\n{extra}"
    return [_Turn("user", instruction, None, fields.key("instruction")),
            _Turn("assistant", view.get("output"), None, fields.key("output"))], fields.key("output")


_SHAPE_TURNS = {
    "messages": _messages_turns,
    "conversations": _conversations_turns,
    "prompt_completion": _prompt_completion_turns,
    "alpaca": _alpaca_turns,
}


# The turns that may follow a turn: after an assistant turn that calls tools come their results
# (tool turns), then the assistant goes on.
_NEXT = {None: ("user",), "user": ("assistant",), "assistant": ("user",), "assistant+calls": ("tool",),
         "tool": ("tool", "assistant")}


def _order_violation(messages: list[dict[str, str]]) -> tuple[int, str] | None:
    """First break of: optional system first, then user/assistant alternating from user, where an
    assistant turn with tool calls is followed by one or more tool turns and then the assistant again.

    Returns (message position, explanation) or None.
    """
    start = 1 if messages and messages[0]["role"] == "system" else 0
    state = None
    for k in range(start, len(messages)):
        role = messages[k]["role"]
        if role == "system":
            return k, "a system turn is only allowed first"
        if role not in _NEXT[state]:
            after = {None: "as the first turn", "assistant+calls": "after an assistant turn with tool_calls"}.get(
                state, f"after {messages[k - 1]['role']!r}")
            message = f"turn is {role!r} {after}; user and assistant turns must alternate, starting with user"
            if "tool" in (role, state) or state == "assistant+calls":
                message += "; tool turns follow an assistant turn with tool_calls (its results), then the assistant"
            return k, message
        state = "assistant+calls" if messages[k].get("tool_calls") else role
    return None


def _content_parts(parts: list, where: str, base_dir: str, images: list[str], located) -> str | None:
    """An OpenAI content-part list as one string, an `IMAGE_PLACEHOLDER` per image part.

    Appends each image's resolved path to `images`; returns None (after
    reporting why) for a part it cannot read.
    """
    texts = []
    for k, part in enumerate(parts):
        at = f"{where}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image", "image_url"):
            ref = _image_ref(part)
            if ref is None:
                located("bad_image_field", f"an {kind} part needs a local file path "
                        "('image', 'path' or 'url'; image_url: {'url': ...})", at)
                return None
            if ref.startswith(_REMOTE_SCHEMES):
                located("bad_image_field", f"{ref[:40]!r} is not a local file (only image files on disk are read)", at)
                return None
            texts.append(IMAGE_PLACEHOLDER)
            images.append(_resolve(base_dir, ref.removeprefix("file://")))
        else:
            shown = f"type {kind!r}" if kind is not None else f"a JSON {_json_type(part)} without a 'type'"
            located("bad_content_part", f"content part {k} is {shown}; expected text, image or image_url "
                    "(a text part needs a string 'text')", at)
            return None
    return "".join(texts)


def _image_ref(part: dict) -> str | None:
    if part["type"] == "image_url":
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
    else:
        value = next((part[k] for k in ("image", "path", "url") if isinstance(part.get(k), str)), None)
    return value if isinstance(value, str) and value.strip() else None


def _placeholder_problems(messages, texts_at: list[str], images, images_field: str, located) -> None:
    """Every placeholder sits in a user turn, and there is one per image; `texts_at[k]` names message k's text."""
    count = 0
    for k, message in enumerate(messages):
        n = message["content"].count(IMAGE_PLACEHOLDER)
        count += n
        if n and message["role"] != "user":
            located("image_outside_user_turn", f"{IMAGE_PLACEHOLDER} in a {message['role']} turn: images go in user "
                    "turns (the tokens of an image are never learned)", texts_at[k])
    if count != len(images):
        located("image_placeholder_mismatch", f"{count} {IMAGE_PLACEHOLDER} placeholder(s) in the turns but "
                f"{len(images)} image(s): each image needs exactly one placeholder where it goes", images_field)


def _resolve(base_dir: str, path: str) -> str:
    return os.path.normpath(os.path.join(base_dir, path))


def _images(raw: dict, base_dir: str, located, fields: FieldMap) -> list[str]:
    """The record's image paths, resolved against the dataset file's directory."""
    present = [key for key in ("image", "images") if raw.get(key) is not None]
    if not present:
        return []
    if len(present) > 1:
        located("bad_image_field", f"record has both {fields.key('image')!r} and {fields.key('images')!r}",
                fields.key("image"))
        return []
    key = present[0]
    value = raw[key]
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(p, str) and p.strip() for p in items):
        located("bad_image_field", f"'{fields.key(key)}' must be a non-empty path string or a list of them",
                fields.key(key))
        return []
    return [_resolve(base_dir, p) for p in items]
