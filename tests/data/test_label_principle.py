"""The label rule, derived from the generation prompt independently of the labeller, for every template.

For every template of the corpus (the shipped ones of ``tests/data/chat_templates/``, sources in its
README, and our built-ins), in the character-level tokenizers of `tests/kits/chat.py`, and for every
assistant turn k of each conversation: P = the render of the messages before turn k with
``add_generation_prompt=True``, F = the render of the messages through turn k. What the model must
generate is F after the end of P (where F does not write all of P, DeepSeek-R1's ``<think>\\n``: after
their common token prefix), through the first token generation stops on: the model's eos ids as its
``generation_config.json`` lists them (`chatkit.Family.stops`, data). One documented exception: an empty
think block right after the prompt stays prompt, and so does the close of an empty one the prompt opened
(Qwen3.5's and Nemotron 3's prompts end in ``<think>\n``). Where F holds no stop token after the turn (GLM-4.5's
template writes nothing after a last turn), the model still generates one: the labeller appends the eos
to F and trains it. The labeller's supervised tokens of the record F after
the last non-assistant message's content must be exactly that span; the earlier turns are the last turn
of a shorter record. Nothing here uses `pipeline.data.turns`.

Then the two families the old rule ("the content plus the first special token after it") labelled wrong,
spelled out: GPT-OSS's channel header and Command R7B's eos are model output.
"""

from __future__ import annotations

import difflib
import json
import re

import numpy as np
import pytest

import kits.chat as chatkit
from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.formats import Record
from pipeline.data.tokenize import encode_records

EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")
THINK_CLOSE = re.compile(r"\s*</think>\s*")


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


