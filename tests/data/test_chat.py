"""Built-in training templates, the template setting, the run's tokenizer and the reasoning policies.

The tokenizer is the demo's character-level one, so the expected supervised
ids of a text are one per character (special tokens one each): computed here
without the labeller.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pipeline.data import chat, prepare
from pipeline.data.cache import IGNORE_INDEX
from pipeline.data.formats import Record
from pipeline.data.tokenize import encode_records
from pipeline.errors import UserError

TURNS = [("repeat: alpha", "alpha"), ("now twice", "alpha alpha"), ("and reversed?", "ahpla")]


def conversation(system="you copy words.", turns=TURNS, reasoning=None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    for k, (user, answer) in enumerate(turns):
        messages.append({"role": "user", "content": user})
        content = answer if reasoning is None else f"<think>\n{reasoning[k]}\n</think>\n\n{answer}"
        messages.append({"role": "assistant", "content": content})
    return messages


def records(*conversations) -> list[Record]:
    return [Record(id=f"r{i}", messages=m, images=[], index=i, line=i + 1) for i, m in enumerate(conversations)]


@pytest.fixture(scope="module")
def run_tokenizers(tokenizer_dir, tmp_path_factory):
    """name -> the run tokenizer `prepare` writes for each built-in template (from the demo tokenizer)."""
    out = {}
    for name in chat.BUILTIN_TEMPLATES:
        target = tmp_path_factory.mktemp(f"tok-{name}")
        info = prepare.prepare(tokenizer_dir, target, name)
        out[name] = (AutoTokenizer.from_pretrained(target), info)
    return out


def ids_of(tokenizer, text: str) -> list[int]:
    """Character-level ids, a special token (the vocabulary's added ones) as one id."""
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values()), key=len, reverse=True)
    out, i = [], 0
    while i < len(text):
        marker = next((s for s in specials if text.startswith(s, i)), None)
        piece = marker or text[i]
        out.append(tokenizer.convert_tokens_to_ids(piece))
        i += len(piece)
    return out


def supervised(enc) -> list[int]:
    return enc.input_ids[enc.labels != IGNORE_INDEX].tolist()


# What a built-in template writes after its generation prompt and before the content (model output, trained).
LEAD = {"gpt-oss": "<|channel|>final<|message|>"}


def trained_turn(name: str, answer: str, reasoning: str | None = None) -> str:
    """The text a built-in template trains for one assistant turn, less its end-of-turn marker."""
    if reasoning is None:
        return LEAD.get(name, "") + answer
    if name == "gpt-oss":  # harmony: the analysis message, then the final one
        return f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant{LEAD[name]}{answer}"
    return f"<think>\n{reasoning}\n</think>\n\n{answer}"


@pytest.mark.parametrize("name", list(chat.BUILTIN_TEMPLATES))
def test_builtin_template_supervises_content_and_end_of_turn(run_tokenizers, name):
    tokenizer, info = run_tokenizers[name]
    messages = conversation()
    enc = encode_records(records(messages), tokenizer, max_length=1024, too_long="error")
    # The whole text is what the template renders, so inference renders prompts as training did.
    assert enc.input_ids.tolist() == ids_of(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False))
    eot = info["end_of_turn"]
    expected = [i for _, answer in TURNS for i in ids_of(tokenizer, trained_turn(name, answer) + eot)]
    assert supervised(enc) == expected
    assert enc.stats["eot_trained"] == 1
    # The system prompt reaches the model in every template (mistral and gemma fold it into the first turn).
    assert "you copy words." in tokenizer.apply_chat_template(messages, tokenize=False)


def test_prepare_adds_only_the_markers_the_vocabulary_lacks(run_tokenizers, tokenizer_dir):
    base = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer, info = run_tokenizers["chatml"]
    assert list(info["added_tokens"]) == ["<|im_start|>", "<|im_end|>"]
    assert info["added_tokens"]["<|im_end|>"] == info["end_of_turn_id"] == len(base) + 1
    assert info["base_vocab_size"] == len(base) and info["vocab_size"] == len(tokenizer) == len(base) + 2
    # The demo vocabulary has phi3's markers already: nothing is added, and they keep their ids.
    _, phi3 = run_tokenizers["phi3"]
    assert phi3["added_tokens"] == {} and phi3["end_of_turn_id"] == base.convert_tokens_to_ids("<|end|>")


def test_template_setting_errors_name_the_setting(tokenizer_dir, tmp_path):
    base = AutoTokenizer.from_pretrained(tokenizer_dir)
    base.chat_template = None
    with pytest.raises(UserError, match=r"no chat template \(a base model\?\): set data\.chat_template to a built-in"):
        chat.resolve_template(None, base)
    with pytest.raises(UserError, match=r"data\.chat_template: 'vicuna' is neither a built-in template"):
        chat.resolve_template("vicuna", base)
    with pytest.raises(UserError, match=r"data\.chat_template: template file not found: .*nope\.jinja"):
        chat.resolve_template(str(tmp_path / "nope.jinja"), base)
    own = tmp_path / "mine.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat.resolve_template(str(own), base) == (own.read_text(), f"file:{own}")


