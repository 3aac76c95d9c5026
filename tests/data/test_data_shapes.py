"""Record shapes: Alpaca and TRL prompt/completion become the same conversations as OpenAI messages;
a mapping (data.columns / data.roles) reads datasets whose keys differ; an unknown shape is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_text_and_tools import EXTERNAL  # tests/data/external: the files vendored as their makers ship them
from test_data_tokenize import END, supervised_runs  # tests/data: the label helpers

from pipeline.data import tokenize as tk
from pipeline.data.formats import duplicate_of, load_records, parse_file
from pipeline.data.shapes import FieldMap, field_map
from pipeline.data.validate import main as validate_main, validate_dataset
from pipeline.errors import UserError


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def messages(user: str, answer: str, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


# Each shape's spelling of the same three conversations (the second with an Alpaca input).
SHAPED = {
    "alpaca": [{"instruction": "repeat: alpha", "input": "", "output": "alpha"},
               {"instruction": "repeat", "input": "beta", "output": "beta", "system": "you copy words."},
               {"instruction": "spell gamma", "output": "g a m m a"}],
    "prompt_completion": [{"prompt": "repeat: alpha", "completion": "alpha"},
                          {"prompt": "repeat\n\nbeta", "completion": "beta", "system": "you copy words."},
                          {"prompt": "spell gamma", "completion": "g a m m a"}],
    "prompt_completion_messages": [
        {"prompt": [{"role": "user", "content": "repeat: alpha"}],
         "completion": [{"role": "assistant", "content": "alpha"}]},
        {"prompt": messages("repeat\n\nbeta", "")[:1], "system": "you copy words.",
         "completion": [{"role": "assistant", "content": "beta"}]},
        {"prompt": [{"role": "user", "content": "spell gamma"}],
         "completion": [{"role": "assistant", "content": "g a m m a"}]}],
    "texts": [{"texts": [{"user": "repeat: alpha", "assistant": "alpha", "source": "x"}]},
              {"texts": [{"user": "repeat\n\nbeta", "assistant": "beta"}], "system": "you copy words."},
              {"texts": [{"user": "spell gamma", "assistant": "g a m m a"}], "images": []}],
}
EXPECTED = [messages("repeat: alpha", "alpha"), messages("repeat\n\nbeta", "beta", "you copy words."),
            messages("spell gamma", "g a m m a")]
# OpenAI turns under other keys, or as their JSON text: the same conversations.
SHAPED |= {
    "conversation": [{"conversation": m, "turn": 1, "model": "vicuna-13b"} for m in EXPECTED],
    "conversations_of_role_and_content": [{"conversations": m} for m in EXPECTED],
    "messages_as_json_text": [{"messages": json.dumps(m)} for m in EXPECTED],
    # Capybara's exchanges ({input, output}: a user turn and its answer each), a system prompt beside them
    "exchanges": [{"conversation": [{"input": m[-2]["content"], "output": m[-1]["content"]}], "source": "x",
                   **({"system": m[0]["content"]} if m[0]["role"] == "system" else {})} for m in EXPECTED],
    # Gemma's / the Gemini API's role name for the assistant
    "model_role": [{"messages": [t | {"role": "model"} if t["role"] == "assistant" else t for t in m]}
                   for m in EXPECTED],
}


@pytest.mark.parametrize("shape", SHAPED)
def test_each_shape_is_the_same_conversation(tmp_path, shape):
    records = load_records(write_jsonl(tmp_path / "d.jsonl", SHAPED[shape]))
    assert [r.messages for r in records] == EXPECTED


@pytest.mark.parametrize("shape", SHAPED)
def test_each_shape_validates_and_tokenizes_with_the_answer_supervised(tmp_path, tokenizer_dir, tokenizer, shape):
    path = write_jsonl(tmp_path / "d.jsonl", SHAPED[shape])
    report = validate_dataset(path, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    assert report.ok, report.summary()
    enc = tk.encode_records(load_records(path), tokenizer, max_length=128, too_long="error", source=str(path))
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == [f"alpha{END}", f"beta{END}", f"g a m m a{END}"]


def test_chat_logs_and_agent_data_as_their_hub_parquet_files_validate_as_conversations(tmp_path, tokenizer_dir):
    """Rows laid out as three hub datasets keep theirs, written to Parquet by `datasets`: LMSYS-Chat-1M
    (`conversation` of role / content turns, moderation beside them), WildChat-1M (the same, each turn with its own
    extra keys) and Orca-AgentInstruct-1M (`messages` as the JSON text of the list, an empty system prompt first).
    Each validates and reads as the conversation it holds; the empty system prompt is kept, not a problem."""
    import datasets

    chat = [{"role": "user", "content": "repeat: alpha"}, {"role": "assistant", "content": "alpha"}]
    lmsys = {"conversation_id": "c1", "model": "vicuna-13b", "conversation": chat, "turn": 1, "language": "English",
             "openai_moderation": [{"flagged": False, "categories": {"hate": False}} for _ in chat], "redacted": False}
    wildchat = {"conversation_hash": "h1", "model": "gpt-4-0314", "turn": 1, "toxic": False, "conversation": [
        {**turn, "country": "France", "language": "English", "redacted": False, "toxic": False, "turn_identifier": 7}
        for turn in chat]}
    orca = {"messages": json.dumps([{"role": "system", "content": ""}, *chat])}
    for name, row in (("lmsys", lmsys), ("wildchat", wildchat), ("orca", orca)):
        path = tmp_path / f"{name}.parquet"
        datasets.Dataset.from_list([row]).to_parquet(str(path))
        report = validate_dataset(path, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
        assert report.ok, report.summary()
        (record,) = load_records(path)
        assert record.messages == ([{"role": "system", "content": ""}] if name == "orca" else []) + chat


def test_prompt_completion_lists_keep_a_multi_turn_prompt(tmp_path):
    record = {"prompt": messages("hi", "hello", "be brief.") + [{"role": "user", "content": "bye"}],
              "completion": [{"role": "assistant", "content": "bye!"}]}
    (parsed,) = load_records(write_jsonl(tmp_path / "d.jsonl", [record]))
    assert [m["role"] for m in parsed.messages] == ["system", "user", "assistant", "user", "assistant"]


def test_a_message_list_prompt_with_a_string_answer_and_the_reverse_are_one_conversation(tmp_path, tokenizer):
    """A message-list prompt answered by a string (NVIDIA's Llama-Nemotron post-training SFT records: `input`, the
    conversation so far; `output`, the answer; `system_prompt`), mapped with data.columns, is the prompt's turns
    then the answer, supervised as the same record given as two message lists; a string prompt with a message-list
    completion is a user turn then the completion's turns."""
    nemotron = {"input": messages("hi", "hello") + [{"role": "user", "content": "repeat: alpha"}],
                "output": "alpha", "system_prompt": "detailed thinking off", "category": "chat", "reasoning": "off",
                "license": "cc-by-4.0", "generator": "Llama-3.3-70B-Instruct", "version": "v1"}
    fields = field_map("prompt=input,completion=output,system=system_prompt")
    (mixed,) = load_records(write_jsonl(tmp_path / "nemotron.jsonl", [nemotron]), fields)
    lists = {"system": "detailed thinking off", "prompt": nemotron["input"],
             "completion": [{"role": "assistant", "content": "alpha"}]}
    (plain,) = load_records(write_jsonl(tmp_path / "lists.jsonl", [lists]))
    assert mixed.messages == plain.messages
    assert [m["role"] for m in mixed.messages] == ["system", "user", "assistant", "user", "assistant"]
    enc = tk.encode_records([mixed], tokenizer, max_length=128, too_long="error")
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == [f"hello{END}", f"alpha{END}"]

    reverse = {"prompt": "repeat: beta", "completion": [{"role": "assistant", "content": "beta"},
                                                        {"role": "user", "content": "again"},
                                                        {"role": "assistant", "content": "beta"}]}
    (record,) = load_records(write_jsonl(tmp_path / "reverse.jsonl", [reverse]))
    assert record.messages == [{"role": "user", "content": "repeat: beta"}, *reverse["completion"]]