SYSTEM = {"role": "system", "content": "You are terse."}
PLAIN = {
    "single": [_user("What colour is the sky?"), _assistant("Blue.")],
    "three_turns": [_user("Count to two."), _assistant("One, two."), _user("Spell cat."), _assistant("C-A-T"),
                    _user("Last?"), _assistant("Done: {all} [ok]")],
    "system": [SYSTEM, _user("First?"), _assistant("First answer."), _user("Second?"), _assistant("Second.")],
}
REASONING = {
    "reasoning_single": [_user("What is 2+3?"), _assistant("It is 5.", reasoning_content="Two plus three.")],
    "reasoning_last": [_user("Pick a number."), _assistant("Seven."),
                       _user("Double it?"), _assistant("Fourteen.", reasoning_content="Seven times two.")],
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CASE = [_user("Weather in Paris?"), {"role": "assistant", "content": "", "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call12345", "content": "18C and sunny"},
             _assistant("It is 18C and sunny.")]

SHIPPED = sorted(chatkit.FAMILIES)
BUILTIN = sorted(chatkit.BUILTINS)
REASONING_TEMPLATES = ([f for f in SHIPPED if chatkit.FAMILIES[f].reasoning]
                       + ["builtin:qwen3", "builtin:qwen3-thinking", "builtin:deepseek-r1", "builtin:gpt-oss"])
# Where a template reads an assistant turn's reasoning (the model makers' documented field; absent: inline,
# <think>...</think> before the answer, which Qwen3's templates also parse). The labeller finds it by a probe.
READS = {"qwen3": "reasoning_content", "qwen3-2025-04": "reasoning_content", "gpt-oss": "thinking",
         "qwen3.5": "reasoning_content", "qwen3.5-small": "reasoning_content", "qwen3.6": "reasoning_content",
         "nemotron-3-nano": "reasoning_content", "nemotron-3-super": "reasoning_content",
         "nemotron-3-ultra": "reasoning_content", "lfm2.5": "thinking",
         "builtin:qwen3": "reasoning_content", "builtin:qwen3-thinking": "reasoning_content",
         "builtin:gpt-oss": "reasoning_content"}
# The templates that render tool calls and results (the others are refused: tests/data/test_data_text_and_tools).
TOOL_TEMPLATES = ["qwen2.5", "qwen3", "qwen3-2025-04", "llama-3.1", "llama-3.2", "mistral-nemo", "gpt-oss",
                  "glm-4.5", "builtin:qwen2.5", "qwen3-instruct-2507", "qwen3.5", "qwen3.5-small", "qwen3.6",
                  "nemotron-3-nano", "nemotron-3-super", "nemotron-3-ultra", "lfm2.5", "mistral-small-3.1"]


def _cases():
    for name in SHIPPED + BUILTIN:
        for case, messages in PLAIN.items():
            if not (case == "system" and chatkit.family_of(name).system == "raises"):
                yield name, case, messages
        if name in REASONING_TEMPLATES:
            yield from ((name, case, messages) for case, messages in REASONING.items())
        if name in TOOL_TEMPLATES:
            yield name, "tools", TOOL_CASE


CASES = list(_cases())


# --- the derivation -------------------------------------------------------------------------------


def _as_read(name, message):
    """`message` with its reasoning where the template reads it (`READS`): inline, or in a field."""
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        return message
    content = {k: v for k, v in message.items() if k != "reasoning_content"}
    field = READS.get(name)
    if field is None:
        return {**content, "content": f"<think>\n{reasoning}\n</think>\n\n{message['content']}"}
    return {**content, field: reasoning}


def _ids(name, messages, tools=None, **kwargs):
    text = chatkit.build_tokenizer(name).apply_chat_template([_as_read(name, m) for m in messages], tokenize=False,
                                                             tools=tools, **kwargs)
    return chatkit.char_ids(name, text)


def derived_span(name, messages, tools=None) -> tuple[int, int]:
    """[start, end) in the ids of `messages` (ending with an assistant turn) that the model must generate, in
    `trained_ids` (the render, and the eos where the render holds no stop token after the turn)."""
    prompt = _ids(name, messages[:-1], tools, add_generation_prompt=True)
    ids = trained_ids(name, messages, tools)
    start = prompt_end(name, prompt, ids)
    empty = EMPTY_THINK.match(_decode(name, ids[start:]))
    opened = _decode(name, prompt)
    if empty is None and opened.rfind("<think>") > opened.rfind("</think>"):  # the prompt opened a think block
        empty = THINK_CLOSE.match(_decode(name, ids[start:]))
    if empty:
        start += len(chatkit.char_ids(name, empty.group()))
    stops = {chatkit.vocabulary(name)[s] for s in chatkit.family_of(name).stops}
    end = next(i + 1 for i in range(start, len(ids)) if ids[i] in stops)
    return start, end


def trained_ids(name, messages, tools=None) -> list[int]:
    """The render of `messages` (ending with an assistant turn), with the eos appended where it holds no stop
    token after the turn's generation prompt."""
    prompt = _ids(name, messages[:-1], tools, add_generation_prompt=True)
    ids = _ids(name, messages, tools)
    fam = chatkit.family_of(name)
    stops = {chatkit.vocabulary(name)[s] for s in fam.stops}
    if any(i in stops for i in ids[prompt_end(name, prompt, ids):]):
        return ids
    return ids + chatkit.char_ids(name, fam.eos)


def prompt_end(name, prompt, ids) -> int:
    """Where the generation prompt ends in `ids`: after the last prompt token that `ids` writes in order (a
    diff; whitespace alone does not place it), or earlier, at the first token `ids` writes that the prompt
    does not hold: text the render puts inside the prompt's own tail is model output (Qwen3.5's reasoning
    inside the empty think block its thinking-off prompt holds). All of the prompt where it is a prefix;
    Mistral-Nemo's prompt holds a system prompt that its training render leaves out, DeepSeek-R1's a
    ``<think>\n``."""
    if ids[:len(prompt)] == prompt:
        return len(prompt)
    space = {chatkit.vocabulary(name)[c] for c in " \n"}
    matcher = difflib.SequenceMatcher(lambda t: t in space, prompt, ids, autojunk=False)
    end = max(b.b + b.size for b in matcher.get_matching_blocks() if b.size)
    written = [j1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("insert", "replace") and j1 < end]
    return min([end, *written])


def _decode(name, ids) -> str:
    inverse = {v: k for k, v in chatkit.vocabulary(name).items()}
    return "".join(inverse[i] for i in ids)


def _context_end(name, messages, ids, start) -> int:
    """Token index right after the content of the last message before the assistant turn (the user's
    question or the tool's result), found as text before `start`: what is before it is earlier turns."""
    text = _decode(name, ids)
    before = len(_decode(name, ids[:start]))
    content = messages[-2]["content"]
    at, size = max((text.rfind(c, 0, before), len(c)) for c in (content, json.dumps(content)[1:-1]))
    assert at >= 0, (name, content)
    return len(chatkit.char_ids(name, text[:at + size]))


@pytest.mark.parametrize(("name", "case", "messages"), CASES, ids=[f"{n}-{c}" for n, c, _ in CASES])
def test_labels_are_what_the_model_generates_after_its_generation_prompt(name, case, messages):
    tokenizer = chatkit.build_tokenizer(name)
    tools = TOOLS if case == "tools" else None
    for k in [k for k, m in enumerate(messages) if m["role"] == "assistant"]:
        turn = messages[:k + 1]
        start, end = derived_span(name, turn, tools)
        record = Record(id="r", messages=[dict(m) for m in turn], images=[], index=0, line=1, tools=tools)
        enc = encode_records([record], tokenizer, max_length=1 << 16, too_long="error")
        ids = enc.input_ids.tolist()
        assert ids == trained_ids(name, turn, tools)  # the labeller trains on the template's own render
        lo = _context_end(name, turn, ids, start)
        supervised = [i for i in range(lo, len(ids)) if enc.labels[i] != IGNORE_INDEX]
        assert supervised == list(range(start, end)), (
            f"{name} {case} turn {k}: labelled {_decode(name, [ids[i] for i in supervised])!r}, derived "
            f"{_decode(name, ids[start:end])!r}\n{_decode(name, ids)}")


def test_every_template_of_the_corpus_is_derived():
    """The derivation covers every shipped file and every built-in, and tool calls where they render."""
    covered = {name for name, _, _ in CASES}
    assert covered == set(chatkit.FAMILIES) | set(chatkit.BUILTINS)
    assert {name for name, case, _ in CASES if case == "tools"} == set(TOOL_TEMPLATES)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_end_of_turn_marker_generation_adds_is_a_stop_token_of_the_model(name):
    """`end_of_turn` is what prompts and exports add to generation's stop tokens: one the model stops on."""
    from pipeline.data.chat import end_of_turn

    found, family = end_of_turn(chatkit.build_tokenizer(name)), chatkit.FAMILIES[name]
    # A template that writes nothing after a last turn has no marker (the eos the labeller appends is a stop)
    assert found is None if family.appends else found in family.stops


def _weighted(messages, weights) -> list[dict]:
    """`messages` with each assistant turn's `weight` in turn (1: the key left out, as data leaves it)."""
    turns = iter(weights)
    return [{**m, "weight": 0} if m["role"] == "assistant" and next(turns) == 0 else dict(m) for m in messages]


@pytest.mark.parametrize("name", SHIPPED + BUILTIN)
def test_a_turn_of_weight_0_is_rendered_as_given_and_not_trained(name):
    """OpenAI's per-turn ``"weight": 0``: the same tokens, and the supervised runs those of the turns of weight 1,
    each exactly as the unweighted record trains it (which the test above derives from the generation prompt)."""
    cases = [(PLAIN["three_turns"], weights) for weights in ((0, 1, 0), (1, 0, 1), (0, 0, 1))]
    if name in TOOL_TEMPLATES:
        cases.append((TOOL_CASE, (0, 1)))  # the call is context, the answer trained
    for messages, weights in cases:
        every = _runs(name, [dict(m) for m in messages])
        assert len(every) == len(weights)
        assert _runs(name, _weighted(messages, weights)) == [r for r, w in zip(every, weights) if w], weights
        assert _ids_of(name, _weighted(messages, weights)) == _ids_of(name, [dict(m) for m in messages])


def _ids_of(name, messages) -> list[int]:
    tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
    return encode_records([Record(id="r", messages=messages, images=[], index=0, line=1, tools=tools)],
                          chatkit.build_tokenizer(name), max_length=1 << 16, too_long="error").input_ids.tolist()


# --- the two families the old rule labelled wrong -------------------------------------------------


def _runs(name, messages) -> list[str]:
    tools = TOOLS if any(m.get("tool_calls") for m in messages) else None
    enc = encode_records([Record(id="r", messages=messages, images=[], index=0, line=1, tools=tools)],
                         chatkit.build_tokenizer(name), max_length=1 << 16, too_long="error")
    mask = enc.labels != IGNORE_INDEX
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [_decode(name, enc.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


def test_gpt_oss_channel_header_is_model_output():
    """Harmony's generation prompt is ``<|start|>assistant``: the channel header is trained, the final message
    through ``<|return|>``; an earlier turn's ``<|end|>`` is not a stop token, so it is not trained; the
    analysis channel (``thinking``, from ``reasoning_content``) is trained with the last turn."""
    assert _runs("gpt-oss", PLAIN["three_turns"]) == [
        "<|channel|>final<|message|>One, two.", "<|channel|>final<|message|>C-A-T",
        "<|channel|>final<|message|>Done: {all} [ok]<|return|>"]
    assert _runs("gpt-oss", REASONING["reasoning_last"]) == [
        "<|channel|>final<|message|>Seven.",
        "<|channel|>analysis<|message|>Seven times two.<|end|><|start|>assistant<|channel|>final<|message|>"
        "Fourteen.<|return|>"]
    assert _runs("gpt-oss", TOOL_CASE)[0] == (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')


@pytest.mark.parametrize(("name", "lead"), [("command-r7b", "<|START_RESPONSE|>"), ("cohere2", "")])
def test_command_r7b_end_of_turn_token_is_model_output(name, lead):
    """The eos ``<|END_OF_TURN_TOKEN|>`` follows ``<|END_RESPONSE|>``: both are trained. The R7B template's
    generation prompt stops before ``<|START_RESPONSE|>`` (then trained), the Cohere2 one after it."""
    assert _runs(name, PLAIN["three_turns"]) == [
        f"{lead}{answer}<|END_RESPONSE|><|END_OF_TURN_TOKEN|>" for answer in ("One, two.", "C-A-T", "Done: {all} [ok]")]
    prompt = chatkit.build_tokenizer(name).apply_chat_template(PLAIN["single"][:1], tokenize=False,
                                                                 add_generation_prompt=True)
    assert prompt.endswith("<|CHATBOT_TOKEN|>" + ("<|START_RESPONSE|>" if not lead else ""))


def test_builtin_gpt_oss_trains_every_turn_to_stop():
    """Our harmony template closes every final message with ``<|return|>`` and keeps every turn's analysis."""
    conversation = [_user("Q1?"), _assistant("A1.", reasoning_content="R1."), _user("Q2?"), _assistant("A2.")]
    assert _runs("builtin:gpt-oss", conversation) == [
        "<|channel|>analysis<|message|>R1.<|end|><|start|>assistant<|channel|>final<|message|>A1.<|return|>",
        "<|channel|>final<|message|>A2.<|return|>"]
    text = chatkit.build_tokenizer("builtin:gpt-oss").apply_chat_template(conversation, tokenize=False)
    assert "Current date" not in text  # the same text every day


def test_gpt_oss_shipped_template_untrained_stops_and_dropped_analysis_point_at_the_builtin(tmp_path):
    """Validation with GPT-OSS's shipped template: a multi-turn record's earlier final message has no stop
    token to train, and an earlier turn's analysis is dropped; both warnings name the built-in `gpt-oss`."""
    from pipeline.data import validate

    tok_dir = tmp_path / "tok"
    chatkit.build_tokenizer("gpt-oss").save_pretrained(tok_dir)
    rows = [{"messages": [_user("Q1?"), _assistant("A1.", reasoning_content="R1."), _user("Q2?"), _assistant("A2.")]},
            {"messages": PLAIN["single"]}]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = validate.validate_dataset(train, tokenizer_dir=tok_dir, max_length=4096, too_long="error")
    assert report.ok
    stats = report.files["train"]
    assert (stats["eot_trained"], stats["eot_not_trained"], stats["reasoning_dropped_by_template"]) == (1, 1, 1)
    messages = {w.reason: w.message for _, w in report.warnings}
    assert "set data.chat_template: gpt-oss (a built-in training template" in messages["eot_not_trained"]
    assert "set data.chat_template: gpt-oss to train it" in messages["reasoning_not_rendered"]


@pytest.mark.parametrize("name", SHIPPED)
def test_a_stop_token_written_out_in_a_trained_reply_is_flagged(name):
    """A reply whose text holds the eos or end-of-turn marker (`Family.stops`: the model's generation_config),
    written out as text (scraped chat logs, a copied transcript), is read by the tokenizer as that token, so the
    model learns to stop in mid-reply: each shipped template's record is flagged, per stop token. The same
    text in a prompt or in a turn the data leaves untrained (`"weight": 0`) is not trained and not flagged;
    nor is a clean reply, or one that ends with the stop tokens (data that appends them itself)."""
    from pipeline.data.tokenize import CHAT_COUNTS, sequence_lengths

    family = chatkit.FAMILIES[name]
    stops = sorted({family.eos, *family.stops} - {None})
    assert stops, name
    cases = [([_user("Say hi."), _assistant("Hi there.")], False)]
    cases += [([_user("Say hi."), _assistant(f"Hi{stop} there.")], True) for stop in stops]
    cases += [([_user(f"Say{stops[0]} hi."), _assistant("Hi there.")], False),
              ([_user("Say hi."), _assistant(f"Hi there.{''.join(stops)}\n")], False),  # appended: the template's again
              ([_user("Say hi."), _assistant(f"Hi{stops[0]}", weight=0), _user("Again."), _assistant("Hi.")], False)]
    records = [Record(id=f"r{i}", messages=messages, images=[], index=i, line=i + 1, tools=None)
               for i, (messages, _) in enumerate(cases)]
    found = {}
    lengths, errors, flags = sequence_lengths(chatkit.build_tokenizer(name), records, found=found)
    assert not errors, errors
    assert flags[:, CHAT_COUNTS.index("stop_tokens_inside")].tolist() == [flagged for _, flagged in cases]
    assert [found[1 + j]["stop_tokens_inside"] for j in range(len(stops))] == stops  # what the warning names


def _less_leading(text: str, tokens: set[str]) -> str:
    """`text` less the `tokens` and whitespace it starts with."""
    text = text.lstrip()
    while (token := next((t for t in tokens if text.startswith(t)), None)) is not None:
        text = text[len(token):].lstrip()
    return text


@pytest.mark.parametrize("name", SHIPPED)
def test_a_prompt_holding_a_conversation_rendered_already_is_flagged(name):
    """Data rendered with the chat template already (a transcript pasted into a user turn, a system prompt of
    few-shot turns written in the model's format) is rendered again: the tokenizer reads its turn markers as
    the tokens, so the model is shown turns the data does not give as turns. Each shipped template's own render
    of a conversation, put in a user, system or untrained assistant turn, is flagged; a clean record, and the
    same text in a trained reply (the stop-token check's, not this one's), are not. So is a prompt that ends
    in the generation prompt's header written out (a reply prefilled by hand): what it writes after the stop
    tokens (Qwen's <|im_start|>assistant, GPT-OSS's <|end|><|start|>assistant), where it writes more."""
    from pipeline.data.tokenize import CHAT_COUNTS, sequence_lengths

    tokenizer = chatkit.build_tokenizer(name)
    rendered = tokenizer.apply_chat_template(PLAIN["single"], tokenize=False)
    pasted = f"Go on from here:\n{rendered}"
    header = tokenizer.apply_chat_template([_user("Say hi.")], tokenize=False, add_generation_prompt=True)
    family = chatkit.FAMILIES[name]
    opener = _less_leading(header.rpartition("Say hi.")[2], {family.eos, *family.stops} - {None})
    cases = [([_user("Say hi."), _assistant("Hi there.")], False),
             ([_user(pasted), _assistant("Hi there.")], True),
             ([_user("Say hi."), _assistant("Hi."), _user(pasted), _assistant("Hi again.")], True),
             ([_user("Say hi."), _assistant(pasted, weight=0), _user("Again."), _assistant("Hi.")], True),
             ([_user("Say hi."), _assistant(pasted)], False),
             ([_user(f"Say hi.\n{opener}"), _assistant("Hi there.")], bool(opener))]
    if family.system != "raises":  # Gemma 2's and Mistral 7B v0.2's raise on a system turn
        cases.append(([{"role": "system", "content": pasted}, _user("Say hi."), _assistant("Hi there.")], True))
    records = [Record(id=f"r{i}", messages=messages, images=[], index=i, line=i + 1, tools=None)
               for i, (messages, _) in enumerate(cases)]
    found = {}
    lengths, errors, flags = sequence_lengths(tokenizer, records, found=found)
    assert not errors, errors
    assert flags[:, CHAT_COUNTS.index("markers_in_prompts")].tolist() == [flagged for _, flagged in cases]
    named = {i: f["markers_in_prompts"] for i, f in found.items() if "markers_in_prompts" in f}
    specials = {*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values())}
    # what the warning names: a special token, or a marker the template writes as plain text, as written
    assert all(what in specials or what in rendered for what in named.values())
    assert named[1] in pasted and (not opener or named[5] in opener)


def test_turn_markers_a_template_writes_as_plain_text_are_flagged_in_prompts():
    """Mistral 7B v0.2's shipped template writes [INST] / [/INST] as text (its vocabulary has no such tokens):
    they are its turn markers all the same, and a prompt holding them (Llama 2 / Mistral data rendered already,
    then wrapped in messages) is flagged, naming the one written first. A ChatML template's role names outside
    its special tokens ("user", "assistant") are ordinary words: no markers, nothing flagged for them."""
    from pipeline.data.tokenize import CHAT_COUNTS, sequence_lengths
    from pipeline.data.turns import probe

    mistral = chatkit.build_tokenizer("mistral-7b-v0.2")
    assert probe(mistral, mistral.chat_template).written == ("[/INST]", "[INST]")
    qwen = chatkit.build_tokenizer("qwen2.5")
    assert probe(qwen, qwen.chat_template).written == ()
    prompts = [("What is 2+2?", None),
               ("<s>[INST] What is 2+2? [/INST]4</s>[INST] And 3+3?", "[INST]"),
               ("Finish this: What is 2+2? [/INST]", "[/INST]"),
               ("INST, /INST and [INS] are no markers; the user asked the assistant.", None)]
    for tokenizer, expected in ((mistral, [name for _, name in prompts]), (qwen, [None] * len(prompts))):
        records = [Record(id=f"r{i}", messages=[_user(prompt), _assistant("4.")], images=[], index=i, line=i + 1,
                          tools=None) for i, (prompt, _) in enumerate(prompts)]
        found = {}
        _, errors, flags = sequence_lengths(tokenizer, records, found=found)
        assert not errors, errors
        assert flags[:, CHAT_COUNTS.index("markers_in_prompts")].tolist() == [name is not None for name in expected]
        assert [found.get(i, {}).get("markers_in_prompts") for i in range(len(prompts))] == expected


@pytest.mark.parametrize(("boundary", "written"), [
    ("\n### Response:", ["### Response:"]),  # deepseek-coder-instruct's generation prompt after a user turn
    ("</s>\nUSER: ", ["USER:"]),  # Vicuna 1.1's, between an answer and the next user turn
    ("<|end_of_turn|>GPT4 Correct Assistant:", ["GPT4 Correct Assistant:"]),  # OpenChat 3.5's
    ("<|im_end|>\n<|im_start|>assistant\n<think>\n", []),  # ChatML's role name, a think tag
    ("<end_of_turn>\n<start_of_turn>model\n", []),
    (" </s><s>[INST] ", ["[INST]"]),  # Llama 2's
])
def test_plain_markers_are_the_boundary_text_that_is_not_a_word(boundary, written):
    """What real templates write around a turn (llama.cpp's tests/test-chat-template.cpp renders), less
    their special tokens: the runs holding punctuation are markers, bare role names are not."""
    from pipeline.data.turns import plain_markers

    specials = ("<|end_of_turn|>", "<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "</s>", "<s>")
    assert plain_markers(boundary, specials) == written
