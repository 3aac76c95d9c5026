"""Plain text records and tool calls: read, validated, tokenized and labelled on shipped templates.

The shipped templates are the verbatim files of ``tests/data/chat_templates/`` (sources in its
README: Qwen2.5 and Llama 3.1 from ggml-org/llama.cpp ``models/templates/``, Qwen3 from TRL),
run in the character-level tokenizers of `tests/kits/chat.py`, so the expected supervised text
of every case is written out here and compared with what the labeller supervises.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

import kits.chat as chatkit
from pipeline.data import validate as v
from pipeline.data.cache import IGNORE_INDEX, TokenCache
from pipeline.data.formats import TEXT_ROLE, parse_file
from pipeline.data.tokenize import encode_records, tokenize_file
from pipeline.errors import DataError


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def supervised(tokenizer, encoded) -> list[str]:
    """The decoded text of each run of supervised tokens, record by record."""
    runs = []
    for lo, hi in zip(encoded.offsets[:-1], encoded.offsets[1:]):
        ids, mask = encoded.input_ids[lo:hi], encoded.labels[lo:hi] != IGNORE_INDEX
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
        runs += [tokenizer.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]
    return runs


def reasons(parsed_or_report) -> list[tuple[int | None, str]]:
    problems = getattr(parsed_or_report, "problems")
    return [(p.index, p.reason) for p in (q[1] if isinstance(q, tuple) else q for q in problems)]


# --- plain text -----------------------------------------------------------------------------------


def test_text_records_are_read_as_one_text_message(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "Once upon a time."}, {"id": 7, "text": "The end."}])
    parsed = parse_file(path)
    assert not parsed.problems
    assert [(r.id, r.messages, r.is_text) for r in parsed.records] == [
        (None, [{"role": TEXT_ROLE, "content": "Once upon a time."}], True),
        ("7", [{"role": TEXT_ROLE, "content": "The end."}], True)]


def test_text_record_defects_are_each_reported(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"text": "  "}, {"text": 3}, {"text": "fine", "image": "a.png", "system": "be brief"}])
    assert reasons(parse_file(path)) == [(0, "empty_text"), (1, "text_not_string"), (2, "bad_text_record"),
                                         (2, "bad_text_record")]


def test_a_file_mixing_text_and_conversations_is_refused_in_one_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"text": "plain"}, {"prompt": "q", "completion": "a"}, {"text": "more plain"}])
    problems = parse_file(path).problems
    assert [(p.index, p.reason) for p in problems] == [(None, "mixed_shapes")]
    assert "2 plain text record(s) (first: record 0) and 1 conversation(s) (first: record 1)" in problems[0].message


@pytest.mark.parametrize("family, bos", [("qwen2.5", ""), ("llama-3.1", "<|begin_of_text|>")])
def test_text_is_trained_whole_with_the_eos_after_it(family, bos):
    """No chat template: every token but the BOS the tokenizer puts before plain text is a target, and the
    EOS is appended (once: a text that already ends with it keeps it as is)."""
    from tokenizers import processors

    from pipeline.data.formats import Record

    tokenizer = copy.deepcopy(chatkit.build_tokenizer(family))
    if bos:  # Llama's tokenizer puts its BOS before plain text
        tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    eos = tokenizer.eos_token
    records = [Record(None, [{"role": TEXT_ROLE, "content": "Hello {world}\nbye"}], [], 0, None),
               Record(None, [{"role": TEXT_ROLE, "content": f"ends already{eos}"}], [], 1, None)]
    encoded = encode_records(records, tokenizer, max_length=4096, too_long="error")
    first = encoded.input_ids[encoded.offsets[0]:encoded.offsets[1]].tolist()
    assert first == chatkit.char_ids(family, f"{bos}Hello {{world}}\nbye{eos}")
    assert supervised(tokenizer, encoded) == ["Hello {world}\nbye" + eos, "ends already" + eos]
    labels = encoded.labels[encoded.offsets[0]:encoded.offsets[1]]
    assert (labels[:1] == IGNORE_INDEX).all() == bool(bos)
    assert encoded.stats["eot_trained"] == 2 and encoded.stats["assistant_turns"] == 0


def test_text_file_validates_and_caches_with_every_token_supervised(tmp_path, tokenizer_dir, tokenizer):
    """Through validation (length, duplicates) and the cache, on the embedded model's tokenizer."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": "abc def"}, {"text": "ghi"}, {"text": "abc def"},
                                                   {"text": "x" * 300}])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=64, too_long="error")
    assert sorted(p.reason for _, p in report.problems) == ["duplicate_sample", "too_long"]
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=64, too_long="drop", duplicates="drop")
    assert report.ok, report.summary()
    stats = tokenize_file(train, tokenizer, out_path=tmp_path / "train.safetensors", max_length=64, too_long="drop",
                          fingerprint="x", split="train", duplicates="drop")
    assert (stats["records"], stats["duplicates_dropped"], stats["dropped"]) == (2, 1, 1)
    cache = TokenCache(tmp_path / "train.safetensors")
    for i, text in enumerate(("abc def", "ghi")):
        ids, labels = (t.numpy() for t in cache[i])
        assert tokenizer.decode(ids) == text + tokenizer.eos_token
        assert (labels == ids).all()  # the embedded tokenizer adds no BOS to plain text: all of it is trained


