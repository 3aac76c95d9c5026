"""One raw record (a decoded JSON object, or a table row) normalized to a `Record`, with every problem it has.

Turns: ``content`` is a string or, in a message list, a list of content parts
(an assistant turn may carry its reasoning as ``reasoning_content``, kept in
the normalized message under that key): ``{"type": "text", "text": ...}`` and
``{"type": "image", "image" | "path" | "url": "a.png"}`` or
``{"type": "image_url", "image_url": {"url": "a.png"}}`` (local files only).
LLaMA-Factory v1's parts hold a ``value`` instead: ``text``, ``image_url`` (a path),
and in an assistant turn ``reasoning`` and ``tool_call`` (the JSON of one call);
its per-message ``loss_weight`` is read as ``weight``.

Images: an image's place in the conversation is the placeholder `IMAGE_PLACEHOLDER`
(``<image>``) in a user turn's text, LLaVA's convention; an OpenAI image part
becomes one; a ``texts`` record (The Cauldron, FineVision) that has none gets its
images before its first user turn's text, where those datasets' models take them.
A record must hold exactly as many placeholders as images, all in user turns
(the model's processor puts each image's tokens where its placeholder is, and
a label never covers them).

Every record is normalized to a `Record`: roles mapped to user / assistant /
system, the system prompt first, content parts joined into one string with a
placeholder per image, image paths resolved against the dataset file's
directory (a ``save_to_disk`` directory's parent). Plain text records become
one message of the role `TEXT_ROLE`. Tool calls are kept on their messages: an
assistant message's ``tool_calls`` (arguments parsed to an object), a ``tool``
message's ``tool_call_id`` / ``name``, the record's ``tools``. An assistant turn
with ``"weight": 0`` (OpenAI's fine-tuning format) keeps it: context, not trained.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.data import images
from pipeline.data.readers import json_type as _json_type
from pipeline.data.records import IMAGE_PLACEHOLDER, TEXT_ROLE, Problem, Record
from pipeline.data.shapes import FieldMap, accepted_text, detect

# The fields an assistant turn may carry its reasoning in (either one; kept as `reasoning_content`).
REASONING_INPUTS = ("reasoning_content", "thinking")


# LLaMA-Factory's ShareGPT role of an assistant turn that calls tools: its text is the call(s) as JSON.
CALL_ROLE = "function_call"

# An assistant turn's training switch, as OpenAI's fine-tuning format writes it: 0 = context only, 1 = trained
# (the default). Kept on the normalized message only when 0. LLaMA-Factory v1 calls it `loss_weight`.
WEIGHT = "weight"
WEIGHT_INPUTS = (WEIGHT, "loss_weight")

# Image references that are not local files.
_REMOTE_SCHEMES = ("http://", "https://")

# Media fields this pipeline cannot train on: LLaMA-Factory's `videos` / `audios` (with `<video>` / `<audio>` in
# the text), lmms-finetune's and Qwen-Omni recipes' `video` / `audio`. A plural field is media whatever it holds;
# a singular one when it names media files (a `video` field may be an id or a URL in a text dataset).
_MEDIA_FIELDS = {"videos": "video", "audios": "audio", "video": "video", "audio": "audio"}
# Content parts of video and audio: OpenAI's input_audio, LLaMA-Factory v1's video_url / audio_url, HF's video / audio.
_MEDIA_PARTS = {"video_url": "video", "video": "video", "audio_url": "audio", "audio": "audio",
                "input_audio": "audio"}
_MEDIA_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".flv", ".wav", ".mp3", ".flac", ".ogg", ".m4a", ".opus")



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


KEYS_SHOWN = 12  # keys of a record of no shape that its problem lists

Located = Callable[..., None]  # located(reason, message, field): one problem of the record being normalized


def normalize_record(
    raw: object, *, index: int, line: int | None, file: str, kind: str | None, base_dir: str,
    fields: FieldMap | None = None,
) -> tuple[Record | None, list[Problem]]:
    """Normalize one raw record; returns (record or None, every problem found).

    A record with problems is still returned when its turns and images could be
    read (None otherwise), so its image files are checked too; only a record
    without problems is clean.
    """
    fields = fields or FieldMap()
    problems: list[Problem] = []

    def problem(reason: str, message: str, field_: str | None = None, id_: str | None = None) -> None:
        problems.append(Problem(file, reason, message, index=index, line=line, id=id_, field=field_, kind=kind))

    if not isinstance(raw, dict):
        array = isinstance(raw, list) and raw and all(isinstance(x, dict) for x in raw) and line is not None
        hint = (f" ({len(raw)} records in one array on one line: JSON Lines holds one record per line; a JSON array "
                "is a .json file)") if array else ""
        problem("not_object", f"a record must be a JSON object, found a JSON {_json_type(raw)}{hint}")
        return None, problems
    view = fields.view(raw)
    record_id = _record_id(view, fields, problem)

    def located(reason: str, message: str, field_: str | None = None) -> None:
        problem(reason, message, field_, record_id)

    shape = detect(view)
    if shape is None:
        found = ", ".join(repr(k) for k in list(raw)[:KEYS_SHOWN]) or "none"
        located("missing_turns", f"record has no accepted shape (its keys: {found}); accepted: {accepted_text()}")
        return None, problems
    if shape == "ambiguous":
        located("ambiguous_format", f"record has both {fields.key('conversations')!r} and {fields.key('messages')!r}")
        return None, problems
    _media(view, located)
    _preference(view, located)
    if shape == "text":
        return _text_record(view, fields, located, record_id, index, line), problems
    turns, whole = _SHAPE_TURNS[shape](view, fields, located)
    if turns is None:
        return None, problems
    conversation = _Conversation(base_dir, fields, located)
    for turn in turns:
        conversation.add(turn)
    conversation.add_system(view.get("system"))
    conversation.check_order(whole)
    images = conversation.images(view, whole, images_first=shape == "texts")
    tools = _tools(view, fields, located)
    return Record(id=record_id, messages=conversation.messages, images=images, index=index, line=line,
                  tools=tools), problems


def _record_id(view: dict, fields: FieldMap, problem: Callable[..., None]) -> str | None:
    """The record's id as a string (LLaVA exports often use numeric ids); None, reported, for another type."""
    record_id = view.get("id")
    if isinstance(record_id, int) and not isinstance(record_id, bool):
        return str(record_id)
    if record_id is not None and not isinstance(record_id, str):
        problem("bad_id", f"id must be a string or an integer, found a JSON {_json_type(record_id)}", fields.key("id"))
        return None
    return record_id


