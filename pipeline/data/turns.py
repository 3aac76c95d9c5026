"""Which characters of an assistant turn are trained: one rule for every chat template.

The rule: a turn is trained on everything the model must generate after its
generation prompt (the render of the earlier turns with
``add_generation_prompt=True``), through the token generation stops on. Both
ends are found from what the template itself writes, by a few renders of
sentinel conversations done once per template (`probe`), never from a list of
families:

- **Start.** `TurnRule.header` is what the template's generation prompt writes
  after a user's content (``<|im_end|>\\n<|im_start|>assistant\\n``,
  ``<|end|><|start|>assistant``, ``[/INST]``). A turn starts where that header
  ends in its own text: after the header's last special token found before the
  turn (and the header's text after that token, where the turn writes it too).
  So what a template writes after the header is model output: GPT-OSS's
  ``<|channel|>final<|message|>``, Command R7B's ``<|START_RESPONSE|>``, a
  ``<think>`` before reasoning. Where a generation prompt writes more than the
  turn does (DeepSeek-R1's ``<think>\\n``), the turn starts after the part it
  writes. One exception, documented: an empty think block
  (``<think>\\n\\n</think>\\n\\n``) that a template writes before a turn
  without reasoning stays prompt, although Qwen3's shipped generation prompt
  does not contain it: training it would teach the model never to think. So
  does the close of an empty block the generation prompt opened (Qwen3.5's and
  Nemotron 3's prompts end in ``<think>\\n``, their turns without reasoning
  go on ``</think>``).
- **End.** `TurnRule.stops` are the tokens generation stops on: the
  tokenizer's eos, the template's end-of-turn marker (`TurnRule.end_of_turn`,
  which the pipeline adds to generation's stop tokens), the model's own
  (``generation_config.json`` ``eos_token_id`` beside the tokenizer,
  `model_stops`: GLM's ``<|user|>`` and ``<|observation|>``, the next turn's
  header, which it ends a turn by writing), and for a tool call the token that
  closes a calling turn (GPT-OSS's ``<|call|>``). A turn ends after the first
  stop token that follows its content through whitespace and special tokens
  only (``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``); a calling turn's through
  its calls' arguments. A turn whose text reaches no stop token (GPT-OSS's
  earlier final messages close with ``<|end|>``, which generation does not
  stop on) is trained without a close and counted as such, but for the last
  turn of a conversation after which the template writes nothing but
  whitespace and special tokens (GLM's writes nothing): the eos is appended
  there and trained, so the model is taught to stop.

The end-of-turn marker is the eos where the template writes it after every
assistant turn (through special tokens only: Command R7B's after
``<|END_RESPONSE|>``), else the first special token it writes after the
content of a last turn (``<end_of_turn>``; Phi-3's ``<|end|>``, whose eos
follows only the last turn; GPT-OSS's ``<|return|>``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pipeline.data.run_tokenizer import GENERATION_CONFIG, eos_ids

# Private-use characters: a sentinel survives any trim/strip and no data holds them (checked).
OPEN, CLOSE = "\ue000", "\ue001"
SENTINEL = re.compile(f"{OPEN}([ARC])(\\d+){CLOSE}")  # reasoning, answer, a tool call's name
_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")
_THINK_CLOSE = re.compile(r"\s*</think>\s*")  # the rest of an empty think block that the prompt opened
_PROBE_USER, _PROBE_NEXT = "Probe of the assistant header.", "Probe of the next turn."
# Where a template reads reasoning from, in the order tried (`reasoning_field`).
REASONING_FIELDS = ("reasoning_content", "thinking")


def sentinel(kind: str, k: int) -> str:
    return f"{OPEN}{kind}{k}{CLOSE}"


def special_markers(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens, longest first (so a marker is never matched by a shorter one it
    starts with): the candidates for headers and end-of-turn markers."""
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    names |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
              if getattr(t, "special", False)}
    return tuple(sorted((n for n in names if n and n.strip()), key=len, reverse=True))