@pytest.mark.parametrize(("record", "reason", "field"), [
    ({"instruction": "repeat", "output": ""}, "empty_text", "output"),
    ({"output": "alpha"}, "empty_text", "instruction"),
    ({"instruction": "repeat", "input": 3, "output": "x"}, "text_not_string", "input"),
    ({"prompt": 3, "completion": [{"role": "assistant", "content": "x"}]}, "text_not_string", "prompt"),
    ({"completion": "x"}, "empty_text", "prompt"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "bot", "content": "a"}]},
     "unknown_role", "completion[0].role"),
], ids=["alpaca-no-output", "alpaca-no-instruction", "alpaca-input-number", "prompt-number",
        "no-prompt", "completion-role"])
def test_shape_faults_name_the_datasets_field(tmp_path, record, reason, field):
    parsed = parse_file(write_jsonl(tmp_path / "d.jsonl", [SHAPED["alpaca"][0], record]))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [(1, reason, field)]


# --- the mapping: data.columns / data.roles ---------------------------------------------------------


def test_columns_map_question_answer_to_prompt_completion(tmp_path, tokenizer_dir, tokenizer):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "repeat: alpha", "answer": "alpha"},
                                         {"question": "spell gamma", "answer": ""}]), path)
    fields = field_map("prompt=question,completion=answer")
    parsed = parse_file(path, fields)
    assert [r.messages for r in parsed.records] == [messages("repeat: alpha", "alpha")]
    (problem,) = parsed.problems  # named by the dataset's own key
    assert (problem.reason, problem.field, problem.kind) == ("empty_text", "answer", "parquet")
    (problem,) = parse_file(path).problems  # unmapped: the one line for the file
    assert problem.reason == "unknown_shape"