class _Conversation:
    """A conversation's messages as its turns come in, with where each came from (its problems name that)."""

    def __init__(self, base_dir: str, fields: FieldMap, located: Located):
        self.base_dir, self.fields, self.located = base_dir, fields, located
        self.messages: list[dict] = []
        self.part_images: list[str] = []  # images of OpenAI content parts, in order
        self.parts_ok = True
        self.turn_at: list[tuple[str | None, str] | None] = []  # message -> (role field, text field); None: system
        self.roles_known = True

    def add(self, turn: _Turn | None) -> None:
        """One turn (None: a turn that is no object, reported by its shape)."""
        located = self.located
        if turn is None:
            self.roles_known = False
            return
        role = turn.role
        canonical = self.fields.role(role) if isinstance(role, str) else None
        if canonical is None:
            shown = "missing" if role is None else repr(role)
            located("unknown_role", f"role {shown} is not one of {self.fields.role_names()}", turn.role_at)
            self.roles_known = False
        text, parts = turn.text, None
        if turn.parts and isinstance(text, list):  # OpenAI content parts
            parts = _content_parts(text, turn.text_at, self.base_dir, self.part_images, located)
            if parts is None:  # reported; the record's images are then unknown too
                self.parts_ok = False
                self.messages.append({"role": canonical or "", "content": ""})
                self.turn_at.append((turn.role_at, turn.text_at))
                return
            text = parts.text
        calls = _tool_calls(turn, canonical, located)
        if parts is not None and parts.calls:
            if canonical != "assistant":
                located("bad_tool_call", "only an assistant turn may have tool_call parts", parts.calls_at)
            elif calls:
                located("bad_tool_call", "a turn gives its tool calls twice (tool_calls and tool_call parts): "
                        "keep one", parts.calls_at)
            else:
                calls = parts.calls
        if canonical == "assistant" and isinstance(role, str) and role.strip().lower() == CALL_ROLE:
            calls, text = _call_turn(text, turn.text_at, located), ""
        if text is not None and not isinstance(text, str):
            located("text_not_string", f"text must be a string, found a JSON {_json_type(text)}", turn.text_at)
        elif (text is None or not text.strip()) and calls is None and not (canonical == "system" and text == ""):
            # a turn that calls tools may say nothing; an empty system prompt is one (Orca-AgentInstruct's)
            located("empty_text", "text is missing or blank", turn.text_at)
        message = {"role": canonical or "", "content": text if isinstance(text, str) else ""}
        self.messages.append(message)
        self.turn_at.append((turn.role_at, turn.text_at))
        if calls:
            message["tool_calls"] = calls
        if canonical == "tool":  # which call a result answers, for the templates that show it
            message.update({k: turn.source[k] for k in ("tool_call_id", "name") if isinstance(turn.source.get(k), str)})
        # Reasoning: `reasoning_content` (Qwen3, DeepSeek), `thinking` (GPT-OSS / harmony datasets) or reasoning
        # parts (LLaMA-Factory v1), one of them.
        turn_at = turn.text_at.rpartition('.')[0] or turn.text_at
        given = [(k, turn.source[k], f"{turn_at}.{k}") for k in REASONING_INPUTS
                 if turn.source and turn.source.get(k) is not None]
        if parts is not None and parts.reasoning is not None:
            given.append(("a reasoning part", parts.reasoning, parts.reasoning_at))
        if given:
            name, reasoning, at = given[0]
            if len(given) > 1:
                located("bad_reasoning", f"a turn gives its reasoning twice ({' and '.join(g[0] for g in given)}): "
                        "keep one", at)
            elif canonical != "assistant" or not isinstance(reasoning, str):
                located("bad_reasoning", f"{name} must be a string, in an assistant turn", at)
            elif reasoning.strip():
                message["reasoning_content"] = reasoning
        key = next((k for k in WEIGHT_INPUTS if turn.source and turn.source.get(k) is not None), None)
        if key is not None:
            weight, at = turn.source[key], f"{turn_at}.{key}"
            if isinstance(weight, bool) or weight not in (0, 1):
                located("bad_weight", f"{key} must be 0 (not trained) or 1 (trained), found {weight!r}", at)
            elif weight == 1 and canonical != "assistant":
                located("bad_weight", f"{key} 1 on a {canonical or 'non-assistant'} turn: only assistant turns "
                                      "are trained", at)
            elif weight == 0 and canonical == "assistant":
                message[WEIGHT] = 0

    def add_system(self, system: object) -> None:
        """The record's `system` field: the first message (a leading system turn as well is a problem)."""
        at = self.fields.key("system")
        if system is not None and not isinstance(system, str):
            self.located("bad_system", f"'system' must be a string, found a JSON {_json_type(system)}", at)
        elif system and system.strip():
            if self.messages and self.messages[0]["role"] == "system":
                self.located("bad_system", "record has both a 'system' field and a leading system turn", at)
            else:
                self.messages.insert(0, {"role": "system", "content": system})
                self.turn_at.insert(0, None)

    def check_order(self, whole: str) -> None:
        """The turns alternate as a chat template needs them to, and one of them is the assistant's."""
        if not self.roles_known:
            return
        violation = _order_violation(self.messages)
        if violation is not None:
            k, message = violation
            at = self.fields.key("system") if self.turn_at[k] is None else self.turn_at[k][0] or self.turn_at[k][1]
            self.located("bad_role_order", message, at)
        elif not any(m["role"] == "assistant" for m in self.messages):
            self.located("no_assistant_turn", "the conversation has no assistant turn to learn from", whole)

    def images(self, view: dict, whole: str, images_first: bool = False) -> list[str]:
        """The record's images (its content parts' or its image field's), and one placeholder for each.
        `images_first` (a shape without placeholders): turns that hold none get one per image before the first
        user turn's text."""
        key = self.fields.key
        found = _images(view, self.base_dir, self.located, self.fields)
        if self.part_images and found:
            self.located("bad_image_field", "images given both as content parts and in the record's image field",
                         key("image"))
        field_ = next((key(k) for k in ("image", "images") if view.get(k) is not None), whole)  # where the images are
        images = self.part_images or found or []
        first_user = next((m for m in self.messages if m["role"] == "user"), None)
        if images_first and images and first_user and not any(IMAGE_PLACEHOLDER in m["content"] for m in self.messages):
            first_user["content"] = IMAGE_PLACEHOLDER * len(images) + first_user["content"]
        if self.parts_ok and found is not None:  # a bad image field is its own one problem
            texts_at = [key("system") if at is None else at[1] for at in self.turn_at]
            _placeholder_problems(self.messages, texts_at, images, field_, self.located)
        return images


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