@dataclass(frozen=True)
class TurnRule:
    """One template's facts for the label rule (see the module docstring), from `probe`.

    `header`: what its generation prompt writes after a user's content ('' when it cannot say: turns are
    then trained from their content). `end_of_turn`: the marker closing every assistant turn (None: none).
    `stops`: the tokens a trained turn ends with. `markers`: the tokenizer's special tokens, longest first.
    `written`: the turn markers the template writes as plain text (`plain_markers`: Llama 2's and Mistral
    7B's ``[INST]`` / ``[/INST]``, which their vocabularies lack as tokens).
    """

    header: str
    end_of_turn: str | None
    stops: tuple[str, ...]
    markers: tuple[str, ...]
    written: tuple[str, ...] = ()

    @cached_property
    def _marker(self) -> re.Pattern | None:
        # One alternation, longest first (as `markers` are): a regex match at a place is the longest marker there.
        return re.compile("|".join(map(re.escape, self.markers))) if self.markers else None

    @cached_property
    def _opens_think(self) -> bool:
        """The generation prompt ends inside a think block it opened (Qwen3.5's, Nemotron 3's)."""
        return self.header.rfind("<think>") > self.header.rfind("</think>")

    @cached_property
    def _header_tokens(self) -> list[tuple[int, str]]:
        return special_tokens(self.header, self.markers)

    @cached_property
    def turn_markers(self) -> tuple[str, ...]:
        """The special tokens that close a turn and open the next (the header's, less a think block's tags,
        and the stops), and the markers written as plain text (`written`): what text already rendered with
        this template holds."""
        opened = (token for _, token in self._header_tokens if token not in ("<think>", "</think>"))
        return tuple(dict.fromkeys((*opened, *self.stops, *self.written)))

    def marker_at(self, text: str, i: int) -> str | None:
        """The special token that starts at `text[i]`, None if none does."""
        found = self._marker.match(text, i) if self._marker else None
        return found.group() if found else None

    def start(self, text: str, lo: int, first: int) -> int:
        """Where the turn whose first model-written character is `first` starts: the end of its generation
        prompt's header in `text[lo:first]` (`lo`: the end of the previous trained turn), less an empty think
        block right after it; `first` itself where the header cannot be placed."""
        start = self._after_header(text, lo, first)
        empty = _EMPTY_THINK.match(text, start, first)
        if empty is None and self._opens_think and text.rfind("<think>", lo, start) >= 0:
            empty = _THINK_CLOSE.match(text, start, first)
        return empty.end() if empty else start

    def _after_header(self, text: str, lo: int, first: int) -> int:
        header = self.header
        if not header:
            return first
        found = self._header_tokens
        if not found:  # a header of plain text ("Assistant:")
            at = text.rfind(header, lo, first)
            return at + len(header) if at >= 0 else first
        for i, marker in reversed(found):  # its last special token the turn writes
            at = text.rfind(marker, lo, first)
            if at < 0:
                continue
            start = at + len(marker)
            tail = header[i + len(marker):]  # the header's text after it, as far as the turn writes it too
            n = 0
            while n < len(tail) and start + n < first and text[start + n] == tail[n]:
                n += 1
            return start + n
        return first

    def end(self, text: str, after: int, limit: int, *, calls: bool = False) -> int | None:
        """The end of the first stop token after `after` (and before `limit`, the next turn), reached through
        whitespace and special tokens only, or (`calls`) through anything: the calls' arguments. None: none."""
        if calls:
            hits = [(at, at + len(s)) for s in self.stops if (at := text.find(s, after, limit)) >= 0]
            return min(hits)[1] if hits else None
        i = after
        while i < limit:
            if text[i].isspace():
                i += 1
                continue
            marker = self.marker_at(text, i)
            if marker is None:
                return None
            i += len(marker)
            if marker in self.stops:
                return i
        return None


def special_tokens(text: str, markers: tuple[str, ...]) -> list[tuple[int, str]]:
    """(position, token) of the special tokens in `text`, left to right (the longest match at each place)."""
    out, i = [], 0
    while i < len(text):
        m = next((m for m in markers if text.startswith(m, i)), None)
        if m:
            out.append((i, m))
            i += len(m)
        else:
            i += 1
    return out


def _render(tokenizer, template: str, messages: list[dict], convert, **kwargs) -> str | None:
    try:
        return tokenizer.apply_chat_template(convert(messages), tokenize=False, chat_template=template, **kwargs)
    except Exception:  # noqa: BLE001 -- a template may refuse a probe; the fact is then unknown
        return None


def _reaches(text: str, token: str, markers: tuple[str, ...]) -> bool:
    """Whether `text` starts with whitespace and special tokens up to `token`."""
    rule = TurnRule("", None, (token,), markers)
    return rule.end(text, 0, len(text)) is not None


def _first_marker(text: str, markers: tuple[str, ...]) -> str | None:
    stripped = text.lstrip()
    return next((m for m in markers if stripped.startswith(m)), None)


def model_stops(tokenizer) -> tuple[str, ...]:
    """The tokens the model's generation stops on, as its ``generation_config.json`` beside the tokenizer
    (`tokenizer.name_or_path`) lists them (``eos_token_id``: one id or several); () where there is none."""
    where = getattr(tokenizer, "name_or_path", "") or ""
    path = Path(where, GENERATION_CONFIG) if where else None
    if path is None or not path.is_file():
        return ()
    try:
        ids = eos_ids(json.loads(path.read_text()))
    except (OSError, ValueError):
        return ()
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in ids if 0 <= i < len(tokenizer)]
    return tuple(dict.fromkeys(t for t in tokens if t))


