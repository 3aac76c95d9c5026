"""Chat templates and which tokens of a conversation are trained.

Which template renders the conversations (the ``data.chat_template`` setting,
`resolve_template`): the tokenizer's own (the default), a built-in training
template by name (`BUILTIN_TEMPLATES`, the files in ``templates/``), or a path
to a Jinja file. A base model has no template of its own and needs one of the
other two; a built-in template's turn markers that the vocabulary lacks are
added as special tokens when the run's tokenizer is prepared (`pipeline.data.prepare`).

How the supervised characters are found (`render_records`), for any template,
shipped or ours: every assistant content is replaced by a sentinel (private-use
characters no template touches) and the conversation is rendered ONCE. The
text between sentinels is the template's own (headers, system prompts, the
next turn); each sentinel is then replaced by its content. Each turn is then
trained by one rule (`pipeline.data.turns`): everything the model must
generate after its generation prompt, through the token generation stops on
(a turn the data marks ``"weight": 0`` is found the same way, then left untrained).
So a role header is prompt, and what a template writes after the header of its
generation prompt is trained (GPT-OSS's ``<|channel|>final<|message|>``), as is
everything from the content to the stop token
(``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``); where a template writes no stop token
after a conversation's last turn (GLM's writes nothing), the eos is appended and
trained. An empty think block before a turn without reasoning stays prompt.
Unlike rendering prefixes of the conversation, the single render does not ask a
template to render a turn the same way whether or not it is the last one (Qwen3,
Phi-3, DeepSeek-R1, GPT-OSS and Mistral's system prompt all do not).

One check keeps it honest: the conversation rendered with its real contents
must equal the sentinel rendering with the contents put back. A template whose
text depends on the content in another way fails the check, and the error
shows both renders around the first difference and names the setting to change.

Reasoning (``data.reasoning``, `REASONING_POLICIES`): an assistant turn's
reasoning is the ``reasoning_content`` of its message or a leading
``<think>...</think>`` in its content. ``drop`` removes it before rendering;
``keep`` / ``auto`` give it to the template behind a sentinel of its own: in
the field the template reads reasoning from (Qwen3's ``reasoning_content``,
GPT-OSS's ``thinking``, found by a probe), else inline
(``<think>\\n{r}\\n</think>\\n\\n{answer}``, the form Qwen3 and DeepSeek-R1
generate), and train it with the turn. A template that drops it
(DeepSeek-R1's shipped ones always, Qwen3's before the last user turn) is
detected from the missing sentinel: those records are counted, never silently.

Plain text records (`pipeline.data.formats.TEXT_ROLE`) take no template: the
text is trained whole, with the BOS the tokenizer puts before plain text (if
any) as context and its EOS appended (unless the text ends with it) and
trained, as TRL does for language-modelling data, so the model learns where a
document ends.

Tool calls: an assistant turn's ``tool_calls`` and the ``tool`` turns go to the
template as given (and the record's ``tools`` as ``tools=``). Each call's name
is replaced by a sentinel of its own; the turn is trained by the same rule,
through the calls to the token that closes it (the end-of-turn marker, or a
call's own: GPT-OSS's ``<|call|>``). Tool results are prompt. A template that
does not write a call's name and arguments, or a tool result, or that raises
on them, does not support tools: the record is refused, naming the template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.data import tools, turns
from pipeline.errors import DataError, UserError

# The workflow config key that chooses the template, named in every error that a fix of it solves.
SETTING = "data.chat_template"
REASONING_SETTING = "data.reasoning"
REASONING_POLICIES = ("auto", "keep", "drop")
TOKENIZER_OWN = (None, "", "tokenizer")  # spellings of "the tokenizer's own template"

_TEMPLATE_DIR = Path(__file__).with_name("templates")


@dataclass(frozen=True)
class BuiltinTemplate:
    """A training template of ours: its Jinja text is ``templates/<name>.jinja``.

    `special_tokens` are the turn markers it writes; those the tokenizer lacks
    are added as new special tokens (their embedding rows are then trained).
    `end_of_turn` is the marker that closes an assistant turn (None: the eos).
    """

    name: str
    special_tokens: tuple[str, ...]
    end_of_turn: str | None
    about: str

    @property
    def template_path(self) -> Path:
        return _TEMPLATE_DIR / f"{self.name}.jinja"

    @property
    def template(self) -> str:
        return self.template_path.read_text()


BUILTIN_TEMPLATES = {t.name: t for t in (
    BuiltinTemplate("chatml", ("<|im_start|>", "<|im_end|>"), "<|im_end|>",
                    "ChatML (<|im_start|>role ... <|im_end|>): Qwen2/2.5, SmolLM, any base model"),
    BuiltinTemplate("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>",
                    "Llama 3.x headers; a Llama 3 base vocabulary has these tokens already"),
    BuiltinTemplate("qwen2.5", ("<|im_start|>", "<|im_end|>"), "<|im_end|>",
                    "Qwen2.5-Instruct's shipped template, verbatim (from ggml-org/llama.cpp "
                    "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja): ChatML with tool calls"),
    BuiltinTemplate("qwen3", ("<|im_start|>", "<|im_end|>", "<think>", "</think>"), "<|im_end|>",
                    "Qwen3 without thinking: the empty think block in every assistant turn"),
    BuiltinTemplate("qwen3-thinking", ("<|im_start|>", "<|im_end|>", "<think>", "</think>"), "<|im_end|>",
                    "Qwen3 with thinking: the reasoning of every assistant turn is trained"),
    BuiltinTemplate("deepseek-r1", ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"), "<｜end▁of▁sentence｜>",
                    "DeepSeek-R1 / R1-Distill, reasoning kept in the assistant turns"),
    BuiltinTemplate("mistral", ("[INST]", "[/INST]"), None,
                    "Mistral [INST] format, the system prompt in the first user turn"),
    BuiltinTemplate("mistral-text", (), None,
                    "Mistral 7B v0.2 / Mixtral 8x7B [INST] format, [INST] written as text (no token added), "
                    "the system prompt in the first user turn"),
    BuiltinTemplate("gemma", ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>",
                    "Gemma 2/3 turns, the system prompt folded into the first user turn"),
    BuiltinTemplate("phi3", ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>",
                    "Phi-3 / Phi-3.5 turns"),
    BuiltinTemplate("gpt-oss", ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"), "<|return|>",
                    "GPT-OSS (harmony): reasoning as the analysis channel, every final message closed by <|return|>"),
)}

# Turn markers that give a shipped template's family away -> the built-in template that fits it.
# (markers a family's shipped template writes, all of them, built-in template): a template with its own
# format and none of these (GLM's <|assistant|> + <think>) gets the generic hint, not another family's format;
# so does Llama 2's, whose [INST] turns hold a <<SYS>> block that no built-in writes
_FAMILY_HINTS = (
    (("<<SYS>>",), None),
    (("<|channel|>",), "gpt-oss"),
    (("<|start_header_id|>",), "llama3"),
    (("<｜Assistant｜>",), "deepseek-r1"),
    (("<|im_start|>", "<think>"), "qwen3 (or qwen3-thinking)"),
    (("<|im_start|>",), "chatml"),
    (("<start_of_turn>",), "gemma"),
    (("[INST]",), "mistral"),
    (("<|assistant|>", "<|end|>"), "phi3"),
)


# A built-in whose turn markers a family's shipped template writes as plain text (`turns.TurnRule.written`:
# Mistral 7B v0.2's vocabulary has no [INST] token) -> the built-in that writes them as text too, adding none.
_AS_TEXT = {"mistral": "mistral-text"}


def builtin_names() -> str:
    return ", ".join(BUILTIN_TEMPLATES)


def resolve_template(setting: str | None, tokenizer, *, where: str = "the tokenizer") -> tuple[str, str]:
    """(template text, what it is: 'tokenizer' | 'builtin:<name>' | 'file:<path>') for a `SETTING` value.

    Raises `UserError` naming `SETTING` for an unknown name, a missing file, or
    a tokenizer without a template of its own (a base model) when none is given.
    """
    if setting in TOKENIZER_OWN:
        own = getattr(tokenizer, "chat_template", None)
        if not own:
            raise UserError(f"{where} has no chat template (a base model?): set {SETTING} to a built-in template "
                            f"({builtin_names()}) or to a .jinja file")
        if not isinstance(own, str):
            raise UserError(f"{where} has several named chat templates; set {SETTING} to a .jinja file "
                            "holding the one to train with")
        return own, "tokenizer"
    if setting in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[setting].template, f"builtin:{setting}"
    path = Path(setting)
    if path.suffix in (".jinja", ".j2", ".jinja2") or path.is_file():
        if not path.is_file():
            raise UserError(f"{SETTING}: template file not found: {setting}")
        return path.read_text(), f"file:{setting}"
    raise UserError(f"{SETTING}: {setting!r} is neither a built-in template ({builtin_names()}) nor a .jinja file")


def suggest_builtin(template: str, written: tuple[str, ...] = ()) -> str:
    """'data.chat_template: llama3' (or a generic hint) for a shipped template that cannot be labelled;
    `written`: the turn markers it writes as plain text (`_AS_TEXT`)."""
    fit = next((name for markers, name in _FAMILY_HINTS if all(m in template for m in markers)), None)
    if fit in _AS_TEXT and set(BUILTIN_TEMPLATES[fit].special_tokens) & set(written):
        fit = _AS_TEXT[fit]
    if fit is None:
        return f"set {SETTING} to a built-in template ({builtin_names()}) or a .jinja file of your own"
    return f"set {SETTING}: {fit} (a built-in training template for this family), or a .jinja file of your own"


# --- reasoning ------------------------------------------------------------------------------------


def split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, answer) of an assistant message; reasoning '' when it has none."""
    content = message["content"]
    reasoning = message.get("reasoning_content") or ""
    if not reasoning and "</think>" in content:
        head, _, content = content.partition("</think>")
        reasoning = head.split("<think>", 1)[-1]
    return reasoning.strip(), content.strip()