def _media(view: dict, located: Located) -> None:
    """Reports the video and audio a record holds: trained as it is, the model would see their placeholders as
    text and never the media."""
    for key, kind in _MEDIA_FIELDS.items():
        value = view.get(key)
        items = value if isinstance(value, list) else [] if value in (None, "") else [value]
        if items and (key.endswith("s") or any(_is_media(v) for v in items)):
            located("unsupported_media", f"{key!r} holds {kind}, which this pipeline does not train on (text and "
                    f"images only): drop the field and its <{kind}> placeholders, or the record", key)


def _preference(view: dict, located: Located) -> None:
    """Reports preference data, which SFT would misread: a paired record (``chosen`` / ``rejected``, DPO's; its
    turns are only the prompt) and an unpaired one marked undesirable (``"label": false``, KTO's: training on it
    teaches the answer it rejects)."""
    if view.get("chosen") is not None and view.get("rejected") is not None:
        located("preference_record", "a preference record (chosen / rejected, for DPO): SFT trains one answer; make "
                "the chosen answer the conversation's last assistant turn and drop rejected", "chosen")
    elif view.get("label") is False:
        located("preference_record", "label false marks this answer undesirable (KTO data): training on it teaches "
                "it; keep only the records labelled true", "label")


def _is_media(value) -> bool:
    """Whether a `video` / `audio` value is media rather than an id: a media file's name, bytes, or a `datasets`
    Audio / Video value (``{"bytes", "path"}`` as stored, ``{"array", "sampling_rate"}`` decoded)."""
    if isinstance(value, str):
        return value.lower().endswith(_MEDIA_SUFFIXES)
    return isinstance(value, (bytes, bytearray)) or isinstance(value, dict) and ("bytes" in value or "array" in value)