def test_base_model_without_template_needs_one(tokenizer_dir, tmp_path):
    base = AutoTokenizer.from_pretrained(tokenizer_dir)
    base.chat_template = None
    base.save_pretrained(tmp_path / "base")
    with pytest.raises(UserError, match="data.chat_template"):
        prepare.prepare(tmp_path / "base", tmp_path / "out", None)
    info = prepare.prepare(tmp_path / "base", tmp_path / "out", "llama3")
    assert info["template"] == "builtin:llama3" and info["end_of_turn"] == "<|eot_id|>"


REASONS = ["copy it", "twice now", "backwards"]


@pytest.mark.parametrize(("name", "policy", "trained_reasoning", "dropped_by_template"), [
    ("qwen3-thinking", "keep", [0, 1, 2], False),   # every turn's reasoning trained
    ("qwen3-thinking", "drop", [], False),
    ("deepseek-r1", "auto", [0, 1, 2], False),
    ("qwen3", "auto", [], True),                     # the non-thinking template never renders it
    ("chatml", "keep", [0, 1, 2], False),            # a template unaware of reasoning writes it as text
    ("gpt-oss", "auto", [0, 1, 2], False),           # the analysis channel of every turn
    ("gpt-oss", "drop", [], False),
])
def test_reasoning_policies(run_tokenizers, name, policy, trained_reasoning, dropped_by_template):
    tokenizer, info = run_tokenizers[name]
    messages = conversation(reasoning=REASONS)
    enc = encode_records(records(messages), tokenizer, max_length=2048, too_long="error", reasoning=policy)
    eot = ids_of(tokenizer, info["end_of_turn"])
    expected = []
    for k, (_, answer) in enumerate(TURNS):
        expected += ids_of(tokenizer, trained_turn(name, answer, REASONS[k] if k in trained_reasoning else None)) + eot
    assert supervised(enc) == expected
    stats = enc.stats
    assert stats["reasoning_records"] == 1
    assert stats["reasoning_dropped"] == (len(trained_reasoning) < 3)
    assert stats["reasoning_dropped_by_template"] == dropped_by_template


def test_reasoning_content_field_is_reasoning_too(run_tokenizers):
    tokenizer, _ = run_tokenizers["qwen3-thinking"]
    messages = [{"role": "user", "content": "repeat: alpha"},
                {"role": "assistant", "content": "alpha", "reasoning_content": "copy it"}]
    enc = encode_records(records(messages), tokenizer, max_length=512, too_long="error")
    assert supervised(enc) == ids_of(tokenizer, "<think>\ncopy it\n</think>\n\nalpha<|im_end|>")


def test_a_thinking_field_is_reasoning_as_reasoning_content_is(run_tokenizers):
    """GPT-OSS / harmony datasets carry an assistant turn's reasoning as `thinking`: read as the record
    reader reads a line (`normalize_record`), it trains as `reasoning_content` does; both is a problem."""
    from pipeline.data.normalize import normalize_record

    tokenizer, _ = run_tokenizers["qwen3-thinking"]
    answer = {"role": "assistant", "content": "alpha"}
    read = {field: normalize_record({"messages": [{"role": "user", "content": "repeat: alpha"},
                                                  {**answer, field: "copy it"}]},
                                    index=0, line=1, file="t.jsonl", kind="jsonl", base_dir=".")
            for field in ("thinking", "reasoning_content")}
    assert all(not problems for _, problems in read.values())
    assert read["thinking"][0].messages == read["reasoning_content"][0].messages
    enc = encode_records([read["thinking"][0]], tokenizer, max_length=512, too_long="error")
    assert supervised(enc) == ids_of(tokenizer, "<think>\ncopy it\n</think>\n\nalpha<|im_end|>")
    _, problems = normalize_record({"messages": [{"role": "user", "content": "q"},
                                                 {**answer, "thinking": "a", "reasoning_content": "b"}]},
                                   index=0, line=1, file="t.jsonl", kind="jsonl", base_dir=".")
    assert [p.reason for p in problems] == ["bad_reasoning"]
    assert "reasoning twice (reasoning_content and thinking)" in problems[0].message


def test_sentinel_characters_in_data_are_refused(run_tokenizers):
    from pipeline.errors import DataError

    tokenizer, _ = run_tokenizers["chatml"]
    bad = conversation(turns=[("hi", "a\ue000b")], system=None)
    with pytest.raises(DataError, match=r"mem record 0 \(line 1, id 'r0'\): holds the private-use characters"):
        encode_records(records(bad), tokenizer, max_length=512, too_long="error", source="mem")


@pytest.mark.parametrize(("name", "marker"), [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), ("gemma", "<end_of_turn>"),
                                              ("mistral", "<|end|>"), ("phi3", "<|end|>"),
                                              ("gpt-oss", "<|return|>")])
def test_end_of_turn_is_found_from_the_template(run_tokenizers, name, marker):
    tokenizer, info = run_tokenizers[name]
    assert chat.end_of_turn(tokenizer) == marker == info["end_of_turn"]  # mistral's is the eos (the demo's <|end|>)