def test_text_records_have_no_place_in_the_test_split(tmp_path, tokenizer_dir):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "q", "completion": "a"}])
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": "no prompt here"}])
    report = v.validate_dataset(train, test=test, tokenizer_dir=tokenizer_dir, max_length=64, too_long="error")
    assert [(split, p.reason) for split, p in report.problems] == [("test", "text_in_test")]


# --- tool calls -----------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tool_record(content: str = "", arguments='{"city": "Paris"}') -> dict:
    """A user question, an assistant call (OpenAI: arguments as JSON text), its result, the answer."""
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call12345", "content": "18C and sunny"},
        {"role": "assistant", "content": "It is 18C and sunny."}]}


CALL_QWEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
CALL_LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
CALL_GEMMA4 = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


@pytest.mark.parametrize("family, content, expected", [
    ("qwen2.5", "", [CALL_QWEN, "It is 18C and sunny.<|im_end|>"]),
    ("qwen2.5", "Let me check.", ["Let me check.\n" + CALL_QWEN, "It is 18C and sunny.<|im_end|>"]),
    ("qwen3", "", [CALL_QWEN, "It is 18C and sunny.<|im_end|>"]),
    # Llama 3.1 writes only the call of a calling turn (its content is not rendered, so not trained).
    ("llama-3.1", "", [CALL_LLAMA, "It is 18C and sunny.<|eot_id|>"]),
    ("llama-3.1", "Let me check.", [CALL_LLAMA, "It is 18C and sunny.<|eot_id|>"]),
    ("mistral-nemo", "", ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call12345"}]</s>',
                          "It is 18C and sunny.</s>"]),
    # Gemma 4 writes the calls first, then the calling turn's content; the result is a turn of its own (role tool).
    ("gemma-4", "", [CALL_GEMMA4 + "<turn|>", "It is 18C and sunny.<turn|>"]),
    ("gemma-4", "Let me check.", [CALL_GEMMA4 + "Let me check.<turn|>", "It is 18C and sunny.<turn|>"]),
])
def test_tool_calls_are_trained_and_tool_results_are_not(tmp_path, family, content, expected):
    """The calling turn is supervised from its content (or the end of the assistant header) through the call
    and the end-of-turn marker; the tool result and the tools schema are context only."""
    tokenizer = chatkit.build_tokenizer(family)
    parsed = parse_file(write_jsonl(tmp_path / "t.jsonl", [tool_record(content)]))
    assert not parsed.problems
    record = parsed.records[0]
    assert record.tools == TOOLS
    assert record.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # JSON text parsed
    encoded = encode_records(parsed.records, tokenizer, max_length=8192, too_long="error")
    text = tokenizer.decode(encoded.input_ids)
    assert "18C and sunny" in text and "The weather of a city" in text  # result and tools are in the prompt
    assert supervised(tokenizer, encoded) == expected
    assert encoded.input_ids.tolist() == chatkit.char_ids(family, tokenizer.apply_chat_template(
        record.messages, tools=TOOLS, tokenize=False))
    assert encoded.stats["eot_trained"] == 1