def _tool_calls(turn: _Turn, role: str | None, located: Located) -> list[dict] | None:
    """A turn's ``tool_calls`` normalized (arguments parsed to an object), None when it has none.

    Only an assistant turn may call tools; each call is OpenAI's ``{"type": "function",
    "function": {"name", "arguments"}}`` (``type`` optional), arguments an object or its JSON text.
    OpenAI's older ``function_call`` (``{"name", "arguments"}``, one call) is read as one such call.
    """
    source = turn.source or {}
    key = "tool_calls" if source.get("tool_calls") is not None or source.get("function_call") is None else "function_call"
    calls = source.get(key)
    if calls is None:
        return None
    at = f"{turn.text_at.rpartition('.')[0] or turn.text_at}.{key}"
    if role != "assistant":
        located("bad_tool_call", f"only an assistant turn may have {key}", at)
        return None
    if key == "function_call":
        calls = [{"type": "function", "function": calls}]
    if not isinstance(calls, list) or not calls:
        located("bad_tool_call", f"tool_calls must be a non-empty list, found a JSON {_json_type(calls)}", at)
        return None
    return _calls(calls, at, located)


def _call_turn(text, at: str, located: Located, *, what: str = f"a {CALL_ROLE} turn's text") -> list[dict] | None:
    """The calls of a turn whose role is `CALL_ROLE` (LLaMA-Factory's ShareGPT tool data), or of a ``tool_call`` part
    (LLaMA-Factory v1; `what` names it): its text is the JSON of one call, ``{"name", "arguments"}``, or of a list."""
    try:
        parsed = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, (dict, list)) or not parsed:
        located("bad_tool_call", f"{what} must be the JSON of its call ({{\"name\": ..., \"arguments\": ...}}) or "
                "of a list of calls", at)
        return None
    return _calls([{"type": "function", "function": c} for c in (parsed if isinstance(parsed, list) else [parsed])],
                  at, located)


