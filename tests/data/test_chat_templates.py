"""Assistant-token labelling on the chat templates exactly as model makers ship them.

Every template in ``tests/data/chat_templates/`` (see its README) runs in a tiny
character-level tokenizer (`tests/kits/chat.py`), so the expected ids of any
text are computed here without the tokenizer or the labelling core: one id per
character, special tokens one id each. Each case checks, token by token, that
`encode_records` supervises exactly, for each assistant turn in order, the
turn's content (whitespace-stripped) followed by the end-of-turn token the
template writes after it, and nothing else; and that the input ids are the
rendering of the messages by the template.

Reasoning (``reasoning`` in auto / keep / drop): "drop" removes the reasoning
before rendering; "keep" (= "auto") trains it as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``
where the template renders it (Qwen3: assistant turns after the last user
message; the R1-Distill template never does), and otherwise trains the answer
only and counts the record as ``reasoning_dropped_by_template``.
"""

from __future__ import annotations

import numpy as np
import pytest

import kits.chat as chatkit
from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.formats import Record
from pipeline.errors import DataError

MAX_LENGTH = 4096
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def _think(reasoning, answer):
    return f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{answer}"


# --- conversations --------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are terse.\nAnswer in one line."}

PLAIN_CASES = {
    "single": [[_user("What colour is the sky?"), _assistant("The sky is blue.")]],
    "three_turns": [[
        _user("Count to two."), _assistant("One, two."),
        _user("Now spell cat."), _assistant("C-A-T\nthat is: cat"),
        _user("And the last one?"), _assistant("Done: {all} [ok] <fine>"),
    ]],
    "system": [[
        SYSTEM, _user("First question?"), _assistant("First answer."),
        _user("Second question?"), _assistant("Second answer, longer: x = 1 + 2."),
    ]],
    "batch": [  # several records in one call: offsets and per-record labels
        [_user("alpha?"), _assistant("Alpha reply.")],
        [_user("beta?"), _assistant("Beta reply."), _user("gamma?"), _assistant("Gamma reply.")],
        [_user("delta?"), _assistant("Delta reply.")],
    ],
}

# Reasoning conversations: (records, for each record whether some of its reasoning is rendered by
# a Qwen3-style template, i.e. sits in an assistant turn after the last user message).
REASONING_CASES = {
    "think_single": [[_user("What is 2+3?"), _assistant(_think("Two plus three.\nThat is five.", "It is 5."))]],
    "think_last_turn": [[
        _user("Pick a number."), _assistant("Seven."),
        _user("Double it."), _assistant(_think("Seven times two is fourteen.", "Fourteen.")),
    ]],
    "think_early_turn": [[  # reasoning only before the last user message: a Qwen3 template drops it
        _user("Pick a letter."), _assistant(_think("Any letter works; say Q.", "Q.")),
        _user("Lowercase?"), _assistant("q."),
    ]],
    "mixed_batch": [
        [_user("Plain?"), _assistant("Plain answer.")],
        [_user("Why?"), _assistant(_think("Because of reasons.", "Reasons."))],
    ],
}

QWEN3_ONLY_CASES = {
    "reasoning_content": [[
        _user("What is 6*7?"), _assistant("42.", reasoning_content="Six sevens are forty-two."),
    ]],
    "reasoning_content_multi": [[
        _user("Name a fruit."), _assistant("Apple.", reasoning_content="A common one."),
        _user("Another?"), _assistant("Pear.", reasoning_content="Also common.\nShort name."),
    ]],
}


def _records(conversations):
    return [Record(id=f"r{i}", messages=m, images=[], index=i, line=i + 1) for i, m in enumerate(conversations)]


# --- the independent expectation -------------------------------------------------------------------


def _split_reasoning(message):
    """(reasoning or None, answer) of an assistant message."""
    content = message["content"]
    if message.get("reasoning_content"):
        return message["reasoning_content"].strip(), content.strip()
    if content.lstrip().startswith(THINK_OPEN) and THINK_CLOSE in content:
        head, _, answer = content.partition(THINK_CLOSE)
        return head.lstrip()[len(THINK_OPEN):].strip(), answer.strip()
    return None, content.strip()


def _strip_reasoning(messages):
    out = []
    for m in messages:
        if m["role"] == "assistant":
            _, answer = _split_reasoning(m)
            m = {"role": "assistant", "content": answer}
        out.append(m)
    return out