def test_columns_and_roles_map_a_turn_list(tmp_path, tokenizer_dir):
    raw = {"dialog": [{"speaker": "Customer", "text": "repeat: alpha"}, {"speaker": "agent", "text": "alpha"}],
           "messages": "a stale column the mapping shadows"}
    path = write_jsonl(tmp_path / "d.jsonl", [raw])
    fields = FieldMap({"messages": "dialog", "role": "speaker", "content": "text"}, {"customer": "user",
                                                                                    "agent": "assistant"})
    (record,) = load_records(path, fields)
    assert record.messages == messages("repeat: alpha", "alpha")
    problems = parse_file(path, FieldMap(fields.columns)).problems  # no role mapping: named by their own keys
    assert [(p.reason, p.field) for p in problems] == [("unknown_role", "dialog[0].speaker"),
                                                       ("unknown_role", "dialog[1].speaker")]


def test_validate_cli_takes_the_mapping_and_reports_it(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "repeat: alpha", "a": "alpha"}])
    out = tmp_path / "v.json"
    assert validate_main(["--train", str(path), "--tokenizer", str(tokenizer_dir), "--max-length", "128",
                          "--too-long", "error", "--duplicates", "error", "--reasoning", "auto", "--columns", "prompt=q,completion=a", "--out-json", str(out),
                          "--out-csv", str(tmp_path / "v.csv")]) == 0
    assert json.loads(out.read_text())["settings"]["columns"] == {"prompt": "q", "completion": "a"}


@pytest.mark.parametrize(("columns", "roles", "message"), [
    ("question=prompt", None, "'question' is not one of ours"),
    ("prompt=q,completion=q", None, "the dataset key 'q' is given for several of ours"),
    (None, "bot=robot", "'bot' maps to 'robot'"),
    ("prompt", None, "'prompt' is not key=value"),
])
def test_a_bad_mapping_is_a_user_error_naming_the_setting(columns, roles, message):
    with pytest.raises(UserError, match=message):
        field_map(columns, roles)


# --- a file of no known shape ---------------------------------------------------------------------


def test_a_file_of_no_known_shape_is_one_line_naming_its_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "question": "q", "answer": "a"} for i in range(200)])
    parsed = parse_file(path)
    (problem,) = parsed.problems
    assert problem.reason == "unknown_shape" and problem.index is None and parsed.records_seen == 200
    assert "the keys are 'id', 'question', 'answer'" in problem.message
    for shape in ("messages", "conversations", "prompt + completion", "Alpaca"):
        assert shape in problem.message


def test_one_unshaped_record_among_shaped_ones_is_its_own_problem(tmp_path):
    records = [SHAPED["alpaca"][0], {"question": "q"}, SHAPED["alpaca"][1]]
    (problem,) = parse_file(write_jsonl(tmp_path / "d.jsonl", records)).problems
    assert (problem.index, problem.reason) == (1, "missing_turns")
    assert "its keys: 'question'" in problem.message


@pytest.mark.parametrize("role", ["ipython", "function", "Tool"])
def test_llama_and_openai_names_of_a_tool_result_are_tool_turns(tmp_path, role):
    call = {"type": "function", "function": {"name": "clock", "arguments": {}}}
    record = {"messages": [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "",
                                                                  "tool_calls": [call]},
                           {"role": role, "content": "12:00"}, {"role": "assistant", "content": "noon"}]}
    (parsed,) = load_records(write_jsonl(tmp_path / "d.jsonl", [record]))
    assert [m["role"] for m in parsed.messages] == ["user", "assistant", "tool", "assistant"]