# --- rendering for training -----------------------------------------------------------------------


@dataclass
class Rendered:
    """One conversation as trained: its text and the supervised character spans [lo, hi).

    `eot` holds, per assistant turn, whether its end-of-turn marker is
    supervised; `reasoning` / `reasoning_dropped` count its turns with
    reasoning in the data and those whose reasoning is not trained.
    `calls` holds where each tool call's name is in `text`, by call number.
    `stop_inside` holds, per assistant turn, the first token generation stops
    on that its content or reasoning writes out with text after it, '' if none
    (the tokenizer reads it as that token, and the model learns to stop
    there). `marked_prompt`: the first of the template's turn markers
    (`turns.TurnRule.turn_markers`) that a turn left as prompt (system, user,
    tool, an untrained reply) holds, '' if none: text rendered with a chat
    template already, which the template renders again.
    """

    text: str
    spans: list[tuple[int, int]]
    eot: list[bool]
    reasoning: int = 0
    reasoning_dropped: int = 0
    dropped_by_template: bool = False
    calls: dict[int, tuple[int, int]] = field(default_factory=dict)
    stop_inside: list[str] = field(default_factory=list)
    marked_prompt: str = ""


@dataclass
class ChatRender:
    """Renders records for training with one template; see the module docstring.

    `conversation` turns messages into what the template takes (content parts for a
    vision-language processor; None: the messages as they are); `expand(text, record)`
    post-processes a rendered text (a vision-language model's image tokens; None for text).
    """

    tokenizer: object
    template: str
    reasoning: str = "auto"
    conversation: object = None  # messages -> what the template takes (content parts for a VLM)
    expand: object = None  # (text, record) -> text, for a VLM's image tokens
    _probes: dict = field(default_factory=dict, init=False, repr=False)  # computed once: see `_probe`

    def __post_init__(self):
        if self.reasoning not in REASONING_POLICIES:
            raise UserError(f"{REASONING_SETTING} must be one of {', '.join(REASONING_POLICIES)}, "
                            f"not {self.reasoning!r}")

    def _probe(self, name: str):
        """Facts of the tokenizer and template, found once when first needed: 'plain' (the BOS and EOS of
        plain text), 'rule' (`turns.TurnRule`: where a trained turn starts and ends), 'calls' (the rule
        with the token that closes a calling turn), 'field' (where the template reads reasoning from)."""
        if name not in self._probes:
            tok, template, convert = self.tokenizer, self.template, self.conversation
            self._probes[name] = {
                "plain": lambda: _plain_affixes(tok),
                "rule": lambda: turns.probe(tok, template, convert),
                "calls": lambda: _with_call_stop(self._probe("rule"), turns.call_stop(
                    tok, template, self._probe("rule"), convert)),
                "field": lambda: turns.reasoning_field(tok, template, convert),
            }[name]()
        return self._probes[name]

    def _hint(self) -> str:
        """The template setting to try where this template cannot train a record (`suggest_builtin`)."""
        return suggest_builtin(self.template, self._probe("rule").written)

    @property
    def name(self) -> str:
        """The template as the user knows it: the run tokenizer's choice (chat.json), else its directory."""
        where = getattr(self.tokenizer, "name_or_path", "") or ""
        chosen = None
        if where and Path(where, "chat.json").is_file():
            chosen = json.loads(Path(where, "chat.json").read_text()).get("template")
        return f"the chat template ({SETTING}: {chosen or 'tokenizer'}{f', in {where}' if where else ''})"

    # One record ----------------------------------------------------------------------------

    def _assistant(self, k: int, reasoning: str, answer: str, shown: str) -> tuple[dict, dict]:
        """(sentinel message, real message) of assistant turn `k`: its reasoning in the field the template
        reads it from, else inline before the answer (the form Qwen3 and DeepSeek-R1 generate)."""
        if not reasoning:
            return {"role": "assistant", "content": shown}, {"role": "assistant", "content": answer}
        where = self._probe("field")
        if where:
            return ({"role": "assistant", "content": shown, where: turns.sentinel("R", k)},
                    {"role": "assistant", "content": answer, where: reasoning})
        return ({"role": "assistant", "content": f"<think>\n{turns.sentinel('R', k)}\n</think>\n\n{shown}"},
                {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"})

    def _messages(self, messages: list[dict]) -> tuple[list[dict], list[dict], list[tuple[str, str]], int,
                                                        dict[int, list[int]], list[str], set[int]]:
        """(sentinel messages, real messages, per assistant turn (reasoning, answer) with the policy applied,
        turns with reasoning in the data, {assistant turn: its calls' numbers}, each call's name, the
        assistant turns the data marks untrained: ``"weight": 0``)."""
        sentinel, real, parts = [], [], []
        calls: dict[int, list[int]] = {}
        names: list[str] = []
        untrained: set[int] = set()
        in_data = 0
        for message in messages:
            if message["role"] != "assistant":
                sentinel.append(dict(message))
                real.append(dict(message))
                continue
            reasoning, answer = split_reasoning(message)
            in_data += bool(reasoning)
            if self.reasoning == "drop":
                reasoning = ""
            k = len(parts)
            parts.append((reasoning, answer))
            if message.get("weight") == 0:
                untrained.add(k)
            given = message.get("tool_calls") or []
            # A turn that only calls tools has no content: an empty one renders as the data does.
            shown = turns.sentinel("A", k) if answer or not given else ""
            for out, made in zip((sentinel, real), self._assistant(k, reasoning, answer, shown)):
                out.append(made)
            if given:
                calls[k] = list(range(len(names), len(names) + len(given)))
                names += [c["function"]["name"] for c in given]
                sentinel[-1]["tool_calls"] = [{**c, "function": {**c["function"], "name": turns.sentinel("C", n)}}
                                              for n, c in zip(calls[k], given)]
                real[-1]["tool_calls"] = given
        return sentinel, real, parts, in_data, calls, names, untrained

    def render_records(self, records: list, render) -> tuple[list[Rendered | None], dict[int, str]]:
        """Each record rendered for training, or None and why (never raises for one record).

        `render(conversations, tools)` -> (texts, {position: error}) renders without the generation
        prompt, `tools` per conversation. A plain text record takes no template (`_plain`).
        """
        errors: dict[int, str] = {}
        out: list[Rendered | None] = [None] * len(records)
        prepared = []
        for i, record in enumerate(records):
            if any(turns.OPEN in m["content"] or turns.CLOSE in m["content"] for m in record.messages):
                errors[i] = "holds the private-use characters U+E000/U+E001, which the labeller reserves"
                prepared.append(None)
            elif getattr(record, "is_text", False):
                out[i] = self._plain(record.messages[0]["content"])
                prepared.append(None)
            else:
                prepared.append(self._messages(record.messages))
        ok = [i for i, p in enumerate(prepared) if p is not None]
        convert = self.conversation or (lambda m: m)
        tools = [getattr(records[i], "tools", None) for i in ok]
        sentinel_texts, failed = render([convert(prepared[i][0]) for i in ok], tools)
        real_texts, _ = render([convert(prepared[i][1]) for i in ok], tools)
        for j, i in enumerate(ok):
            if j in failed:
                uses_tools = bool(tools[j]) or any(m["role"] == "tool" or m.get("tool_calls")
                                                   for m in records[i].messages)
                errors[i] = (f"{failed[j]}; {self.name} does not render tool calls or tool turns: choose a template "
                             "that supports tools" if uses_tools else f"{failed[j]}; {self._hint()}")
                continue
            try:
                out[i] = self._assemble(records[i], sentinel_texts[j], real_texts[j], *prepared[i][2:])
            except DataError as err:
                errors[i] = str(err)
        return out, errors

    def _plain(self, text: str) -> Rendered:
        """A plain text record as trained: the tokenizer's BOS (context), the text and an EOS (both trained)."""
        bos, eos_token = self._probe("plain")
        eos = "" if not eos_token or text.endswith(eos_token) else eos_token
        return Rendered(bos + text + eos, [(len(bos), len(bos) + len(text) + len(eos))], [bool(eos_token)])

    def _assemble(self, record, sentinel_text: str, real_text: str | None, parts: list[tuple[str, str]],
                  in_data: int, calls: dict[int, list[int]], names: list[str], untrained: set[int]) -> Rendered:
        pieces = turns.SENTINEL.split(sentinel_text)  # text, kind, k, text, kind, k, ..., text
        found = [(pieces[n], int(pieces[n + 1])) for n in range(1, len(pieces), 3)]
        expected = ([("R", k) for k, (r, _) in enumerate(parts) if r] + [("A", k) for k in range(len(parts))]
                    + [("C", n) for n in range(len(names))])
        # A turn that calls tools may lose its content to the template (Llama 3.1 writes only the call).
        missing_answers = [k for k in range(len(parts)) if ("A", k) not in found and k not in calls]
        # A call's name may be written again where its result comes back (GPT-OSS): context, not the call.
        written = [f for f in found if f[0] != "C"]
        if missing_answers or len(set(written)) != len(written) or not set(found) <= set(expected):
            turn = missing_answers[0] + 1 if missing_answers else "?"
            raise DataError(f"the chat template does not write assistant turn {turn} exactly once as given, "
                            "so its tokens cannot be located; " + self._hint())
        unwritten = [names[n] for n in range(len(names)) if ("C", n) not in found]
        if unwritten:
            raise DataError(f"{self.name} does not render tool calls (the call of {unwritten[0]!r} is not in its "
                            "text): choose a template that supports tools")
        # The check: the template writes the same text around real contents as around sentinels.
        put_back = turns.SENTINEL.sub(lambda m: _content(m, parts, names), sentinel_text)
        if real_text is not None and put_back != real_text:
            raise DataError("the chat template renders this conversation differently when the assistant contents "
                            f"change, so the assistant tokens cannot be located:\n"
                            f"{_first_difference(real_text, put_back)}\n{self._hint()}")
        unshown = next((m for m in record.messages if m["role"] == "tool" and not tools.written(m["content"], put_back)),
                       None)
        if unshown is not None:
            raise DataError(f"{self.name} does not render tool turns (the result {unshown['content'][:40]!r} is not "
                            "in its text): choose a template that supports tools")
        if self.expand is not None:
            pieces = turns.SENTINEL.split(self.expand(sentinel_text, record))
        rendered = self._spans(pieces, parts, in_data, calls, names)
        if calls:
            tools.check_arguments(rendered, record, calls, template=self.name)
        if untrained:  # context, as the turns before it: found as trained turns are, then left out (one per turn)
            rendered.spans, rendered.eot, rendered.stop_inside = (
                [x for k, x in enumerate(xs) if k not in untrained]
                for xs in (rendered.spans, rendered.eot, rendered.stop_inside))
        rendered.marked_prompt = _marks_a_prompt(record.messages, untrained, self._probe("rule").turn_markers)
        return rendered

    def _spans(self, pieces: list[str], parts: list[tuple[str, str]], in_data: int, calls: dict[int, list[int]],
               names: list[str]) -> Rendered:
        """The training text and its spans from the split sentinel render (text, kind, k, text, ...): each
        turn from the end of its generation prompt through its stop token (`turns.TurnRule`)."""
        text, where = _put_back(pieces, parts, names)
        owner = {n: k for k, numbers in calls.items() for n in numbers}
        extent: dict[int, list[int]] = {}  # turn -> [its first model-written character, the end of its last]
        for (kind, k), (lo, hi) in where.items():
            turn = owner[k] if kind == "C" else k
            first, last = extent.setdefault(turn, [lo, hi])
            extent[turn] = [min(first, lo), max(last, hi)]
        rule = self._probe("calls" if calls else "rule")
        ordered = sorted(extent.items(), key=lambda item: item[1][0])
        spans, eot, stop_inside, bound = [], [], [], 0
        for n, (k, (first, last)) in enumerate(ordered):
            limit = ordered[n + 1][1][0] if n + 1 < len(ordered) else len(text)
            start, end = rule.start(text, bound, first), rule.end(text, last, limit, calls=k in calls)
            if end is None and limit == len(text):  # the last turn, and the template closes it with no stop
                text, end = _closed(text, last, rule, self.tokenizer, calls=k in calls)
            if end is None and k in calls:
                raise DataError(f"{self.name}: no end-of-turn token ({', '.join(rule.stops) or 'none'}) after the "
                                f"tool call {names[calls[k][-1]]!r}: choose a template that supports tools")
            spans.append((start, last if end is None else end))
            eot.append(end is not None)
            written = [where[piece] for piece in (("A", k), ("R", k)) if piece in where]  # its answer, reasoning
            found = (_stop_before_end(text[lo:hi], rule.stops) for lo, hi in written)
            stop_inside.append(next(filter(None, found), ""))
            bound = spans[-1][1]
        kept = sum(1 for kind, _ in where if kind == "R")
        offered = sum(1 for r, _ in parts if r)  # reasoning given to the template (none under drop)
        calls_at = {n: span for (kind, n), span in where.items() if kind == "C"}
        return Rendered(text, spans, eot, reasoning=in_data, reasoning_dropped=in_data - kept,
                        dropped_by_template=kept < offered, calls=calls_at, stop_inside=stop_inside)


def _marks_a_prompt(messages: list[dict], untrained: set[int], markers: tuple[str, ...]) -> str:
    """The first of `markers` written in a turn left as prompt (not an assistant's, or one of the `untrained`
    assistant turns, by number), '' if none is."""
    prompts, k = [], 0
    for message in messages:
        if message["role"] == "assistant":
            k += 1
            if k - 1 not in untrained:
                continue
        if isinstance(message["content"], str):
            prompts.append(message["content"])
    return next(filter(None, (_first_of(markers, text) for text in prompts)), "")


def _stop_before_end(content: str, stops: tuple[str, ...]) -> str:
    """The first of `stops` written in `content` with text after it, '' if none. Stops written at its very
    end (data that appends the eos itself) only repeat the template's own and teach nothing new."""
    body = content.rstrip()
    while (end := next((stop for stop in stops if body.endswith(stop)), None)) is not None:
        body = body[:-len(end)].rstrip()
    return _first_of(stops, body)


def _first_of(tokens: tuple[str, ...], text: str) -> str:
    """The one of `tokens` written first in `text` (the longer where two start there), '' if none is."""
    at = [(i, -len(token), token) for token in tokens if (i := text.find(token)) >= 0]
    return min(at)[2] if at else ""


def _closed(text: str, last: int, rule: turns.TurnRule, tokenizer, *, calls: bool = False
            ) -> tuple[str, int | None]:
    """(`text`, the end of the stop token that closes its last turn, whose content ends at `last`): the
    tokenizer's eos appended, where the template writes no stop token after that turn, and only whitespace
    and special tokens (`calls`: after a calling turn's arguments, anything), else (`text`, None). GLM's
    shipped template writes nothing after a last turn."""
    eos = getattr(tokenizer, "eos_token", None)
    if not eos:
        return text, None
    grown = text + eos
    end = rule.end(grown, last, len(grown), calls=calls)
    return (grown, end) if end == len(grown) else (text, None)


def _put_back(pieces: list[str], parts: list[tuple[str, str]], names: list[str]
              ) -> tuple[str, dict[tuple[str, int], tuple[int, int]]]:
    """(the text with every sentinel replaced by what it stands for, where each one's text is [lo, hi))."""
    out: list[str] = [pieces[0]]
    pos = len(pieces[0])
    where: dict[tuple[str, int], tuple[int, int]] = {}
    for n in range(3, len(pieces), 3):
        kind, k = pieces[n - 2], int(pieces[n - 1])
        content = names[k] if kind == "C" else parts[k][0] if kind == "R" else parts[k][1]
        where.setdefault((kind, k), (pos, pos + len(content)))  # a call's name: where it is first written
        out += [content, pieces[n]]
        pos += len(content) + len(pieces[n])
    return "".join(out), where


def _with_call_stop(rule: turns.TurnRule, stop: str | None) -> turns.TurnRule:
    return rule if stop is None else replace(rule, stops=rule.stops + (stop,))


def end_of_turn(tokenizer, template: str | None = None) -> str | None:
    """The marker `template` (default: the tokenizer's) closes an assistant turn with, None if it writes none.

    Found as the labeller finds it (`turns.probe`), so generation can stop where training taught the
    model to: at ``<|im_end|>`` even when the tokenizer's eos is another token.
    """
    template = template or getattr(tokenizer, "chat_template", None)
    return turns.probe(tokenizer, template).end_of_turn if template else None


def _content(match, parts: list[tuple[str, str]], names: list[str]) -> str:
    """What a sentinel stands for: a turn's reasoning (R), its answer (A), a tool call's name (C)."""
    kind, k = match.group(1), int(match.group(2))
    return names[k] if kind == "C" else parts[k][0] if kind == "R" else parts[k][1]


def _plain_affixes(tokenizer) -> tuple[str, str]:
    """(the BOS the tokenizer puts before plain text, '' if none; its EOS token, '' if it has none)."""
    bos = getattr(tokenizer, "bos_token", None) or ""
    if bos:
        try:
            ids = tokenizer("a", add_special_tokens=True)["input_ids"]
        except Exception:  # noqa: BLE001 -- a tokenizer that cannot say: no BOS
            ids = []
        bos = bos if ids and ids[0] == getattr(tokenizer, "bos_token_id", None) else ""
    return bos, getattr(tokenizer, "eos_token", None) or ""


def record_name(source: str, record) -> str:
    """'train.jsonl record 3 (line 4, id 'x')'."""
    where = [f"line {record.line}"] if record.line is not None else []
    where += [f"id {record.id!r}"] if record.id is not None else []
    return f"{source} record {record.index}" + (f" ({', '.join(where)})" if where else "")


def _first_difference(a: str, b: str, context: int = 60) -> str:
    """Both texts around their first differing character, one per line, as repr()s."""
    i = next((n for n, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, i - context)
    return (f"  first difference at character {i}:\n"
            f"  rendered as given:       {a[lo:i + context]!r}\n"
            f"  rendered with sentinels: {b[lo:i + context]!r}")