# How a family's template writes the reasoning of a turn after the last user message, the part before it being
# its generation prompt (None: as Qwen3, `<think>\n{reasoning}\n</think>\n\n` all trained)
_AFTER_PROMPT = {"qwen3.5": "{thought}\n</think>\n\n", "nemotron": "{thought}\n</think>\n",
                 "nemotron-ultra": "{thought}</think>", "lfm2.5": "<think>{thought}</think>"}


def _expected(family, messages, reasoning):
    """(trained text per assistant turn, has reasoning, reasoning not trained, dropped by template, every
    turn's close trained)."""
    fam = chatkit.FAMILIES[family]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    texts, has, not_trained, by_template, closed = [], False, False, False, True
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        last = k == len(messages) - 1
        close = fam.eot if last or fam.mid_eot is None else fam.mid_eot
        closed &= bool(close)
        thought, answer = _split_reasoning(m)
        if thought is None:
            texts.append(fam.lead + answer + close)
            continue
        has = True
        if reasoning == "drop":
            texts.append(fam.lead + answer + close)
            not_trained = True
        elif fam.reasoning in _AFTER_PROMPT and k > last_user:
            texts.append(_AFTER_PROMPT[fam.reasoning].format(thought=thought) + answer + close)
        elif fam.reasoning == "qwen3" and k > last_user:
            texts.append(f"{THINK_OPEN}\n{thought}\n{THINK_CLOSE}\n\n{answer}{close}")
        elif fam.reasoning == "gpt-oss" and last:  # the analysis channel, then the final one
            texts.append(f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant{fam.lead}{answer}{close}")
        else:  # the template does not render this turn's reasoning
            # R1's deletes the content before </think>, and what it leaves before the answer is model output.
            texts.append(fam.lead + ("\n\n" if fam.reasoning == "r1" else "") + answer + close)
            not_trained = by_template = True
    return texts, has, not_trained, by_template, closed


def _render_ids(family, messages):
    text = chatkit.build_tokenizer(family).apply_chat_template(messages, tokenize=False)
    return chatkit.char_ids(family, text)


def _expected_labels(family, ids, turn_texts, where):
    """Labels for `ids`: each turn's trained text found in order (after the previous one), the rest ignored."""
    labels = [IGNORE_INDEX] * len(ids)
    start = 0
    for n, text in enumerate(turn_texts):
        want = chatkit.char_ids(family, text)
        at = next((i for i in range(start, len(ids) - len(want) + 1) if ids[i:i + len(want)] == want), None)
        assert at is not None, (f"{where}: assistant turn {n} ({text!r}) "
                                f"does not occur in the input ids after token {start}:\n{_show(family, ids)}")
        labels[at:at + len(want)] = want
        start = at + len(want)
    return labels


def _show(family, ids):
    inverse = {v: k for k, v in chatkit.vocabulary(family).items()}
    return "".join(inverse.get(int(i), f"<?{i}>") for i in ids)


def _first_difference(family, got, want, ids):
    inverse = {v: k for k, v in chatkit.vocabulary(family).items()}
    name = lambda i: "-100" if i == IGNORE_INDEX else repr(inverse.get(int(i), i))  # noqa: E731
    for pos, (g, w) in enumerate(zip(got, want)):
        if g != w:
            context = _show(family, ids[max(0, pos - 30):pos]) + "[>>" + _show(family, ids[pos:pos + 1]) + "<<]"
            return f"first difference at token {pos}: label {name(g)}, expected {name(w)}; context: {context!r}"
    return f"lengths differ: {len(got)} labels, expected {len(want)}"


# --- running the core -------------------------------------------------------------------------------


def _encode(family, conversations, reasoning="auto"):
    from pipeline.data.tokenize import encode_records

    return encode_records(_records(conversations), chatkit.build_tokenizer(family), max_length=MAX_LENGTH,
                          too_long="error", source=f"{family}.jsonl", reasoning=reasoning)


def _check(family, conversations, reasoning, *, check_input):
    """Encode, then assert every record's labels token by token; returns the split's stats."""
    split = _encode(family, conversations, reasoning)
    assert len(split.offsets) == len(conversations) + 1
    assert split.input_ids.shape == split.labels.shape
    expectations, closed = [], 0
    for r, messages in enumerate(conversations):
        where = f"{family} record {r} (reasoning={reasoning})"
        ids = [int(x) for x in split.input_ids[split.offsets[r]:split.offsets[r + 1]]]
        labels = [int(x) for x in split.labels[split.offsets[r]:split.offsets[r + 1]]]
        texts, *flags, every_close = _expected(family, messages, reasoning)
        expectations.append(flags)
        closed += every_close
        if check_input is not None:
            fam = chatkit.FAMILIES[family]
            rendered = _render_ids(family, check_input(messages)) + (chatkit.char_ids(family, fam.eos)
                                                                     if fam.appends else [])
            assert ids == rendered, (f"{where}: input ids differ from the template's rendering; "
                                     f"{_first_difference(family, ids, rendered, rendered)}")
        want = _expected_labels(family, ids, texts, where)
        assert labels == want, f"{where}: {_first_difference(family, labels, want, ids)}\n{_show(family, ids)}"
        supervised = [i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX]
        assert supervised == [lab for lab in labels if lab != IGNORE_INDEX]  # a label is its own input id
    stats = split.stats
    assert stats["records"] == len(conversations)
    assert stats["eot_trained"] == closed
    return stats, expectations


def _assert_reasoning_stats(stats, expectations):
    has = sum(e[0] for e in expectations)
    assert stats["reasoning_records"] == has
    assert stats["reasoning_dropped"] == sum(e[1] for e in expectations)
    assert stats.get("reasoning_dropped_by_template", 0) == sum(e[2] for e in expectations)


# --- the tests ----------------------------------------------------------------------------------------

ALL = list(chatkit.FAMILIES)
PLAIN = [(f, c) for f in ALL for c in PLAIN_CASES if not (c == "system" and chatkit.FAMILIES[f].system == "raises")]
REASONING_FAMILIES = [f for f in ALL if chatkit.FAMILIES[f].reasoning]
SETTINGS = ["auto", "keep", "drop"]


def test_corpus_is_complete():
    """Every template file has a family here and a row in the README."""
    readme = (chatkit.TEMPLATES_DIR / "README.md").read_text(encoding="utf-8")
    files = sorted(p.name for p in chatkit.TEMPLATES_DIR.glob("*.jinja"))
    assert sorted(f.template for f in chatkit.FAMILIES.values()) == files
    for name in files:
        assert f"`{name}`" in readme, f"{name} is not cited in the README"


@pytest.mark.parametrize("family", ALL)
def test_tokenizer_is_char_level(family):
    tok = chatkit.build_tokenizer(family)
    fam = chatkit.FAMILIES[family]
    text = f"ab {fam.eot}\n c{''.join(fam.specials)}"
    assert tok(text, add_special_tokens=False)["input_ids"] == chatkit.char_ids(family, text)
    for special in fam.specials:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.chat_template == chatkit.template_text(family)


@pytest.mark.parametrize(("family", "case"), PLAIN)
def test_plain(family, case):
    stats, _ = _check(family, PLAIN_CASES[case], "auto", check_input=lambda m: m)
    assert stats["reasoning_records"] == 0
    assert stats["reasoning_dropped"] == 0


@pytest.mark.parametrize("reasoning", SETTINGS)
@pytest.mark.parametrize("case", list(REASONING_CASES))
@pytest.mark.parametrize("family", REASONING_FAMILIES)
def test_reasoning(family, case, reasoning):
    check = _strip_reasoning if reasoning == "drop" else None
    stats, expectations = _check(family, REASONING_CASES[case], reasoning, check_input=check)
    _assert_reasoning_stats(stats, expectations)


@pytest.mark.parametrize("reasoning", SETTINGS)
@pytest.mark.parametrize("case", list(QWEN3_ONLY_CASES))
@pytest.mark.parametrize("family", [f for f in ALL if chatkit.FAMILIES[f].reasoning == "qwen3"])
def test_reasoning_content_key(family, case, reasoning):
    check = _strip_reasoning if reasoning == "drop" else None
    stats, expectations = _check(family, QWEN3_ONLY_CASES[case], reasoning, check_input=check)
    _assert_reasoning_stats(stats, expectations)


def test_reasoning_kept_counts():
    """Spelled-out counts for Qwen3 under keep: trained where rendered, dropped by the template before the last user turn."""
    conversations = REASONING_CASES["think_last_turn"] + REASONING_CASES["think_early_turn"] + \
        REASONING_CASES["mixed_batch"]
    stats, _ = _check("qwen3", conversations, "keep", check_input=None)
    assert stats["reasoning_records"] == 3
    assert stats["reasoning_dropped"] == 1
    assert stats["reasoning_dropped_by_template"] == 1
    assert stats["eot_trained"] == 4


@pytest.mark.parametrize("family", [f for f in ALL if chatkit.FAMILIES[f].reasoning == "r1"])
def test_reasoning_r1_always_dropped_by_template(family):
    conversations = REASONING_CASES["think_single"] + REASONING_CASES["think_last_turn"]
    stats, _ = _check(family, conversations, "keep", check_input=None)
    assert (stats["reasoning_records"], stats["reasoning_dropped"], stats["reasoning_dropped_by_template"]) == (2, 2, 2)


def test_reasoning_partly_rendered_counts_as_dropped():
    """Reasoning before and after the last user turn (Qwen3, keep): the last is trained, the first dropped.

    The record's reasoning was not all trained, so it counts as dropped by the template.
    """
    conversations = [[
        _user("One?"), _assistant(_think("First thought.", "One.")),
        _user("Two?"), _assistant(_think("Second thought.", "Two.")),
    ]]
    stats, _ = _check("qwen3", conversations, "keep", check_input=None)
    assert (stats["reasoning_records"], stats["reasoning_dropped"], stats["reasoning_dropped_by_template"]) == (1, 1, 1)


def test_gemma2_system_message_is_a_data_error_pointing_at_the_builtin_template():
    records = [Record(id="hello-system", messages=[SYSTEM, _user("Hi?"), _assistant("Hi.")], images=[], index=0,
                      line=1)]
    from pipeline.data.tokenize import encode_records

    with pytest.raises(DataError) as err:
        encode_records(records, chatkit.build_tokenizer("gemma-2"), max_length=MAX_LENGTH, too_long="error",
                       source="train.jsonl")
    message = str(err.value)
    assert "hello-system" in message and "record 0" in message, message
    assert "data.chat_template" in message, message


def test_mistral_7b_system_message_points_at_the_builtin_that_keeps_inst_as_text(tmp_path):
    """Mistral 7B v0.2's shipped template refuses a system message. Its vocabulary writes [INST] as text, so the
    error names `mistral-text` (the same format, no token added, the system prompt in the first user turn), not
    `mistral` (which would add [INST] / [/INST] as new tokens); Gemma 2's still names `gemma`. Without a system
    prompt, `mistral-text` renders what the shipped template renders, character for character."""
    from pipeline.data import prepare
    from pipeline.data.tokenize import encode_records, load_tokenizer

    record = Record(id="with-system", messages=[SYSTEM, _user("Hi?"), _assistant("Hi.")], images=[], index=0, line=1)
    for family, hint in (("mistral-7b-v0.2", "mistral-text"), ("gemma-2", "gemma")):
        with pytest.raises(DataError, match=rf"with-system.*set data\.chat_template: {hint} \(a built-in"):
            encode_records([record], chatkit.build_tokenizer(family), max_length=MAX_LENGTH, too_long="error",
                           source="train.jsonl")
    shipped = chatkit.build_tokenizer("mistral-7b-v0.2")
    shipped.save_pretrained(tmp_path / "base")
    info = prepare.prepare(tmp_path / "base", tmp_path / "run", "mistral-text")
    assert info["added_tokens"] == {}  # [INST] stays text: the model's own format, no new embedding rows
    ours = load_tokenizer(tmp_path / "run")
    for conversation in PLAIN_CASES["three_turns"] + PLAIN_CASES["batch"]:
        assert ours.apply_chat_template(conversation, tokenize=False) == \
            shipped.apply_chat_template(conversation, tokenize=False)
    with_system = ours.apply_chat_template(record.messages, tokenize=False)
    assert with_system == f"<s>[INST] {SYSTEM['content']}\n\nHi? [/INST]Hi.</s>"
    split = encode_records([record], ours, max_length=MAX_LENGTH, too_long="error", source="train.jsonl")
    trained = split.input_ids[split.labels != IGNORE_INDEX].tolist()
    assert trained == chatkit.char_ids("mistral-7b-v0.2", "Hi.</s>")


# A Llama 2 chat template (the <<SYS>> block, [INST] written as text) with a default system prompt:
# bofenghuang/vigogne-2-70b-chat's, from ggml-org/llama.cpp tests/test-chat-template.cpp @ 03f94f19a2c4 (the C++
# literal's \\n read as the two characters \n, a Jinja string escape).
VIGOGNE_2 = (
    r"{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message"
    r" = messages[0]['content'] %}{% elif true == true and not '<<SYS>>' in messages[0]['content'] %}{% set "
    r"loop_messages = messages %}{% set system_message = 'Vous êtes Vigogne, un assistant IA créé par Zaion Lab. Vous "
    r"suivez extrêmement bien les instructions. Aidez autant que vous le pouvez.' %}{% else %}{% set loop_messages = "
    r"messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] "
    r"== 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    r"user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set "
    r"content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = "
    r"message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + content.strip() + ' [/INST]' }}"
    r"{% elif message['role'] == 'system' %}{{ '<<SYS>>\n' + content.strip() + '\n<</SYS>>\n\n' }}{% elif "
    r"message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")


def test_a_llama_2_format_template_that_refuses_a_record_gets_the_generic_hint(tmp_path):
    """A Llama 2 format template writes [INST] as text too, but its <<SYS>> block is no built-in's format:
    a record it refuses gets the generic hint (a built-in or a .jinja file of your own), not mistral-text."""
    from pipeline.data.tokenize import encode_records, load_tokenizer
    from pipeline.data.turns import probe

    chatkit.build_tokenizer("mistral-7b-v0.2").save_pretrained(tmp_path)  # the same vocabulary: <s>, </s>, <unk>
    tokenizer = load_tokenizer(tmp_path)
    tokenizer.chat_template = VIGOGNE_2
    assert tokenizer.apply_chat_template([_user("Salut ?"), _assistant("Salut.")], tokenize=False) == (
        "<s>[INST] <<SYS>>\nVous êtes Vigogne, un assistant IA créé par Zaion Lab. Vous suivez extrêmement bien les "
        "instructions. Aidez autant que vous le pouvez.\n<</SYS>>\n\nSalut ? [/INST] Salut. </s>")
    assert {"[INST]", "[/INST]"} <= set(probe(tokenizer, VIGOGNE_2).written)
    record = Record(id="two-users", messages=[_user("Q1?"), _user("Q2?"), _assistant("A.")], images=[], index=0,
                    line=1)
    with pytest.raises(DataError, match="two-users") as err:
        encode_records([record], tokenizer, max_length=MAX_LENGTH, too_long="error", source="train.jsonl")
    assert "set data.chat_template to a built-in template (chatml, " in str(err.value)
    assert "mistral-text (a built-in" not in str(err.value) and "mistral (a built-in" not in str(err.value)


def test_mistral_nemo_system_message():
    """Nemo's template writes the system prompt into the last user turn only, so in a conversation that ends
    with the assistant it is not rendered at all; that is how the model was trained, and labelling still works."""
    conversations = [[SYSTEM, _user("Q1?"), _assistant("A1.")],
                     [SYSTEM, _user("Q2?"), _assistant("A2."), _user("Q3?"), _assistant("A3.")]]
    stats, _ = _check("mistral-nemo", conversations, "auto", check_input=lambda m: m)
    tok = chatkit.build_tokenizer("mistral-nemo")
    assert SYSTEM["content"] not in tok.apply_chat_template(conversations[1], tokenize=False)
    prompt = tok.apply_chat_template(conversations[1][:4], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(f"[INST]{SYSTEM['content']}\n\nQ3?[/INST]")  # in the prompt of the last turn only
    assert stats["eot_trained"] == 2


def test_supervised_ids_equal_labels_dtype():
    split = _encode("qwen2.5", PLAIN_CASES["single"])
    assert split.labels.dtype.kind == "i" and split.input_ids.dtype.kind == "i"
    assert np.all((split.labels == IGNORE_INDEX) | (split.labels == split.input_ids))


@pytest.mark.parametrize(("family", "prompt_end"), [("r1-distill-2025-01", "<｜Assistant｜>"),
                                                    ("r1-distill", "<｜Assistant｜><think>\n")])
def test_r1_distill_generation_prompts(family, prompt_end):
    """The two R1-Distill templates differ only in the generation prompt: the first published one opens the
    assistant turn without ``<think>\\n``; both delete an assistant turn's content before ``</think>``."""
    tok = chatkit.build_tokenizer(family)
    messages = [_user("Q?"), _assistant(_think("hidden", "A.")), _user("Again?")]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<｜begin▁of▁sentence｜><｜User｜>Q?<｜Assistant｜>\n\nA.<｜end▁of▁sentence｜><｜User｜>Again?{prompt_end}"