def _calls(calls: list, at: str, located: Located) -> list[dict] | None:
    """Tool calls normalized (arguments parsed to an object); None, reported, at the first that is not one."""
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
    """The record's ``tools`` (function schemas for the chat template), None when it has none; OpenAI's older
    ``functions`` (the schemas alone) are those tools."""
    tools = view.get("tools")
    if tools is None and isinstance(view.get("functions"), list):
        tools = view["functions"]
    if isinstance(tools, str) and tools.lstrip().startswith("["):  # LLaMA-Factory keeps them as their JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            located("bad_tools", f"tools holds text that is not a JSON list: {err.msg} at column {err.colno}",
                    fields.key("tools"))
            return None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        located("bad_tools", f"tools must be a list of function schemas (objects), found a JSON {_json_type(tools)}",
                fields.key("tools"))
        return None
    # A bare schema ({"name", "description", "parameters"}: OpenAI's older `functions`, LLaMA-Factory's tools) is
    # the function of an OpenAI tool.
    return [t if "function" in t or "name" not in t else {"type": "function", "function": t} for t in tools] or None


# --- the shapes: each gives its turns (None for one that is not an object) and the field that names them all ---


def _turn_list(view: dict, list_key: str, fields: FieldMap, located: Located, *, role_key: str, text_key: str,
               parts: bool) -> list[_Turn | None] | None:
    """The turns of a list of turn objects (`list_key`, our name); None (reported) when it is no non-empty list."""
    name = fields.key(list_key)
    turns = view[list_key]
    if isinstance(turns, str) and turns.lstrip().startswith("["):  # the list as its JSON text (Orca-AgentInstruct)
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError as err:
            located("turns_not_list", f"{name!r} holds text that is not a JSON list of turns: {err.msg} at column "
                    f"{err.colno}", name)
            return None
    if not isinstance(turns, list):
        located("turns_not_list", f"{name!r} must be a list of turns, found a JSON {_json_type(turns)}", name)
        return None
    if not turns:
        located("empty_turns", f"{name!r} is empty", name)
        return None
    mapped = "role" in fields.columns or "content" in fields.columns
    role_key, text_key = fields.columns.get("role", role_key), fields.columns.get("content", text_key)
    out: list[_Turn | None] = []
    for j, turn in enumerate(turns):
        where = f"{name}[{j}]"
        if not isinstance(turn, dict):
            located("turn_not_object", f"turn {j} must be a JSON object, found a JSON {_json_type(turn)}", where)
            out.append(None)
            continue
        keys = (role_key, text_key) if mapped else _turn_keys(turn, role_key, text_key)
        pair = None if mapped or keys[0] in turn or keys[1] in turn else _exchange_keys(turn)
        if pair:  # one exchange: the user's turn and the answer (Capybara's input / output)
            out += [_Turn(role, turn.get(key), None, f"{where}.{key}")
                    for role, key in zip(("user", "assistant"), pair)]
            continue
        out.append(_Turn(turn.get(keys[0]), turn.get(keys[1]), f"{where}.{keys[0]}", f"{where}.{keys[1]}", turn,
                         parts or keys == ("role", "content")))
    return out