# The same call in OpenAI's older function-calling format and in its tools format, each line as Azure OpenAI's
# "Fine-tuning and function calling" page prints it (learn.microsoft.com/azure/ai-services/openai/how-to/
# fine-tuning-functions; the older one in its 2023 revision). The newer one's calling turn has no content key.
LEGACY_FUNCTIONS = (
    r'{"messages": [{"role": "user", "content": "What is the weather in San Francisco?"}, {"role": "assistant", '
    r'"function_call": {"name": "get_current_weather", "arguments": "{\"location\": \"San Francisco, USA\", '
    r'\"format\": \"celsius\"}"}}], "functions": [{"name": "get_current_weather", "description": "Get the current '
    r'weather", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "The '
    r'city and country, eg. San Francisco, USA"}, "format": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, '
    r'"required": ["location", "format"]}}]}')
TOOLS_FORMAT = (
    r'{"messages":[{"role":"user","content":"What is the weather in San Francisco?"},{"role":"assistant",'
    r'"tool_calls":[{"id":"call_id","type":"function","function":{"name":"get_current_weather","arguments":'
    r'"{\"location\": \"San Francisco, USA\", \"format\": \"celsius\"}"}}]}],"tools":[{"type":"function",'
    r'"function":{"name":"get_current_weather","description":"Get the current weather","parameters":{"type":'
    r'"object","properties":{"location":{"type":"string","description":"The city and country, eg. San Francisco, '
    r'USA"},"format":{"type":"string","enum":["celsius","fahrenheit"]}},"required":["location","format"]}}}]}')


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1"])
def test_openai_s_older_function_call_format_trains_as_its_tools_format(tmp_path, family):
    """`function_call` on an assistant turn is one tool call, `functions` the tools, a `function` turn the result:
    the same tokens and labels as the record in the tools format (whose call id the template does not show)."""
    tokenizer = chatkit.build_tokenizer(family)
    (tmp_path / "old.jsonl").write_text(LEGACY_FUNCTIONS + "\n")
    (tmp_path / "new.jsonl").write_text(TOOLS_FORMAT + "\n")
    old, new = (parse_file(tmp_path / f"{name}.jsonl") for name in ("old", "new"))
    assert not old.problems and not new.problems
    assert old.records[0].tools == new.records[0].tools
    encoded = [encode_records(p.records, tokenizer, max_length=8192, too_long="error") for p in (old, new)]
    assert encoded[0].input_ids.tolist() == encoded[1].input_ids.tolist()
    assert encoded[0].labels.tolist() == encoded[1].labels.tolist()
    assert "get_current_weather" in supervised(tokenizer, encoded[0])[0]

    answered = json.loads(LEGACY_FUNCTIONS)
    answered["messages"] += [{"role": "function", "name": "get_current_weather", "content": "21.0"},
                             {"role": "assistant", "content": "It is 21 degrees celsius in San Francisco."}]
    user_call = {"messages": [{"role": "user", "content": "q", "function_call": {"name": "f", "arguments": "{}"}},
                              {"role": "assistant", "content": "a"}]}
    parsed = parse_file(write_jsonl(tmp_path / "more.jsonl", [answered, user_call]))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [(1, "bad_tool_call", "messages[0].function_call")]
    assert "only an assistant turn may have function_call" in parsed.problems[0].message
    runs = supervised(tokenizer, encode_records(parsed.records, tokenizer, max_length=8192, too_long="error"))
    assert len(runs) == 2 and "21.0" not in "".join(runs) and runs[1].startswith("It is 21 degrees")


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
def test_a_last_turn_of_two_calls_is_trained_without_the_empty_think_block(tmp_path, family):
    """Qwen3 writes an empty think block before a last turn's content: prompt, as for a turn with content."""
    call = tool_record()["messages"][1]["tool_calls"][0]
    second = {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}
    record = {"messages": [{"role": "user", "content": "Weather and time?"},
                           {"role": "assistant", "content": "", "tool_calls": [call, second]}]}
    tokenizer = chatkit.build_tokenizer(family)
    encoded = encode_records(parse_file(write_jsonl(tmp_path / "t.jsonl", [record])).records, tokenizer,
                             max_length=8192, too_long="error")
    assert ("<think>\n\n</think>" in tokenizer.decode(encoded.input_ids)) == (family == "qwen3")
    assert supervised(tokenizer, encoded) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>']


