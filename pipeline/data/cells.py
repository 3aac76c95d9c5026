"""Table cells that hold JSON: a CSV / TSV row's ``messages`` cell parsed into its message list.

A CSV cell is text, so a table that keeps conversations keeps each as its JSON
text (``df.to_csv`` of a column of message lists writes Python's repr, so users
write ``json.dumps`` of each). Only the columns that hold structure are parsed
-- ``messages``, ``conversations``, ``texts``, ``tools``, Alpaca's ``history``, ``images`` (a JSON list, else one
path), and ``prompt`` / ``completion`` when both are JSON message lists -- so
an answer that happens to be JSON (``{"a": 1}``) stays the text it is.
"""

from __future__ import annotations

import json

from pipeline.data.shapes import FieldMap

# Our keys whose cell is JSON when it starts like a JSON list / object.
_STRUCTURED = ("messages", "conversations", "conversation", "texts", "tools", "history")


def decode_cells(raw: dict, fields: FieldMap) -> tuple[dict, list[tuple[str, str, str]]]:
    """(the row with its JSON cells parsed, [(reason, message, the dataset's column)] for cells that are not JSON)."""
    out = dict(raw)
    problems = []
    for ours in _STRUCTURED:
        column = fields.key(ours)
        text = out.get(column)
        if isinstance(text, str) and text.lstrip()[:1] in ("[", "{"):
            try:
                out[column] = json.loads(text)
            except json.JSONDecodeError as err:
                problems.append(("invalid_json", f"the {column!r} cell is not valid JSON: {err.msg} at column "
                                 f"{err.colno} (a cell of structure holds its JSON text, json.dumps of the value)",
                                 column))
    images = fields.key("images")
    if isinstance(out.get(images), str) and out[images].lstrip().startswith("["):
        try:
            out[images] = json.loads(out[images])
        except json.JSONDecodeError:
            pass  # one path that starts with "[": kept, and checked as a path
    prompt, completion = fields.key("prompt"), fields.key("completion")
    lists = [_message_list(out.get(prompt)), _message_list(out.get(completion))]
    if all(value is not None for value in lists):
        out[prompt], out[completion] = lists
    return out, problems


def _message_list(text: object) -> list | None:
    """`text` parsed when it is the JSON of a list of objects (a message list); None otherwise."""
    if not isinstance(text, str) or not text.lstrip().startswith("["):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(m, dict) for m in value) else None