_EXCHANGE_KEYS = (("user", "assistant"), ("input", "output"))  # The Cauldron's; Capybara's


def _exchange_keys(turn: dict) -> tuple[str, str] | None:
    """The (question, answer) keys of an item that is one exchange rather than one turn, None for another item."""
    return next((keys for keys in _EXCHANGE_KEYS if keys[0] in turn or keys[1] in turn), None)


_TURN_KEYS = (("role", "content"), ("from", "value"))  # OpenAI's, ShareGPT's


def _turn_keys(turn: dict, role_key: str, text_key: str) -> tuple[str, str]:
    """A turn's (role, text) keys: the shape's own, or the other convention's where the turn has those and not the
    shape's (ShareGPT `conversations` of role / content turns, as many exports write them)."""
    if role_key in turn or text_key in turn:
        return role_key, text_key
    return next((keys for keys in _TURN_KEYS if keys[0] in turn and keys[1] in turn), (role_key, text_key))


def _messages_turns(view, fields, located):
    turns = _turn_list(view, "messages", fields, located, role_key="role", text_key="content", parts=True)
    return turns, fields.key("messages")


def _conversations_turns(view, fields, located):
    turns = _turn_list(view, "conversations", fields, located, role_key="from", text_key="value", parts=False)
    return turns, fields.key("conversations")


def _conversation_turns(view, fields, located):
    """LMSYS-Chat-1M's and WildChat's `conversation`: OpenAI turns (role, content) under another key."""
    turns = _turn_list(view, "conversation", fields, located, role_key="role", text_key="content", parts=True)
    return turns, fields.key("conversation")


def _prompt_completion_turns(view, fields, located):
    """Each side a string (a user turn; the completion: an assistant turn) or a message list (its turns): the
    prompt's turns, then the completion's. Either may be a list with the other a string (a message-list prompt
    answered by a string: NVIDIA's Nemotron post-training data, its `input` and `output`)."""
    def side(ours: str, role: str) -> list[_Turn | None] | None:
        if isinstance(view.get(ours), list):
            return _turn_list(view, ours, fields, located, role_key="role", text_key="content", parts=True)
        return [_Turn(role, view.get(ours), None, fields.key(ours))]

    head, tail = side("prompt", "user"), side("completion", "assistant")
    return (None if head is None or tail is None else head + tail), fields.key("completion")


def _alpaca_turns(view, fields, located):
    """The instruction (a blank line, then the input when there is one) as the user turn; the output as the answer.
    LLaMA-Factory's ``history`` (earlier [instruction, response] pairs) comes first, its responses trained too."""
    instruction, extra = view.get("instruction"), view.get("input")
    if extra is not None and not isinstance(extra, str):
        located("text_not_string", f"text must be a string, found a JSON {_json_type(extra)}", fields.key("input"))
    elif isinstance(instruction, str) and extra and extra.strip():
        instruction = f"{instruction}\n\n{extra}"
    return [*_history_turns(view.get("history"), fields.key("history"), located),
            _Turn("user", instruction, None, fields.key("instruction")),
            _Turn("assistant", view.get("output"), None, fields.key("output"))], fields.key("output")