@pytest.mark.parametrize("family, why", [
    ("phi-3.5", "does not render tool calls (the call of 'get_weather' is not in its text)"),  # drops them silently
    ("llama-3", "does not render tool calls (the call of 'get_weather' is not in its text)"),
    ("gemma-2", "TemplateError: Conversation roles must alternate"),  # raises on the tool turn
])
def test_a_template_without_tools_refuses_the_record_naming_the_template(tmp_path, family, why):
    tokenizer = chatkit.build_tokenizer(family)
    records = parse_file(write_jsonl(tmp_path / "t.jsonl", [tool_record()])).records
    with pytest.raises(DataError) as err:
        encode_records(records, tokenizer, max_length=8192, too_long="error", source="t.jsonl")
    message = str(err.value)
    assert message.startswith("t.jsonl record 0 (line 1): ") and why in message
    where = tokenizer.name_or_path  # the kit's tokenizer dir (it holds the family's generation config)
    assert f"the chat template (data.chat_template: tokenizer, in {where})" in message and "supports tools" in message


def test_tool_call_defects_are_each_reported(tmp_path):
    good = tool_record()
    bad_arguments = tool_record(arguments="{not json")
    orphan_result = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                                  {"role": "assistant", "content": "a"}]}
    user_calls = {"messages": [{"role": "user", "content": "q", "tool_calls": good["messages"][1]["tool_calls"]},
                               {"role": "assistant", "content": "a"}]}
    bad_tools = {**good, "tools": "get_weather"}
    parsed = parse_file(write_jsonl(tmp_path / "t.jsonl", [bad_arguments, orphan_result, user_calls, bad_tools]))
    found = [(p.index, p.reason, p.field) for p in parsed.problems]
    assert found == [
        (0, "bad_tool_call", "messages[1].tool_calls[0]"),
        (0, "empty_text", "messages[1].content"),  # no valid call: an empty assistant turn is empty
        (0, "bad_role_order", "messages[2].role"),  # and its result answers no call
        (1, "bad_role_order", "messages[1].role"),
        (2, "bad_tool_call", "messages[0].tool_calls"),
        (3, "bad_tools", "tools"),
    ]
    assert "tool turns follow an assistant turn with tool_calls" in parsed.problems[2].message


# --- several defects in one record ----------------------------------------------------------------


def test_a_record_reports_every_defect_missing_placeholder_and_missing_file(tmp_path, tiny_llava):
    """The placeholder fault does not hide the missing image file (nor the other way round)."""
    record = {"id": "r0", "image": "nowhere.png",
              "conversations": [{"from": "human", "value": "what colour?"}, {"from": "gpt", "value": "red"}]}
    train = write_jsonl(tmp_path / "train.jsonl", [record])
    report = v.validate_dataset(train, tokenizer_dir=tiny_llava["model"], max_length=128, too_long="error")
    found = {(p.index, p.reason, p.field) for _, p in report.problems}
    assert {(0, "image_placeholder_mismatch", "image"), (0, "image_missing", "image[0]")} <= found, found
    out_json, out_csv = tmp_path / "v.json", tmp_path / "v.csv"
    v.write_report(report, out_json, out_csv)
    rows = [line for line in out_csv.read_text().splitlines()[1:] if ",0," in line]
    assert len(rows) >= 2 and any("image_missing" in r for r in rows)
    assert {p["reason"] for p in json.loads(out_json.read_text())["problems"]} >= {
        "image_placeholder_mismatch", "image_missing"}


def test_images_given_to_a_text_only_model_are_named_as_such(tmp_path, tokenizer_dir):
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    record = {"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nwhat colour?"},
                                                  {"from": "gpt", "value": "red"}]}
    train = write_jsonl(tmp_path / "train.jsonl", [record, {"prompt": "q", "completion": "a"}])
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    [(split, problem)] = report.problems
    assert (problem.index, problem.reason) == (0, "images_on_text_model")
    assert "1 image(s) given to a text-only model" in problem.message