def test_generation_stops_at_the_end_of_turn_marker_too(run_tokenizers):
    from pipeline.model.prompts import Prompts

    tokenizer, info = run_tokenizers["chatml"]
    assert Prompts(tokenizer).eos_token_id == [tokenizer.eos_token_id, info["end_of_turn_id"]]


def test_exact_match_compares_answers_not_reasoning(run_tokenizers):
    from pipeline.data.formats import prompt_and_reference
    from pipeline.model.prompts import Prompts

    tokenizer, _ = run_tokenizers["qwen3-thinking"]
    record = records(conversation(system=None, turns=TURNS[:1], reasoning=REASONS))[0]
    prompt, reference = prompt_and_reference(record)
    assert reference == "alpha" and prompt == [{"role": "user", "content": "repeat: alpha"}]
    generated = tokenizer("<think>\ncopy it\n</think>\n\nalpha<|im_end|>", add_special_tokens=False,
                          return_tensors="pt")["input_ids"][0]
    assert Prompts(tokenizer).decode(generated).strip() == "alpha"


@pytest.mark.parametrize("family", ["tiny_llava", "tiny_qwen2_vl"])
def test_vision_language_run_tokenizer_is_the_processor_as_shipped(request, family, tmp_path):
    from pipeline.data.tokenize import load_chat

    model = request.getfixturevalue(family)["model"]
    prepare.prepare(model, tmp_path / "tok", None)
    tokenizer, images = load_chat(tmp_path / "tok")  # no weights there: processor files and config only
    _, original = load_chat(model)
    assert images is not None and images.chat_template == original.chat_template
    assert not list((tmp_path / "tok").glob("*.safetensors"))
    with pytest.raises(UserError, match="data.chat_template='chatml': a vision-language model trains with"):
        prepare.prepare(model, tmp_path / "tok2", "chatml")


@pytest.mark.parametrize(("family", "hint"), [
    ("qwen3", "data.chat_template: qwen3 (or qwen3-thinking)"), ("qwen2.5", "data.chat_template: chatml"),
    ("phi-3.5", "data.chat_template: phi3"), ("gemma-3", "data.chat_template: gemma"),
    ("llama-3.1", "data.chat_template: llama3"), ("gpt-oss", "data.chat_template: gpt-oss"),
])
def test_the_builtin_suggested_for_a_shipped_template_is_its_familys(family, hint):
    import kits.chat as chatkit

    from pipeline.data.chat import suggest_builtin

    assert suggest_builtin(chatkit.template_text(family)).startswith(f"set {hint} ")


def test_a_template_of_its_own_format_gets_no_other_familys_builtin():
    """GLM-4.5's turns (`<|assistant|>`, an empty think block) are neither Phi-3's nor Qwen3's format."""
    from pipeline.data.chat import suggest_builtin

    glm = "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n<think></think>\n{{ m.content }}{% endfor %}"
    assert suggest_builtin(glm).startswith("set data.chat_template to a built-in template (")


NEXT_HEADER_TEMPLATE = (  # GLM's shape: a turn ends where the next one's header begins; nothing after the last
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.mark.parametrize("stops", [None, ["<|end|>", "<|user|>"]], ids=["no generation config", "generation config"])
def test_the_models_stop_tokens_end_a_turn_and_the_last_turn_gets_the_eos(tokenizer_dir, tmp_path, stops):
    """The run tokenizer carries the model's generation_config.json: its eos ids are stop tokens, which
    close a turn where the template writes the next turn's header (GLM's `<|user|>`); after a last turn
    the template writes nothing, so the eos (`<|end|>` here) is appended and trained."""
    import json
    import shutil

    from pipeline.model.prompts import Prompts

    model = tmp_path / "model"
    shutil.copytree(tokenizer_dir, model)
    if stops:
        ids = AutoTokenizer.from_pretrained(tokenizer_dir).convert_tokens_to_ids(stops)
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    (tmp_path / "glm.jinja").write_text(NEXT_HEADER_TEMPLATE)
    prepare.prepare(model, tmp_path / "run", str(tmp_path / "glm.jinja"))
    assert (tmp_path / "run" / "generation_config.json").is_file() == bool(stops)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    messages = [{"role": "user", "content": "say a"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "say b"}, {"role": "assistant", "content": "b"}]
    enc = encode_records([Record(id="r", messages=messages, images=[], index=0, line=1)], tokenizer,
                         max_length=512, too_long="error")
    runs = [tokenizer.decode(enc.input_ids[i:j]) for i, j in _runs(enc.labels)]
    assert runs == (["a<|user|>", "b<|end|>"] if stops else ["a", "b<|end|>"])
    assert enc.stats["eot_trained"] == (1 if stops else 0)  # every turn closed
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    assert (user in Prompts(tokenizer).eos_token_id) == bool(stops)  # generation stops where training taught


def _runs(labels) -> list[tuple[int, int]]:
    on = [int(x) != IGNORE_INDEX for x in labels] + [False]
    return [(i, next(j for j in range(i, len(on)) if not on[j])) for i in range(len(on) - 1)
            if on[i] and (i == 0 or not on[i - 1])]