def _history_turns(history, name: str, located: Located) -> list[_Turn]:
    """An Alpaca record's earlier exchanges: each [instruction, response] a user turn and its answer."""
    if history is None:
        return []
    if not isinstance(history, list):
        located("bad_history", f"{name!r} must be a list of [instruction, response] pairs, found a JSON "
                f"{_json_type(history)}", name)
        return []
    turns = []
    for j, pair in enumerate(history):
        if not isinstance(pair, list) or len(pair) != 2:
            located("bad_history", f"{name}[{j}] must be an [instruction, response] pair", f"{name}[{j}]")
            continue
        for k, (role, text) in enumerate(zip(("user", "assistant"), pair)):
            turns.append(_Turn(role, text, None, f"{name}[{j}][{k}]"))
    return turns


def _texts_turns(view, fields, located):
    """The Cauldron's / FineVision's exchanges: each ``{"user": ..., "assistant": ...}`` a user turn and its answer
    (`_exchange_keys`)."""
    turns = _turn_list(view, "texts", fields, located, role_key="role", text_key="content", parts=False)
    return turns, fields.key("texts")


_SHAPE_TURNS = {
    "messages": _messages_turns,
    "conversations": _conversations_turns,
    "conversation": _conversation_turns,
    "prompt_completion": _prompt_completion_turns,
    "alpaca": _alpaca_turns,
    "texts": _texts_turns,
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


@dataclass
class _Parts:
    """A turn's content parts read: its text (an `IMAGE_PLACEHOLDER` per image), and LLaMA-Factory v1's reasoning
    and tool calls, with where the first of each is."""

    text: str
    reasoning: str | None = None
    reasoning_at: str = ""
    calls: list[dict] | None = None
    calls_at: str = ""


def _content_parts(parts: list, where: str, base_dir: str, images: list[str], located) -> _Parts | None:
    """A content-part list (OpenAI's; LLaMA-Factory v1's, whose parts hold a ``value``) read as one `_Parts`.

    Appends each image's resolved path to `images`; an image part that holds no image (``{"type": "image"}``,
    TRL's vision datasets) only marks the place of the record's next image in its `images` field. Returns None
    (after reporting why) for a part it cannot read.
    """
    texts, reasoning, calls, first = [], [], [], {}
    for k, part in enumerate(parts):
        at = f"{where}[{k}]"
        kind = part.get("type") if isinstance(part, dict) else None
        value = next((part[key] for key in ("text", "value") if isinstance(part.get(key), str)), None) \
            if kind in ("text", "reasoning", "tool_call") else None
        if kind == "text" and value is not None:
            texts.append(value)
        elif kind == "reasoning" and value is not None:
            reasoning.append(value)
            first.setdefault("reasoning", at)
        elif kind == "tool_call" and value is not None:
            called = _call_turn(value, at, located, what="a tool_call part's value")
            if called is None:
                return None
            calls += called
            first.setdefault("calls", at)
        elif kind == "image" and all(part.get(key) is None for key in ("image", "path", "url")):
            texts.append(IMAGE_PLACEHOLDER)
        elif kind in ("image", "image_url"):
            path, why = _part_image(part, base_dir)
            if path is None:
                located("bad_image_field", why, at)
                return None
            texts.append(IMAGE_PLACEHOLDER)
            images.append(path)
        elif kind in _MEDIA_PARTS:
            located("unsupported_media", f"content part {k} is {_MEDIA_PARTS[kind]}, which this pipeline does not "
                    "train on (text and images only): drop the part, or the record", at)
            return None
        else:
            shown = f"type {kind!r}" if kind is not None else f"a JSON {_json_type(part)} without a 'type'"
            located("bad_content_part", f"content part {k} is {shown}; expected text, image or image_url "
                    "(a text part needs a string 'text' or 'value')", at)
            return None
    return _Parts("".join(texts), "".join(reasoning) if reasoning else None, first.get("reasoning", ""),
                  calls or None, first.get("calls", ""))


def _part_image(part: dict, base_dir: str) -> tuple[str | None, str | None]:
    """(the file of an image part, None) or (None, why not): a local path or file:// URL, a base64 `data:` URL,
    or (an `image` part) a `datasets` Image value or bytes; an embedded image is written to the image store."""
    if part["type"] == "image" and _embedded(part.get("image")) is not None:
        return _image_path(part["image"], base_dir)
    ref = _image_ref(part)
    if ref is None:
        return None, (f"an {part['type']} part needs a local file path ('image', 'path' or 'url'; image_url: "
                      "{'url': ...}), a base64 data: URL or the image's bytes")
    if ref.startswith("data:"):
        data = images.data_url_bytes(ref)
        return _image_path(data, base_dir) if data is not None else (None, f"{ref[:40]!r}... is not a base64 data: URL")
    if ref.startswith(_REMOTE_SCHEMES):
        return None, f"{ref[:40]!r} is not a local file (images are read from disk, a data: URL or the record)"
    return _image_path(ref.removeprefix("file://"), base_dir)


def _image_ref(part: dict) -> str | None:
    if part["type"] == "image_url":  # OpenAI's {"url": ...}; LLaMA-Factory v1's path in `value`
        value = part.get("image_url", part.get("value"))
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


def _embedded(item) -> bytes | None:
    """An image's own bytes: raw, or a `datasets` Image value (`{"bytes": ..., "path": ...}`) holding them."""
    data = item if isinstance(item, (bytes, bytearray)) else item.get("bytes") if isinstance(item, dict) else None
    return bytes(data) if isinstance(data, (bytes, bytearray)) else None


def _image_path(item, base_dir: str) -> tuple[str | None, str | None]:
    """(the file of one image item, None) or (None, why not). An item is a path (resolved against `base_dir`),
    a `datasets` Image value of a file (`bytes` None), or an image's own bytes, written to the image store
    (`images.write_embedded`)."""
    if isinstance(item, dict) and item.get("bytes") is None and isinstance(item.get("path"), str):
        item = item["path"]
    if isinstance(item, str):
        return (_resolve(base_dir, item), None) if item.strip() else (None, "an empty path")
    data = _embedded(item)
    if data is None:
        return None, (f"a JSON {_json_type(item)}: an image is a path string, a `datasets` Image value "
                      "({'bytes', 'path'}) or its bytes")
    try:
        return images.write_embedded(data), None
    except OSError as err:
        return None, (f"an embedded image, which could not be written to {images.store_dir()}: {err} (HF_HOME "
                      "chooses where: the store is HF_HOME/sft-pipeline/images)")


def _resolve(base_dir: str, path: str) -> str:
    return os.path.normpath(os.path.join(base_dir, path))


def _images(raw: dict, base_dir: str, located, fields: FieldMap) -> list[str] | None:
    """The record's image paths, resolved against the dataset file's directory; None (after reporting why) when
    its image field cannot be read."""
    present = [key for key in ("image", "images") if raw.get(key) is not None]
    if not present:
        return []
    if len(present) > 1:
        located("bad_image_field", f"record has both {fields.key('image')!r} and {fields.key('images')!r}",
                fields.key("image"))
        return None
    key = present[0]
    value = raw[key]
    items = [value] if isinstance(value, (str, dict, bytes, bytearray)) else value
    if not isinstance(items, list):
        located("bad_image_field", f"'{fields.key(key)}' must be an image or a list of them, not "
                f"{_json_type(value)}", fields.key(key))
        return None
    paths = []
    for k, item in enumerate(items):
        path, why = _image_path(item, base_dir)
        if path is None:
            located("bad_image_field", f"'{fields.key(key)}' item {k} is {why}", fields.key(key))
            return None
        paths.append(path)
    return paths