def test_relative_image_paths_start_from_data_image_dir_where_it_is_set(tmp_path, tiny_llava):
    """LLaVA-Instruct-150K's JSON names its COCO images by file name ("000000033471.jpg"), kept apart from them:
    the paths do not start at the JSON's folder. Without data.image_dir each missing image is named with where
    paths start; with it, validation, tokenization (the cache keeps the resolved path) and the held-out prompts
    of evaluation find them. A data.image_dir that is not a directory is named as the setting."""
    import argparse

    from PIL import Image

    from pipeline.data.shapes import field_map
    from pipeline.data.tokenize import load_chat
    from pipeline.errors import UserError
    from pipeline.evaluate.metrics import add_held_out_args, held_out_examples

    coco = tmp_path / "coco" / "train2017"
    coco.mkdir(parents=True)
    for name, colour in (("000000033471.jpg", "red"), ("000000052846.jpg", "blue")):
        Image.new("RGB", (32, 32), colour).save(coco / name)
    records = [{"id": f"{k}", "image": name, "conversations": [
        {"from": "human", "value": "<image>\nWhat colour is the picture?"}, {"from": "gpt", "value": colour}]}
        for k, (name, colour) in enumerate((("000000033471.jpg", "Red."), ("000000052846.jpg", "Blue.")))]
    (tmp_path / "ann").mkdir()
    train = tmp_path / "ann" / "llava_instruct.json"
    train.write_text(json.dumps(records, indent=1))
    settings = dict(tokenizer_dir=tiny_llava["model"], max_length=256, too_long="error")

    unset = v.validate_dataset(train, **settings)
    assert [(p.index, p.reason) for _, p in unset.problems] == [(0, "image_missing"), (1, "image_missing")]
    assert unset.problems[0][1].message == (
        f"image file not found: {tmp_path / 'ann' / '000000033471.jpg'} (the data's relative image paths start from "
        "the dataset file's directory, or from data.image_dir where it is set)")

    assert v.main(["--train", str(train), "--tokenizer", str(tiny_llava["model"]), "--max-length", "256",
                   "--too-long", "error", "--duplicates", "error", "--reasoning", "auto", "--image-dir", str(coco),
                   "--out-json", str(tmp_path / "v.json"), "--out-csv", str(tmp_path / "v.csv")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())["settings"]["image_dir"] == str(coco)
    tokenizer, images = load_chat(tiny_llava["model"])
    tokenize_file(train, tokenizer, out_path=tmp_path / "train.safetensors", max_length=256, too_long="error",
                  fingerprint="-", split="train", images=images, fields=field_map(image_dir=str(coco)))
    cache = TokenCache(tmp_path / "train.safetensors")
    resolved = [[str(coco / "000000033471.jpg")], [str(coco / "000000052846.jpg")]]
    assert [cache.images(i) for i in range(len(cache))] == resolved
    parser = argparse.ArgumentParser()
    add_held_out_args(parser)
    args = parser.parse_args(["--max-new-tokens", "8", "--image-dir", str(coco)])
    assert [e.images for e in held_out_examples(train, None, args)] == resolved

    with pytest.raises(UserError, match=f"data.image_dir: {tmp_path / 'ann'}/nowhere is not a directory"):
        field_map(image_dir=str(tmp_path / "ann" / "nowhere"))


# --- the README's examples ------------------------------------------------------------------------


def _readme_records() -> list[dict]:
    """The one-record examples of the README's Data section (its ```json blocks, one record a line)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Data: files and record shapes", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```json\n(.*?)^```", section, re.M | re.S)
    return [json.loads(line) for block in blocks for line in block.splitlines() if line.strip()]


def test_every_readme_example_record_is_accepted_and_tools_render_where_supported(tmp_path):
    from pipeline.data.chat import BUILTIN_TEMPLATES

    records = _readme_records()
    # messages, with a turn of weight 0, with tools, conversations, alpaca, texts, two prompt/completion, text
    assert len(records) == 9
    for i, record in enumerate(records):
        parsed = parse_file(write_jsonl(tmp_path / f"r{i}.jsonl", [record]))
        assert not parsed.problems, (record, [p.describe() for p in parsed.problems])
    [with_tools] = parse_file(write_jsonl(tmp_path / "tools.jsonl", [r for r in records if "tools" in r])).records
    qwen = chatkit.build_tokenizer("qwen2.5")
    assert supervised(qwen, encode_records([with_tools], qwen, max_length=8192, too_long="error"))[0].startswith(
        '<tool_call>\n{"name": "get_weather"')
    chatml = copy.deepcopy(qwen)
    chatml.chat_template = BUILTIN_TEMPLATES["chatml"].template  # ours renders no tool calls: refused
    with pytest.raises(DataError, match="does not render tool calls"):
        encode_records([with_tools], chatml, max_length=8192, too_long="error")


EXTERNAL = Path(__file__).resolve().parent / "external"


def _as_openai(record: dict) -> dict:
    """A LLaMA-Factory ShareGPT tool record spelled in OpenAI's format, by its documented meaning (data/README.md
    there): human / gpt turns, a function_call turn's value the JSON of the call, observation the result."""
    role = {"human": "user", "gpt": "assistant", "observation": "tool"}
    messages = [{"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": json.loads(t["value"])}]}
                if t["from"] == "function_call" else {"role": role[t["from"]], "content": t["value"]}
                for t in record["conversations"]]
    return {"messages": messages, "tools": [{"type": "function", "function": f} for f in json.loads(record["tools"])]}


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1"])
def test_llama_factory_sharegpt_tool_records_train_as_their_openai_spelling(tmp_path, family):
    """LLaMA-Factory's glaive tool-calling demo (tests/data/external/README.md), as it ships: each record reads,
    tokenizes and is labelled as its OpenAI spelling is; a call is trained, its observation is not."""
    records = json.loads((EXTERNAL / "glaive_toolcall_en_demo_first12.json").read_text())
    parsed = parse_file(EXTERNAL / "glaive_toolcall_en_demo_first12.json")
    assert not parsed.problems and len(parsed.records) == 12
    openai = parse_file(write_jsonl(tmp_path / "openai.jsonl", [_as_openai(r) for r in records]))
    assert not openai.problems
    tokenizer = chatkit.build_tokenizer(family)
    ours, theirs = (encode_records(p.records, tokenizer, max_length=1 << 16, too_long="error") for p in (parsed, openai))
    assert ours.input_ids.tolist() == theirs.input_ids.tolist() and ours.labels.tolist() == theirs.labels.tolist()
    runs = supervised(tokenizer, ours)
    calls = [t for r in records for t in r["conversations"] if t["from"] == "function_call"]
    assert len(calls) == 8 and sum('"name": "search_recipes"' in run for run in runs) == 1
    observed = [t["value"] for r in records for t in r["conversations"] if t["from"] == "observation"]
    assert not any(o in run for o in observed for run in runs)


