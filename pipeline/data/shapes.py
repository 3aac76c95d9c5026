"""Record shapes: which keys make a record a conversation, and the user's mapping of their keys to ours.

Accepted shapes (`SHAPES`), tried in this order on a record's keys:

* ``messages`` (OpenAI): ``{"messages": [{"role": "user", "content": ...}, ...]}``
* ``conversations`` (ShareGPT / LLaVA): ``{"conversations": [{"from": "human", "value": ...}, ...]}``
* ``conversation`` (LMSYS-Chat-1M, WildChat): ``{"conversation": [{"role": "user", "content": ...}, ...]}``

A turn list may hold either key convention (a ``conversations`` list of role / content
turns, as many exports write) and items that are one exchange each (``{"input", "output"}``,
Capybara's; ``{"user", "assistant"}``), and may be given as its JSON text
(Orca-AgentInstruct's ``messages``).
* ``prompt_completion`` (TRL): ``{"prompt": "...", "completion": "..."}`` (one user turn,
  one assistant turn) or ``{"prompt": [messages], "completion": [messages]}`` (the
  conversation is the prompt's messages then the completion's), or one of each (a string
  prompt is a user turn, a string completion an assistant turn)
* ``alpaca``: ``{"instruction": ..., "input": optional, "output": ...}``, one user turn
  (the instruction, then a blank line and the input when there is one) and one assistant turn
* ``texts`` (The Cauldron / FineVision, the Idefics and SmolVLM data): ``{"images": [...], "texts":
  [{"user": ..., "assistant": ...}, ...]}``, each item one user turn and its answer; with no
  ``<image>`` in the turns, the record's images go before the first user turn's text
* ``text``: ``{"text": "..."}``, plain text (continued pre-training, completion-only data):
  no chat template, every token of it trained (see `pipeline.data.chat`). A file holds
  either text records or conversations, not both.

A ``messages`` list (and a prompt / completion message list) may hold tool calls
(OpenAI): an assistant turn's ``tool_calls`` (``[{"type": "function", "function":
{"name": ..., "arguments": {...} or a JSON string}}]``, its content then optional),
``tool`` turns with each result, and a record-level ``tools`` list (function schemas)
that the chat template is given.

Every shape may carry ``id``, ``system`` and ``image`` / ``images``. A record
with keys of several shapes is read as the first (a dataset that keeps a
``text`` rendering beside its ``messages`` is read from its messages), except
``messages`` and ``conversations`` together, which is ambiguous.

`FieldMap` is the ``data.columns`` / ``data.roles`` / ``data.image_dir`` settings: a
dataset's own key for any of ours (``{prompt: question, completion: answer}``;
``role`` / ``content`` name the keys inside a turn), its own role names
(``{customer: user, agent: assistant}``), and the directory its relative image
paths start from (default: the dataset file's). Problems name the dataset's keys, not ours.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipeline.errors import UserError

COLUMNS_SETTING = "data.columns"
ROLES_SETTING = "data.roles"
IMAGE_DIR_SETTING = "data.image_dir"

# Shape -> (the keys that say a record has it, how messages name it).
SHAPES = {
    "messages": (("messages",), "messages (OpenAI)"),
    "conversations": (("conversations",), "conversations (ShareGPT/LLaVA)"),
    "conversation": (("conversation",), "conversation (LMSYS-Chat/WildChat)"),
    "prompt_completion": (("prompt", "completion"), "prompt + completion (TRL: strings or message lists)"),
    "alpaca": (("instruction", "output"), "instruction + input + output (Alpaca)"),
    "texts": (("texts",), "texts (The Cauldron / FineVision: a list of {user, assistant})"),
    "text": (("text",), "text (plain text, all of it trained)"),
}
# Keys that make a record look like a shape, so its missing partner is reported, not an unknown shape.
_SIGNS = {"messages": ("messages",), "conversations": ("conversations",), "conversation": ("conversation",),
          "prompt_completion": ("completion",), "alpaca": ("instruction", "output"), "texts": ("texts",),
          "text": ("text",)}
# Our keys a dataset may name otherwise: the record's own, and (role, content) inside a turn.
OUR_COLUMNS = ("messages", "conversations", "conversation", "prompt", "completion", "instruction", "input", "output",
               "history", "texts", "system", "id", "image", "images", "role", "content", "text", "tools")
CANONICAL_ROLES = ("user", "assistant", "system", "tool")

# Accepted spellings of a role (matched case-insensitively) -> canonical role.
ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",  # Gemma's and the Gemini API's name for it
    "system": "system",
    "developer": "system",  # OpenAI's name for the system prompt of its newer models (the Chat Completions API)
    "tool": "tool",
    "ipython": "tool",  # Llama 3.1's tool results
    "function": "tool",  # OpenAI's older function results
    "observation": "tool",  # LLaMA-Factory's ShareGPT tool results
    "function_call": "assistant",  # LLaMA-Factory's ShareGPT tool calls (pipeline.data.normalize.CALL_ROLE)
}


def accepted_text() -> str:
    return "; ".join(text for _, text in SHAPES.values())


def detect(record: dict) -> str | None:
    """The shape of a record (its keys already ours), 'ambiguous', or None when it has none."""
    if "messages" in record and "conversations" in record:
        return "ambiguous"
    return next((shape for shape, signs in _SIGNS.items() if any(k in record for k in signs)), None)


@dataclass(frozen=True)
class FieldMap:
    """Our key -> the dataset's (`columns`), the dataset's role name (lowercase) -> ours (`roles`), and where
    relative image paths start (`image_dir`, absolute; None: the dataset file's directory)."""

    columns: dict[str, str] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    image_dir: str | None = None

    def __post_init__(self):
        problems = [f"{COLUMNS_SETTING}: {ours!r} is not one of ours ({', '.join(OUR_COLUMNS)})"
                    for ours in self.columns if ours not in OUR_COLUMNS]
        problems += [f"{ROLES_SETTING}: {name!r} maps to {ours!r}, not one of {', '.join(CANONICAL_ROLES)}"
                     for name, ours in self.roles.items() if ours not in CANONICAL_ROLES]
        theirs = list(self.columns.values())
        problems += [f"{COLUMNS_SETTING}: the dataset key {key!r} is given for several of ours"
                     for key in sorted({k for k in theirs if theirs.count(k) > 1})]
        if problems:
            raise UserError("\n".join(problems))
        object.__setattr__(self, "roles", {k.strip().lower(): v for k, v in self.roles.items()})

    def key(self, ours: str) -> str:
        """The dataset's name for our key `ours`."""
        return self.columns.get(ours, ours)

    def view(self, raw: dict) -> dict:
        """`raw` with the dataset's keys renamed to ours (keys that are not mapped kept as they are)."""
        if not self.columns:
            return raw
        theirs = {their: ours for ours, their in self.columns.items()}
        return {theirs.get(k, k): v for k, v in raw.items() if k not in self.columns or k in theirs}

    def role(self, name: str) -> str | None:
        """The canonical role of a dataset's role name, None if unknown."""
        name = name.strip().lower()
        return self.roles.get(name) or ROLE_ALIASES.get(name)

    def role_names(self) -> str:
        return ", ".join(dict.fromkeys([*ROLE_ALIASES, *self.roles]))

    def to_args(self) -> list[str]:
        """The command-line flags that rebuild this mapping (`parse_pairs` reads them back)."""
        args = []
        if self.columns:
            args += ["--columns", ",".join(f"{k}={v}" for k, v in self.columns.items())]
        if self.roles:
            args += ["--roles", ",".join(f"{k}={v}" for k, v in self.roles.items())]
        if self.image_dir:
            args += ["--image-dir", self.image_dir]
        return args


def parse_pairs(text: str | None, setting: str) -> dict[str, str]:
    """'prompt=question,completion=answer' -> {'prompt': 'question', ...}; `UserError` naming `setting`."""
    if not text:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UserError(f"{setting}: {item!r} is not key=value (give pairs as a=b,c=d)")
        out[key.strip()] = value.strip()
    return out


def field_map(columns: str | None = None, roles: str | None = None, image_dir: str | None = None) -> FieldMap:
    """The `FieldMap` of the ``--columns`` / ``--roles`` / ``--image-dir`` flags; `UserError` naming the
    setting for an image dir that is not a directory."""
    if image_dir:
        if not os.path.isdir(os.path.expanduser(image_dir)):
            raise UserError(f"{IMAGE_DIR_SETTING}: {image_dir} is not a directory (the one the data's relative "
                            "image paths start from)")
        image_dir = os.path.abspath(os.path.expanduser(image_dir))
    return FieldMap(parse_pairs(columns, COLUMNS_SETTING), parse_pairs(roles, ROLES_SETTING), image_dir or None)


def fields_of(args) -> FieldMap:
    """The `FieldMap` of a command's parsed `add_arguments` flags."""
    return field_map(args.columns, args.roles, args.image_dir)


def add_arguments(parser) -> None:
    """``--columns`` / ``--roles`` / ``--image-dir`` for every command that reads dataset files."""
    parser.add_argument("--columns", default=None, metavar="OURS=THEIRS,...",
                        help=f"the dataset's keys for ours ({COLUMNS_SETTING}), e.g. prompt=question,completion=answer")
    parser.add_argument("--roles", default=None, metavar="THEIRS=ROLE,...",
                        help=f"the dataset's role names ({ROLES_SETTING}), e.g. customer=user,agent=assistant")
    parser.add_argument("--image-dir", default=None, metavar="DIR",
                        help=f"where the data's relative image paths start ({IMAGE_DIR_SETTING}; default: the "
                             "dataset file's directory)")