def test_openai_s_developer_message_is_the_system_prompt(tmp_path):
    record = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}]}
    system = {"messages": [{**record["messages"][0], "role": "system"}, *record["messages"][1:]]}
    read = [load_records(write_jsonl(tmp_path / f"{i}.jsonl", [r]))[0].messages for i, r in enumerate((record, system))]
    assert read[0] == read[1] and read[0][0] == {"role": "system", "content": "Be brief."}


# OpenAI's fine-tuning guide, "Multi-turn chat examples" (platform.openai.com/docs/guides/fine-tuning): its
# first example record, as the guide prints it. `"weight": 0` skips training on that assistant message.
OPENAI_WEIGHTED = ('{"messages": [{"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."}, '
                   '{"role": "user", "content": "What\'s the capital of France?"}, {"role": "assistant", "content": '
                   '"Paris", "weight": 0}, {"role": "user", "content": "Can you be more sarcastic?"}, {"role": '
                   '"assistant", "content": "Paris, as if everyone doesn\'t know that already.", "weight": 1}]}\n')


def test_an_assistant_turn_of_weight_0_is_context_and_a_bad_weight_is_named(tmp_path, tokenizer):
    """OpenAI's (and mistral-finetune's, Axolotl's) per-turn `weight`: a turn of weight 0 is rendered and not
    trained, in messages and in ShareGPT turns alike; a record with no trained turn left is dropped and counted;
    a weight other than 0 / 1, or 1 on a turn that is not the assistant's, is a problem naming its field."""
    (tmp_path / "openai.jsonl").write_text(OPENAI_WEIGHTED)
    (openai,) = load_records(tmp_path / "openai.jsonl")
    assert [m.get("weight") for m in openai.messages] == [None, None, 0, None, None]
    enc = tk.encode_records([openai], tokenizer, max_length=512, too_long="error")
    answer = tokenizer.encode(openai.messages[-1]["content"], add_special_tokens=False)  # the demo's: no capitals
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == [tokenizer.decode(answer) + END]
    unweighted = json.loads(OPENAI_WEIGHTED)
    for m in unweighted["messages"]:
        m.pop("weight", None)
    (plain,) = load_records(write_jsonl(tmp_path / "plain.jsonl", [unweighted]))
    assert tk.encode_records([plain], tokenizer, max_length=512, too_long="error").input_ids.tolist() == \
        enc.input_ids.tolist()  # the same text: only the labels differ

    sharegpt = {"conversations": [{"from": "human", "value": "repeat: alpha"}, {"from": "gpt", "value": "alpah",
                                                                                "weight": 0},
                                  {"from": "human", "value": "wrong, again"}, {"from": "gpt", "value": "alpha"}]}
    untrained = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi", "weight": 0}]}
    path = write_jsonl(tmp_path / "mixed.jsonl", [sharegpt, untrained, SHAPED["alpaca"][0]])
    enc = tk.encode_records(load_records(path), tokenizer, max_length=512, too_long="error")
    assert supervised_runs(tokenizer, enc.input_ids[:enc.offsets[1]], enc.labels[:enc.offsets[1]]) == [f"alpha{END}"]
    stats = tk.tokenize_file(path, tokenizer, out_path=tmp_path / "c.safetensors", max_length=512, too_long="error",
                             fingerprint="f", split="train")
    assert (stats["records"], stats["dropped_unsupervised"]) == (2, 1)
    assert (stats["assistant_turns"], stats["untrained_turns"]) == (3, 1)  # the kept records' turns

    # Two records that differ only in which turn is trained are not copies: duplicates=drop keeps both.
    flipped = json.loads(OPENAI_WEIGHTED)
    flipped["messages"][2].pop("weight"), flipped["messages"][4].update(weight=0)
    path = write_jsonl(tmp_path / "both.jsonl", [json.loads(OPENAI_WEIGHTED), flipped, json.loads(OPENAI_WEIGHTED)])
    assert duplicate_of(load_records(path)) == {2: 0}
    stats = tk.tokenize_file(path, tokenizer, out_path=tmp_path / "d.safetensors", max_length=512, too_long="error",
                             duplicates="drop", fingerprint="f", split="train")
    assert (stats["records"], stats["duplicates_dropped"], stats["untrained_turns"]) == (2, 1, 2)

    # SlimOrca's turns (Open-Orca/SlimOrca) carry a weight each: null on the system prompt, 0.0 / 1.0 elsewhere.
    slim = {"conversations": [{"from": "system", "value": "you copy words.", "weight": None},
                              {"from": "human", "value": "repeat: beta", "weight": 0.0},
                              {"from": "gpt", "value": "beta", "weight": 1.0}]}
    parsed = parse_file(write_jsonl(tmp_path / "slim.jsonl", [slim]))
    assert not parsed.problems and [m.get("weight") for m in parsed.records[0].messages] == [None, None, None]

    bad = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": w}]}
           for w in (2, "0", True, 0.5)]
    bad.append({"messages": [{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a"}]})
    bad.append({"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]})
    parsed = parse_file(write_jsonl(tmp_path / "bad.jsonl", bad))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == \
        [(i, "bad_weight", "messages[1].weight") for i in range(4)] + [(4, "bad_weight", "messages[0].weight")]
    assert "weight must be 0 (not trained) or 1 (trained), found '0'" in parsed.problems[1].message
    assert "weight 1 on a user turn: only assistant turns are trained" in parsed.problems[4].message


def test_llama_factory_alpaca_history_is_the_earlier_turns_and_trained(tmp_path, tokenizer):
    """LLaMA-Factory's Alpaca format (its data/README.md): `history`, the earlier [instruction, response] pairs,
    comes before the instruction, and its responses are trained as the output is; from a JSON array, a Parquet
    file written by pyarrow (a list<list<string>> column) and a CSV cell of its JSON text alike."""
    record = {"instruction": "and now?", "input": "", "output": "still red", "system": "be brief",
              "history": [["what colour?", "red"], ["sure?", "yes"]]}
    same = {"messages": [{"role": "system", "content": "be brief"}, *messages("what colour?", "red"),
                         *messages("sure?", "yes"), *messages("and now?", "still red")]}
    (tmp_path / "a.json").write_text(json.dumps([record]))
    pq.write_table(pa.Table.from_pylist([record]), tmp_path / "a.parquet")
    (tmp_path / "a.csv").write_text("instruction,output,system,history\n" + ",".join(
        '"' + str(v).replace('"', '""') + '"' for v in ("and now?", "still red", "be brief",
                                                          json.dumps(record["history"]))) + "\n")
    (expected,) = load_records(write_jsonl(tmp_path / "m.jsonl", [same]))
    for name in ("a.json", "a.parquet", "a.csv"):
        (read,) = load_records(tmp_path / name)
        assert read.messages == expected.messages, name
    enc = tk.encode_records([expected], tokenizer, max_length=512, too_long="error")
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == [f"red{END}", f"yes{END}", f"still red{END}"]

    bad = [{**record, "history": "sure?"}, {**record, "history": [["sure?"], ["ok?", 3]]}]
    parsed = parse_file(write_jsonl(tmp_path / "bad.jsonl", bad))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [
        (0, "bad_history", "history"), (1, "bad_history", "history[0]"), (1, "text_not_string", "history[1][1]")]


def test_video_and_audio_records_are_named_not_trained_as_text(tmp_path, tokenizer_dir):
    """LLaMA-Factory's video and audio demos (tests/data/external/README.md), as they ship and as Parquet written
    by pyarrow: each record is a problem naming its `videos` / `audios` field. Trained as it is, the model would
    learn `<video>` as text and never see the video. A `video` field that names no media file (an id in a text
    dataset) is only a column."""
    for name, fields in (("mllm_video_demo", ["videos"]), ("mllm_audio_demo", ["audios"]),
                         ("mllm_video_audio_demo", ["videos", "audios"])):
        records = json.loads((EXTERNAL / f"{name}.json").read_text())
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{name}.parquet")
        for path in (EXTERNAL / f"{name}.json", tmp_path / f"{name}.parquet"):
            parsed = parse_file(path)
            assert [(p.index, p.reason, p.field) for p in parsed.problems] == [
                (i, "unsupported_media", f) for i in range(len(records)) for f in fields], path
    report = validate_dataset(EXTERNAL / "mllm_video_demo.json", tokenizer_dir=tokenizer_dir, max_length=128,
                              too_long="error")
    assert not report.ok
    assert "'videos' holds video, which this pipeline does not train on" in report.summary()

    lmms = {"video": ["bm_teaser.mp4", "bm_show.mp4"], "conversations": [
        {"from": "human", "value": "<video><video>What are these videos about?"}, {"from": "gpt", "value": "Kpop."}]}
    omni = {**lmms, "video": "clip.MOV"}
    text = {"messages": messages("Summarise the talk.", "It is about sleep."), "video": "yt:x9Fa2", "audio": ""}
    parsed = parse_file(write_jsonl(tmp_path / "mixed.jsonl", [lmms, omni, text]))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [(0, "unsupported_media", "video"),
                                                                       (1, "unsupported_media", "video")]


def test_audio_and_video_columns_written_by_datasets_are_named(tmp_path, monkeypatch):
    """A speech or video dataset saved by `datasets` stores its `Audio` / `Video` column as a struct of bytes and
    path (the schema's "huggingface" metadata says which): each such record is a problem naming its column, whether
    it holds the bytes or points at a file. Decoded, `Audio` is an array with its sampling rate: named too."""
    import io
    import wave

    import datasets

    sound = io.BytesIO()
    with wave.open(sound, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\0\0" * 80)
    monkeypatch.chdir(tmp_path)  # the clips the rows point at, where `datasets` looks for them
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips/b.wav").write_bytes(sound.getvalue())
    (tmp_path / "clips/dog.mp4").write_bytes(b"\0\0\0\x18ftypmp42")
    talk = [messages("<audio>What is said?", "Nothing."), messages("<audio>Who speaks?", "No one.")]
    speech = datasets.Dataset.from_dict({"messages": talk, "audio": [{"bytes": sound.getvalue(), "path": None},
                                                                     {"bytes": None, "path": "clips/b.wav"}]})
    speech = speech.cast_column("audio", datasets.Audio(decode=False))
    speech.to_parquet(str(tmp_path / "speech.parquet"))
    clips = datasets.Dataset.from_dict({"messages": [messages("<video>What happens?", "A dog runs.")],
                                        "video": [{"bytes": None, "path": "clips/dog.mp4"}]})
    clips.cast_column("video", datasets.Video(decode=False)).to_parquet(str(tmp_path / "clips.parquet"))
    schema = pq.read_schema(tmp_path / "speech.parquet")
    assert '"_type": "Audio"' in schema.metadata[b"huggingface"].decode()  # the artefact is what datasets writes
    assert pa.types.is_struct(schema.field("audio").type)

    for name, field, count in (("speech", "audio", 2), ("clips", "video", 1)):
        parsed = parse_file(tmp_path / f"{name}.parquet")
        assert [(p.index, p.reason, p.field) for p in parsed.problems] == [
            (i, "unsupported_media", field) for i in range(count)], name
        assert parsed.records == []
    decoded = {"messages": talk[0], "audio": {"array": [0.0, 0.1, 0.0], "sampling_rate": 8000, "path": None}}
    parsed = parse_file(write_jsonl(tmp_path / "decoded.jsonl", [decoded]))
    assert [(p.reason, p.field) for p in parsed.problems] == [("unsupported_media", "audio")]


def test_preference_data_is_named_not_trained_as_sft(tmp_path):
    """LLaMA-Factory's DPO and KTO demos and its v1 DPO demo (tests/data/external/README.md), as they ship. A DPO
    record's turns are only the prompt: trained as it is, a multi-turn one would learn its history and never the
    chosen answer, so each is a `preference_record` problem naming `chosen`. A KTO record labelled false would teach
    the answer it rejects: named by its `label`; those labelled true train. A file of chosen_messages /
    rejected_messages (and TRL's prompt / chosen / rejected) has no shape, and its one line says it is preference
    data."""
    parsed = parse_file(EXTERNAL / "dpo_en_demo_first6.json")
    assert [(p.index, p.field) for p in parsed.problems if p.reason == "preference_record"] == [(i, "chosen")
                                                                                                for i in range(6)]
    assert parsed.records == []  # the fifth's history (human, gpt, human, gpt, human) used to train
    labels = [r["label"] for r in json.loads((EXTERNAL / "kto_en_demo_first8.json").read_text())]
    parsed = parse_file(EXTERNAL / "kto_en_demo_first8.json")
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [
        (i, "preference_record", "label") for i, label in enumerate(labels) if label is False]
    assert "label false marks this answer undesirable" in parsed.problems[0].message
    assert [r.index for r in parsed.records] == [i for i, label in enumerate(labels) if label is True]

    trl = {"prompt": [{"role": "user", "content": "2 + 2?"}], "chosen": [{"role": "assistant", "content": "4"}],
           "rejected": [{"role": "assistant", "content": "5"}]}
    for path in (EXTERNAL / "v1_dpo_demo_first3.jsonl", write_jsonl(tmp_path / "trl.jsonl", [trl])):
        (problem,) = parse_file(path).problems
        assert problem.reason == "unknown_shape" and "this is preference data (chosen / rejected" in problem.message
