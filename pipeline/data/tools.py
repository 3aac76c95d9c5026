"""Tool calls in a training render: whether the template writes them, so that a calling turn can be trained.

`pipeline.data.chat.ChatRender` renders a conversation once with every call's
name replaced by a sentinel, so it knows where each call is (`Rendered.calls`).
A calling turn is trained like any turn (`pipeline.data.turns`): from the end of
its generation prompt through its calls to the token that closes it (the
template's end-of-turn marker, or the token that closes a call: GPT-OSS's
``<|call|>``). A template that does not write a call's name or arguments, or a
tool result, does not support tools: the record is refused, naming the template.
"""

from __future__ import annotations

import json
import re

from pipeline.errors import DataError


def check_arguments(rendered, record, calls: dict[int, list[int]], *, template: str) -> None:
    """Raise `DataError` where a call's argument names are not in its trained turn after its name (the
    template does not render arguments). `calls`: assistant turn -> its call numbers; `template` names it."""
    text = rendered.text
    arguments = [c["function"]["arguments"] for m in record.messages for c in m.get("tool_calls") or []]
    names = [c["function"]["name"] for m in record.messages for c in m.get("tool_calls") or []]
    for numbers in calls.values():
        for n in numbers:
            lo, hi = rendered.calls[n]
            end = next((e for s, e in rendered.spans if s <= lo < e), hi)
            missing = [key for key in arguments[n] if not _names(key, text[hi:end])]
            if missing:
                raise DataError(f"{template} does not render tool call arguments (argument {missing[0]!r} of "
                                f"{names[n]!r} is not in its text): choose a template that supports tools")


def _names(key: str, text: str) -> bool:
    """Whether `text` writes the argument name `key`: JSON-quoted (``"city": ...``), or whole between
    non-word characters (GLM's ``<arg_key>city</arg_key>``)."""
    return json.dumps(key) in text or re.search(rf"(?<!\w){re.escape(key)}(?!\w)", text) is not None


def written(content: str, text: str) -> bool:
    """Whether a tool result is in the rendered text, as it is or JSON-escaped (templates that `tojson` it)."""
    content = content.strip()
    return content in text or json.dumps(content)[1:-1] in text