def test_a_function_call_turn_that_is_not_a_call_is_named(tmp_path):
    record = {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "search it"},
                                {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}],
              "tools": "[{\"name\": \"search\""}
    parsed = parse_file(write_jsonl(tmp_path / "t.jsonl", [record]))
    assert [(p.reason, p.field) for p in parsed.problems][:2] == [("bad_tool_call", "conversations[1].value"),
                                                                 ("empty_text", "conversations[1].value")]
    assert ("bad_tools", "tools") in [(p.reason, p.field) for p in parsed.problems]


def _v1_as_openai(record: dict) -> dict:
    """A LLaMA-Factory v1 record (typed parts holding a `value`, per-message `loss_weight`, `tools` as JSON text)
    spelled in OpenAI's format by its documented meaning (v1's `_to_hf_messages` there): text parts joined,
    reasoning parts as `reasoning_content`, each tool_call part the JSON of one call, loss_weight 0 as weight 0."""
    messages = []
    for m in record["messages"]:
        values = {kind: [p["value"] for p in m["content"] if p["type"] == kind] for kind in ("text", "reasoning",
                                                                                            "tool_call")}
        message = {"role": m["role"], "content": "".join(values["text"])}
        if values["reasoning"]:
            message["reasoning_content"] = "".join(values["reasoning"])
        if values["tool_call"]:
            message["tool_calls"] = [{"type": "function", "function": json.loads(v)} for v in values["tool_call"]]
        if m["role"] == "assistant" and m.get("loss_weight") == 0:
            message["weight"] = 0
        messages.append(message)
    return {"messages": messages, **({"tools": json.loads(record["tools"])} if "tools" in record else {})}