def probe(tokenizer, template: str, convert=None) -> TurnRule:
    """The label rule's facts of `template` rendered by `tokenizer` (`convert`: messages -> what the template
    takes, a vision-language processor's content parts), from three renders of a sentinel exchange; the
    stops are the end-of-turn marker, the eos and `model_stops`."""
    convert = convert or (lambda messages: messages)
    markers = special_markers(tokenizer)
    user, answer = {"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": sentinel("A", 0)}
    opened = _render(tokenizer, template, [user], convert, add_generation_prompt=True)
    last = _render(tokenizer, template, [user, answer], convert)
    middle = _render(tokenizer, template, [user, answer, {"role": "user", "content": _PROBE_NEXT}], convert)
    header = opened.rpartition(_PROBE_USER)[2] if opened and _PROBE_USER in opened else ""
    after_last = last.partition(answer["content"])[2] if last and answer["content"] in last else None
    after_middle = (middle.partition(answer["content"])[2].partition(_PROBE_NEXT)[0]
                    if middle and answer["content"] in middle else None)
    eos = getattr(tokenizer, "eos_token", None) or None
    end_of_turn = _end_of_turn(after_last, after_middle, eos, markers)
    stops = tuple(dict.fromkeys(t for t in (end_of_turn, eos, *model_stops(tokenizer)) if t))
    written = tuple(dict.fromkeys(m for text in (header, after_middle or "") for m in plain_markers(text, markers)))
    return TurnRule(header, end_of_turn, stops, markers, written)


def plain_markers(boundary: str, markers: tuple[str, ...]) -> list[str]:
    """The turn markers a template writes as plain text in `boundary` (what it writes between a user's content
    and the answer, or between an answer and the next user's content): each run of text between its special
    tokens, less whitespace and think tags, that holds a character other than a letter, digit or space
    (Llama 2's ``[/INST]`` and ``[INST]``, ``### Response:``, ``ASSISTANT:``); a bare role name (ChatML's
    ``assistant``, Gemma's ``model``) is no marker, it is ordinary text outside its special tokens."""
    cuts = [0] + [i for at, token in special_tokens(boundary, markers) for i in (at, at + len(token))]
    cuts.append(len(boundary))
    runs = (boundary[lo:hi].replace("<think>", " ").replace("</think>", " ").strip()
            for lo, hi in zip(cuts[::2], cuts[1::2]))
    return [run for run in runs if len(run) > 1 and not all(c.isalnum() or c.isspace() for c in run)]


def _end_of_turn(after_last: str | None, after_middle: str | None, eos: str | None,
                 markers: tuple[str, ...]) -> str | None:
    """The end-of-turn marker from what follows an assistant content when the turn is last / followed by
    a user turn (None where that render failed); see the module docstring."""
    if after_last is None:
        return None
    if eos and _reaches(after_last, eos, markers) and (after_middle is None or _reaches(after_middle, eos, markers)):
        return eos
    return _first_marker(after_last, markers)


def call_stop(tokenizer, template: str, rule: TurnRule, convert=None) -> str | None:
    """The token that closes a calling turn when it is none of `rule.stops` (GPT-OSS's ``<|call|>``): the last
    special token the template writes after a call's name in a last turn. None: the stops do, or unknown, or
    the model's generation config lists its stop tokens (`model_stops`: they are in `rule.stops`, and the
    token after a call need not be one: GLM's ``</tool_call>`` is followed by the stop ``<|observation|>``)."""
    if model_stops(tokenizer):
        return None
    convert = convert or (lambda messages: messages)
    call = {"id": "probecall", "type": "function", "function": {"name": sentinel("C", 0), "arguments": {"x": 1}}}
    text = _render(tokenizer, template, [{"role": "user", "content": _PROBE_USER},
                                         {"role": "assistant", "content": "", "tool_calls": [call]}], convert)
    if not text or call["function"]["name"] not in text:
        return None
    after = text.partition(call["function"]["name"])[2]
    if any(s in after for s in rule.stops):
        return None
    tokens = special_tokens(after, rule.markers)
    return tokens[-1][1] if tokens else None


def reasoning_field(tokenizer, template: str, convert=None) -> str | None:
    """The message field `template` reads an assistant turn's reasoning from (`REASONING_FIELDS`: Qwen3's
    ``reasoning_content``, GPT-OSS's ``thinking``); None: it reads none (reasoning then goes inline,
    ``<think>...</think>`` before the answer)."""
    convert = convert or (lambda messages: messages)
    user = {"role": "user", "content": _PROBE_USER}
    for field in REASONING_FIELDS:
        message = {"role": "assistant", "content": sentinel("A", 0), field: sentinel("R", 0)}
        text = _render(tokenizer, template, [user, message], convert)
        if text and sentinel("R", 0) in text and sentinel("A", 0) in text:
            return field
    return None
