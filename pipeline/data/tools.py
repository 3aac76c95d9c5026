"""Tool calls in a training render: which characters of a tool-calling assistant turn are trained.

`pipeline.data.chat.ChatRender` renders a conversation once with every call's
name replaced by a sentinel, so it knows where each call is (`Rendered.calls`),
where each written content is (`Rendered.answers`) and where each reasoning's
``<think>`` opens (`Rendered.think`). A calling turn is then trained from its
content (or reasoning; for a turn whose content is empty or that the template
does not write, from the end of the assistant header the template writes for a
generation prompt, less what it writes before any content, Qwen3's empty think
block) through its calls to the template's end-of-turn marker. A template that
does not write a call's arguments, or whose turns end in no special token, is
refused: the record names the template.
"""

from __future__ import annotations

import json

from pipeline.errors import DataError


def call_spans(rendered, record, calls: dict[int, list[int]], names: list[str], *, eot: str | None,
               header: tuple[str, str], template: str) -> None:
    """Replace the spans of the calling turns of `rendered` (turn -> its call numbers in `calls`; each
    call's name in `names`) by their whole turns; `DataError` where the template's text does not allow it.

    `eot`: the template's end-of-turn marker; `header`: (what it writes between a user's content and the
    assistant's, what it writes after that before a last turn's content); `template` names it in errors.
    """
    if eot is None:
        raise DataError(f"{template} closes an assistant turn with no special token, so the end of a tool call "
                        "cannot be located: choose a template that supports tools")
    text = rendered.text
    arguments = [c["function"]["arguments"] for m in record.messages for c in m.get("tool_calls") or []]
    turns = dict(zip(sorted(rendered.answers), zip(rendered.spans, rendered.eot)))  # turn -> (span, eot)
    for k, numbers in sorted(calls.items()):
        first, last = rendered.calls[numbers[0]], rendered.calls[numbers[-1]]
        start = rendered.answers[k][0] if k in rendered.answers else rendered.think.get(k)
        if start is None:
            earlier = max((span[1] for j, (span, _) in turns.items() if j < k), default=0)
            start = _turn_start(text, earlier, first[0], header, template, names[numbers[0]])
        end = text.find(eot, last[1])
        if end < 0:
            raise DataError(f"{template}: no end-of-turn marker {eot!r} after the tool call {names[numbers[-1]]!r}")
        for n in numbers:
            missing = [key for key in arguments[n] if json.dumps(key) not in text[rendered.calls[n][1]:end]]
            if missing:
                raise DataError(f"{template} does not render tool call arguments (argument {missing[0]!r} of "
                                f"{names[n]!r} is not in its text): choose a template that supports tools")
        turns[k] = ((start, end + len(eot)), True)
    ordered = [turns[k] for k in sorted(turns)]
    rendered.spans, rendered.eot = [span for span, _ in ordered], [flag for _, flag in ordered]


def _turn_start(text: str, earlier: int, call: int, header: tuple[str, str], template: str, name: str) -> int:
    """Where a calling turn with no content written opens: after the last assistant header between the
    previous trained turn (`earlier`) and its first call, and after what the template writes before a content."""
    opener, before_content = header
    at = text.rfind(opener, earlier, call) if opener else -1
    if at < 0:
        raise DataError(f"{template}: the start of the tool call {name!r} cannot be located (the template's "
                        f"assistant header {opener!r} is not before it)")
    start = at + len(opener)
    if before_content and text.startswith(before_content, start):  # prompt, as before any content
        start += len(before_content)
    return start


def written(content: str, text: str) -> bool:
    """Whether a tool result is in the rendered text, as it is or JSON-escaped (templates that `tojson` it)."""
    content = content.strip()
    return content in text or json.dumps(content)[1:-1] in text