@pytest.mark.parametrize("name", ["v1_sft_demo_first12.jsonl", "reason_tool_use_demo_first8.jsonl"])
def test_llama_factory_v1_records_train_as_their_openai_spelling(tmp_path, name):
    """LLaMA-Factory v1's demos (tests/data/external/README.md), as they ship: parts holding a `value`, per-message
    loss_weight; the reasoning and tool-use demo's reasoning and tool_call parts. Each record reads, tokenizes and is
    labelled as its OpenAI spelling is (Qwen3's shipped template renders the tools, calls and reasoning); the calls
    and the last turn's reasoning are trained, the tool results are not."""
    records = [json.loads(line) for line in (EXTERNAL / name).read_text().splitlines() if line.strip()]
    parsed = parse_file(EXTERNAL / name)
    assert not parsed.problems and len(parsed.records) == len(records)
    openai = parse_file(write_jsonl(tmp_path / "openai.jsonl", [_v1_as_openai(r) for r in records]))
    assert not openai.problems
    assert [(r.messages, r.tools) for r in parsed.records] == [(r.messages, r.tools) for r in openai.records]
    tokenizer = chatkit.build_tokenizer("qwen3")
    ours, theirs = (encode_records(p.records, tokenizer, max_length=1 << 16, too_long="error") for p in (parsed, openai))
    assert ours.input_ids.tolist() == theirs.input_ids.tolist() and ours.labels.tolist() == theirs.labels.tolist()
    runs = supervised(tokenizer, ours)
    parts = [(m["role"], p) for r in records for m in r["messages"] for p in m["content"]]
    calls = [json.loads(p["value"])["name"] for role, p in parts if p["type"] == "tool_call"]
    assert all(any(f'"name": "{n}"' in run for run in runs) for n in calls)
    assert not any(p["value"] in run for role, p in parts if role == "tool" for run in runs)
    if name.startswith("reason"):
        assert len(calls) == 12 and sum(p["type"] == "reasoning" for _, p in parts) == 16
        last_reasoning = [p["value"] for p in records[0]["messages"][-1]["content"] if p["type"] == "reasoning"]
        assert any(last_reasoning[0].strip() in run for run in runs)


def test_llama_factory_v1_images_weights_and_media_parts(tmp_path):
    """v1's multimodal demo as it ships: image_url parts hold the image's path (relative to the file's directory
    here, LLaMA-Factory's repository root there), each a placeholder where its part is. A loss_weight other than
    0 / 1, and a video or audio part, are problems naming their field."""
    parsed = parse_file(EXTERNAL / "v1_multimodal_demo.jsonl")
    assert not parsed.problems and len(parsed.records) == 24
    first = parsed.records[0]
    assert [m["content"] for m in first.messages] == ["<image>Who are they?", "They're Kane and Gretzka from Bayern "
                                                      "Munich.", "What are they doing?<image>",
                                                      "They are celebrating on the soccer field."]
    assert first.images == [str(EXTERNAL / "data/mllm_demo_data/1.jpg")] * 2
    assert all(Path(p).is_file() for r in parsed.records for p in r.images)

    def turn(role, kind, value, **extra):
        return {"role": role, "content": [{"type": kind, "value": value}], **extra}
    bad = [{"messages": [turn("user", "text", "q", loss_weight=0.0), turn("assistant", "text", "a", loss_weight=0.5)]},
           {"messages": [turn("user", "video_url", "data/mllm_demo_data/1.mp4"), turn("assistant", "text", "a")]},
           {"messages": [turn("user", "text", "q"), turn("assistant", "tool_call", "search it")]},
           {"messages": [turn("user", "reasoning", "hm"), turn("assistant", "text", "a")]},
           {"messages": [turn("user", "text", "q"), turn("assistant", "text", "a", loss_weight=0.0),
                         turn("user", "text", "again"), turn("assistant", "text", "b", loss_weight=1.0)]}]
    parsed = parse_file(write_jsonl(tmp_path / "bad.jsonl", bad))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [
        (0, "bad_weight", "messages[1].loss_weight"), (1, "unsupported_media", "messages[0].content[0]"),
        (2, "bad_tool_call", "messages[1].content[0]"), (3, "empty_text", "messages[0].content"),
        (3, "bad_reasoning", "messages[0].content[0]")]
    assert "loss_weight must be 0 (not trained) or 1 (trained), found 0.5" in parsed.problems[0].message
    assert [m.get("weight") for m in parsed.records[-1].messages] == [None, 0, None, None]
