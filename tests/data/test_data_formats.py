"""Reading and normalizing records: both shapes, both layouts, locators, helpers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.data.formats import drop_duplicates, duplicate_of, load_records, parse_file, prompt_and_reference
from pipeline.errors import DataError

GOOD = Path(__file__).resolve().parent / "good"
MALFORMED = Path(__file__).resolve().parent / "malformed"

CONVERSATION = [
    ("system", "you copy words."),
    ("user", "repeat: alpha"),
    ("assistant", "alpha"),
    ("user", "again"),
    ("assistant", "alpha!"),
]


def sharegpt(i: int, turns=CONVERSATION, **extra) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"id": f"r{i}", "conversations": [{"from": names[r], "value": t} for r, t in turns], **extra}


def openai(i: int, turns=CONVERSATION, **extra) -> dict:
    return {"id": f"r{i}", "messages": [{"role": r, "content": t} for r, t in turns], **extra}


def pictured(i: int, *images: str, shape=None) -> dict:
    """A record with one image placeholder per image, in its first user turn."""
    turns = [("user", "<image>" * len(images) + "\nwhat is it?"), ("assistant", "a shape")]
    return (shape or sharegpt)(i, turns, image=list(images) if len(images) != 1 else images[0])


def write(path: Path, records: list, layout: str | None = None) -> Path:
    layout = layout or ("jsonl" if path.suffix == ".jsonl" else "json")
    if layout == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records, indent=2))
    return path


@pytest.mark.parametrize("shape", [sharegpt, openai])
@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_both_shapes_and_layouts_normalize_alike(tmp_path, shape, suffix):
    (record,) = load_records(write(tmp_path / f"d{suffix}", [shape(7)]))
    assert record.id == "r7"
    assert record.index == 0
    assert record.line == (1 if suffix == ".jsonl" else None)
    assert [(m["role"], m["content"]) for m in record.messages] == CONVERSATION


def test_role_aliases_and_system_field(tmp_path):
    raw = {"id": 3, "system": "be brief.", "conversations": [
        {"from": "Human", "value": "hi"}, {"from": "ASSISTANT", "value": "hello"},
        {"from": "user", "value": "bye"}, {"from": "gpt", "value": "bye!"},
    ]}
    (record,) = load_records(write(tmp_path / "d.jsonl", [raw]))
    assert record.id == "3"  # numeric ids become strings
    assert [m["role"] for m in record.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert record.messages[0]["content"] == "be brief."


def test_images_resolve_against_the_dataset_file(tmp_path):
    sub = tmp_path / "sets"
    sub.mkdir()
    records = [pictured(0, "img/a.png"), pictured(1, "b.png", "/abs/c.png"), sharegpt(2)]
    parsed = load_records(write(sub / "d.jsonl", records))
    assert parsed[0].images == [str(sub / "img" / "a.png")]
    assert parsed[1].images == [str(sub / "b.png"), os.path.normpath("/abs/c.png")]
    assert parsed[2].images == []


def test_jsonl_line_numbers_skip_blank_lines_and_bom(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(sharegpt(0)), "", "   ", json.dumps(sharegpt(1)), ""]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    records = load_records(path)
    assert [(r.index, r.line, r.id) for r in records] == [(0, 1, "r0"), (1, 4, "r1")]


def test_every_bad_record_is_reported_not_just_the_first(tmp_path):
    bad_role = sharegpt(1)
    bad_role["conversations"][1]["from"] = "bot"
    bad_role["conversations"][2]["value"] = ""  # a second fault in the same record
    records = [sharegpt(0), bad_role, "oops", sharegpt(3), {"id": "r4"}]
    parsed = parse_file(write(tmp_path / "d.jsonl", records))
    found = [(p.index, p.line, p.reason, p.field) for p in parsed.problems]
    assert found == [
        (1, 2, "unknown_role", "conversations[1].from"),
        (1, 2, "empty_text", "conversations[2].value"),
        (2, 3, "not_object", None),
        (4, 5, "missing_turns", None),  # no shape, so no field to name: the message lists its keys
    ]
    assert [r.id for r in parsed.records] == ["r0", "r3"]
    assert parsed.records_seen == 5


def test_bad_jsonl_lines_do_not_hide_the_good_ones(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(sharegpt(0)).encode() + b"\n{broken\n" + b'{"id": "\xff"}\n'
                     + json.dumps(sharegpt(3)).encode() + b"\n")
    parsed = parse_file(path)
    assert [(p.index, p.line, p.reason) for p in parsed.problems] == [(1, 2, "invalid_json"), (2, 3, "invalid_utf8")]
    assert "line 3 column 9" in parsed.problems[1].message  # 1-based, in characters
    assert [r.index for r in parsed.records] == [0, 3]


# json's own reasons, completed with where: never "starting at at line".
DECODE_MESSAGES = [
    ("unterminated_string.jsonl", "Unterminated string starting at line 2 column 103"),
    ("truncated_array.json", "Unterminated string starting at line 33 column 18"),
    ("bad_json_array.json", "Expecting ',' delimiter at line 24 column 9"),
    ("bad_json_line.jsonl", "Expecting ',' delimiter at line 2 column 72"),
]


@pytest.mark.parametrize(("name", "message"), DECODE_MESSAGES, ids=[n for n, _ in DECODE_MESSAGES])
def test_json_decode_errors_read_naturally(name, message):
    (problem,) = parse_file(MALFORMED / name).problems
    assert (problem.reason, problem.message) == ("invalid_json", message)


def test_control_character_in_a_string_reads_naturally(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"id": "a\tb"}]')  # a raw tab inside a string
    (problem,) = parse_file(path).problems
    assert problem.message == "Invalid control character at line 1 column 11"


def test_json_lines_named_json_is_read_as_json_lines_as_datasets_reads_it(tmp_path):
    """Many dataset repos name JSON Lines .json (and .json.gz); `datasets`' json loader reads them as JSON Lines,
    and so do we: the records and lines of the same bytes named .jsonl, and `datasets` finds the same records. A
    .json whose first line is an object and whose next is not stays JSON (one problem: the extra data)."""
    import gzip

    import datasets

    source = GOOD / "jsonl_named_json.json"
    as_jsonl = tmp_path / "same.jsonl"
    as_jsonl.write_bytes(source.read_bytes())
    zipped = tmp_path / "same.json.gz"
    zipped.write_bytes(gzip.compress(source.read_bytes()))
    want = parse_file(as_jsonl)
    assert want.records and not want.problems
    for path, kind in ((source, "jsonl"), (zipped, "jsonl.gz")):
        got = parse_file(path)
        assert (got.layout, got.problems) == (kind, [])
        assert [(r.id, r.line, r.messages) for r in got.records] == [(r.id, r.line, r.messages) for r in want.records]
    loaded = datasets.load_dataset("json", data_files=str(source), split="train")
    assert [row["id"] for row in loaded] == [r.id for r in want.records]
    mixed = tmp_path / "mixed.json"
    mixed.write_text('{"id": "a"}\n[1]\n')
    (problem,) = parse_file(mixed).problems
    assert problem.message.startswith("extra data after the JSON object at line 2 column 1")


def test_array_followed_by_more_is_extra_data_not_json_lines():
    (problem,) = parse_file(MALFORMED / "array_trailing_garbage.json").problems
    assert (problem.line, problem.message) == (
        29, "extra data after the JSON array at line 29 column 1: the file must hold exactly one JSON array of records")


@pytest.mark.parametrize(("content", "message"), [
    ('[{"id": "a"}] ]', "extra data after the JSON array at line 1 column 15"),
    ('{"id": "a"}\n\n[1]\n', "extra data after the JSON object at line 3 column 1"),  # 2nd line not an object
    ('{\n  "id": "a"\n}\n{\n  "id": "b"\n}\n', "extra data after the JSON object at line 4 column 1"),  # not 1 per line
])
def test_only_one_object_per_line_gets_the_jsonl_hint(tmp_path, content, message):
    path = tmp_path / "d.json"
    path.write_text(content)
    (problem,) = parse_file(path).problems
    assert problem.message.startswith(message + ": ")
    assert ".jsonl" not in problem.message


def test_duplicates_are_exact_copies_of_messages_and_images(tmp_path):
    records = load_records(write(tmp_path / "d.jsonl", [
        sharegpt(0), pictured(1, "a.png"), sharegpt(2), pictured(3, "a.png"), pictured(4, "b.png"),
        sharegpt(5),
    ]))
    # ids do not matter; images do
    assert duplicate_of(records) == {2: 0, 3: 1, 5: 0}
    assert [r.id for r in drop_duplicates(records)] == ["r0", "r1", "r4"]


def test_unknown_suffix_is_sniffed(tmp_path):
    assert parse_file(write(tmp_path / "d.txt", [sharegpt(0)], layout="json")).layout == "json"
    assert parse_file(write(tmp_path / "e.txt", [sharegpt(0)], layout="jsonl")).layout == "jsonl"


def test_system_field_and_system_turn_together_is_a_problem(tmp_path):
    parsed = parse_file(write(tmp_path / "d.jsonl", [sharegpt(0, system="extra")]))
    assert [p.reason for p in parsed.problems] == ["bad_system"]


def test_load_records_raises_naming_record_and_reason(tmp_path):
    path = write(tmp_path / "d.jsonl", [sharegpt(0), openai(1, turns=[("user", "hi")])])
    with pytest.raises(DataError) as err:
        load_records(path)
    assert f"{path} (JSON Lines) record 1 (line 2, id 'r1') messages: no_assistant_turn" in str(err.value)


def test_missing_file_is_a_problem_not_a_crash(tmp_path):
    (problem,) = parse_file(tmp_path / "absent.jsonl").problems
    assert problem.reason == "file_not_found"


def test_prompt_and_reference_uses_the_last_assistant_turn(tmp_path):
    (record,) = load_records(write(tmp_path / "d.jsonl", [sharegpt(0)]))
    prompt, reference = prompt_and_reference(record)
    assert reference == "alpha!"
    assert [(m["role"], m["content"]) for m in prompt] == CONVERSATION[:-1]
    prompt.append({"role": "user", "content": "x"})  # a copy: the record is untouched
    assert len(record.messages) == len(CONVERSATION)


# The record-level faults of the corpus, re-checked in the middle of a clean
# file: the problem must point at record 1 / line 2 and at nothing else.
RECORD_FAULTS = [
    ("record_not_object.jsonl", "not_object"),
    ("record_not_object.json", "not_object"),
    ("missing_conversations.jsonl", "missing_turns"),
    ("both_formats.jsonl", "ambiguous_format"),
    ("conversations_not_list.jsonl", "turns_not_list"),
    ("empty_conversations.jsonl", "empty_turns"),
    ("turn_not_object.jsonl", "turn_not_object"),
    ("unknown_role.jsonl", "unknown_role"),
    ("missing_role.json", "unknown_role"),
    ("consecutive_users.jsonl", "bad_role_order"),
    ("system_in_middle.json", "bad_role_order"),
    ("starts_with_assistant.jsonl", "bad_role_order"),
    ("empty_text.jsonl", "empty_text"),
    ("blank_text.json", "empty_text"),
    ("text_not_string.json", "text_not_string"),
    ("no_assistant.jsonl", "no_assistant_turn"),
    ("bad_system.jsonl", "bad_system"),
    ("bad_id.jsonl", "bad_id"),
    ("bad_image_field.jsonl", "bad_image_field"),
]


@pytest.mark.parametrize(("name", "reason"), RECORD_FAULTS, ids=[n for n, _ in RECORD_FAULTS])
def test_record_fault_is_located_among_clean_records(tmp_path, name, reason):
    source = MALFORMED / name
    text = source.read_text()
    (bad,) = json.loads(text) if source.suffix == ".json" else [json.loads(text.splitlines()[0])]  # its bad line
    parsed = parse_file(write(tmp_path / "d.jsonl", [sharegpt(0), bad, sharegpt(2)]))
    assert [(p.index, p.line, p.reason) for p in parsed.problems] == [(1, 2, reason)]
    assert [r.index for r in parsed.records] == [0, 2]


# --- images: placeholders and OpenAI content parts ----------------------------------------------------


def test_openai_content_parts_become_one_placeholder_per_image(tmp_path):
    raw = {"id": "o", "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "compare "}, {"type": "image", "image": "a.png"},
            {"type": "text", "text": " with "}, {"type": "image_url", "image_url": {"url": "file://b.png"}},
            {"type": "image", "path": "/abs/c.png"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "the same"}]},
    ]}
    (record,) = load_records(write(tmp_path / "d.jsonl", [raw]))
    assert record.messages == [{"role": "user", "content": "compare <image> with <image><image>"},
                               {"role": "assistant", "content": "the same"}]
    assert record.images == [str(tmp_path / "a.png"), str(tmp_path / "b.png"), "/abs/c.png"]
    # the same conversation in LLaVA's spelling is the same record
    llava = sharegpt(0, [("user", "compare <image> with <image><image>"), ("assistant", "the same")],
                     image=["a.png", "b.png", "/abs/c.png"])
    (same,) = load_records(write(tmp_path / "l.jsonl", [llava]))
    assert (same.messages, same.images) == (record.messages, record.images)


@pytest.mark.parametrize(("record", "reason", "field"), [
    (pictured(0, "a.png") | {"image": ["a.png", "b.png"]}, "image_placeholder_mismatch", "image"),
    (sharegpt(0, [("user", "<image> and <image>"), ("assistant", "two")], image="a.png"),
     "image_placeholder_mismatch", "image"),
    (sharegpt(0, [("user", "what is <image>?"), ("assistant", "a tag")]), "image_placeholder_mismatch",
     "conversations"),
    (sharegpt(0, [("user", "draw it"), ("assistant", "<image>")], image="a.png"), "image_outside_user_turn",
     "conversations[1].value"),
    (sharegpt(0, [("user", "what?"), ("assistant", "a")], image="a.png", system="<image> rules"),
     "image_outside_user_turn", "system"),
    (openai(0, [("user", [{"type": "image", "url": "https://x/a.png"}]), ("assistant", "a")]), "bad_image_field",
     "messages[0].content[0]"),
    (openai(0, [("user", [{"type": "image"}]), ("assistant", "a")]), "image_placeholder_mismatch", "messages"),
    (openai(0, [("user", [{"type": "file", "file": {"file_id": "f-1"}}]), ("assistant", "a")]), "bad_content_part",
     "messages[0].content[0]"),
    (openai(0, [("user", [{"type": "video", "video": "v.mp4"}]), ("assistant", "a")]), "unsupported_media",
     "messages[0].content[0]"),
    (openai(0, [("user", [{"type": "image", "image": "a.png"}]), ("assistant", "a")], image="b.png"),
     "bad_image_field", "image"),
], ids=["more-images", "more-placeholders", "placeholder-without-image", "in-assistant-turn", "in-system",
        "remote", "bare-part-no-image", "unknown-part", "video-part", "parts-and-field"])
def test_image_faults_are_one_problem_each(tmp_path, record, reason, field):
    parsed = parse_file(write(tmp_path / "d.jsonl", [sharegpt(9), record]))
    assert [(p.index, p.reason, p.field) for p in parsed.problems] == [(1, reason, field)]
    assert [r.id for r in parsed.records] == ["r9"]


def test_images_embedded_by_datasets_are_read_from_a_store_named_by_their_bytes(tmp_path, monkeypatch):
    """A Parquet file that `datasets` writes from an Image column of pictures holds each image as its bytes
    ({'bytes', 'path'}: the form of the hub's vision-language datasets). Each is written once to
    HF_HOME/sft-pipeline/images/, named by its sha256, and the record names that file: the same picture in
    two records is one file, and it decodes to the picture. An Image column of files (bytes None) is read as
    those files, and both forms can share a file."""
    import datasets
    from PIL import Image

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    blue, red = Image.new("RGB", (32, 32), (0, 0, 255)), Image.new("RGB", (24, 16), (255, 0, 0))
    blue.save(tmp_path / "blue.png")
    turns = [{"role": "user", "content": "<image>What color?"}, {"role": "assistant", "content": "a color"}]
    features = datasets.Features({"images": datasets.Sequence(datasets.Image()),
                                  "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}]})
    rows = {"images": [[red], [blue], [str(tmp_path / "blue.png")], [red]], "messages": [turns] * 4}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp_path / "mixed.parquet"))
    first, second, third, fourth = load_records(tmp_path / "mixed.parquet")
    store = tmp_path / "hf" / "sft-pipeline" / "images"
    assert third.images == [str(tmp_path / "blue.png")]
    for record, picture in ((first, red), (second, blue)):
        (path,) = record.images
        assert Path(path).parent.parent == store and Path(path).suffix == ".png"
        with Image.open(path) as image:
            assert image.size == picture.size and image.convert("RGB").tobytes() == picture.tobytes()
    assert fourth.images == first.images and len(list(store.glob("*/*"))) == 2  # one file per picture
    assert load_records(tmp_path / "mixed.parquet")[0].images == first.images  # a second reading: the same file


def test_embedded_image_forms_and_their_problems(tmp_path, monkeypatch):
    """Raw bytes in an image column, a base64 data: URL in an image_url part and a `datasets` Image value in an
    image part are written to the store; what is none of these, and a store that cannot be written, are one
    problem each, naming the field and, for the store, where it is and what chooses it."""
    import base64
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 128, 0)).save(buffer, format="JPEG")
    jpeg = buffer.getvalue()
    turns = [{"role": "user", "content": "<image>What color?"}, {"role": "assistant", "content": "green"}]
    pq.write_table(pa.table({"image": pa.array([jpeg, None], type=pa.binary()), "messages": [turns, turns]}),
                   tmp_path / "raw.parquet")
    parsed = parse_file(tmp_path / "raw.parquet")
    (record,) = parsed.records
    assert Path(record.images[0]).suffix == ".jpg" and Path(record.images[0]).read_bytes() == jpeg
    assert [p.reason for p in parsed.problems] == ["image_placeholder_mismatch"]  # record 1: no image, a placeholder

    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg,not-base64"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
    ]

    def asked(k: int, part: dict) -> dict:
        return {"id": f"p{k}", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "colour?"}]},
                                            {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]}

    parsed = parse_file(write(tmp_path / "parts.jsonl", [asked(k, part) for k, part in enumerate(parts)]))
    assert [r.images for r in parsed.records] == [record.images]
    assert [(p.index, p.reason) for p in parsed.problems] == [(1, "bad_image_field"), (2, "bad_image_field")]
    assert "not a base64 data: URL" in parsed.problems[0].message
    assert "not a local file" in parsed.problems[1].message
    # An image part holding a `datasets` Image value: Parquet (pyarrow infers the parts' struct, absent keys null).
    pq.write_table(pa.Table.from_pylist([asked(0, {"type": "image", "image": {"bytes": jpeg, "path": None}})]),
                   tmp_path / "parts.parquet")
    assert [r.images for r in load_records(tmp_path / "parts.parquet")] == [record.images]

    (problem,) = parse_file(write(tmp_path / "odd.jsonl", [{"id": "o", "image": [7], "messages": turns}])).problems
    assert (problem.reason, problem.field) == ("bad_image_field", "image") and "item 0 is a JSON number: an image is a path" in problem.message

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the store's directory would go")
    monkeypatch.setenv("HF_HOME", str(blocked))
    problem = parse_file(tmp_path / "raw.parquet").problems[0]
    assert (problem.index, problem.reason, problem.field) == (0, "bad_image_field", "image")
    assert str(blocked / "sft-pipeline" / "images") in problem.message and "HF_HOME" in problem.message


def test_a_top_level_object_says_what_it_holds(tmp_path):
    """A .json file that is one object: the key holding the records (SQuAD-style `{"version", "data": [...]}`,
    which `datasets` reads only with field="data"), or one record, named as such."""
    holder = tmp_path / "holder.json"
    holder.write_text(json.dumps({"version": "1.1", "data": [{"prompt": "q", "completion": "a"}] * 3}))
    (problem,) = parse_file(holder).problems
    assert problem.message == ("expected a JSON array of records, found a JSON object whose 'data' holds a list of 3 "
                               "objects: give those records as the file (a JSON array, or JSON Lines)")
    (problem,) = parse_file(MALFORMED / "top_level_object.json").problems
    assert problem.message == ("expected a JSON array of records, found a JSON object with keys 'id', 'conversations' "
                               "(one record? a JSON file holds an array of them: [{...}, {...}])")


def test_a_json_array_named_jsonl_is_read_as_json_as_datasets_reads_it(tmp_path):
    """`json.dump(records, f)` into a .jsonl (one line, or indented): the array's records, as `datasets` reads it;
    lines that are each an array stay JSON Lines (each line one not_object problem)."""
    import datasets

    records = [sharegpt(0), sharegpt(1)]
    for indent in (None, 2):
        path = tmp_path / f"dumped-{indent}.jsonl"
        path.write_text(json.dumps(records, indent=indent))
        parsed = parse_file(path)
        assert (parsed.layout, parsed.problems, [r.id for r in parsed.records]) == ("json", [], ["r0", "r1"])
        assert [row["id"] for row in datasets.load_dataset("json", data_files=str(path), split="train")] == \
            ["r0", "r1"]
    lines = tmp_path / "arrays.jsonl"
    lines.write_text('["a", 1]\n["b", 2]\n')
    parsed = parse_file(lines)
    assert parsed.layout == "jsonl" and [(p.line, p.reason) for p in parsed.problems] == [(1, "not_object"),
                                                                                          (2, "not_object")]
    glued = tmp_path / "glued.jsonl"  # two files' worth cat together: an array line among record lines
    glued.write_text(json.dumps(records) + "\n" + json.dumps(sharegpt(2)) + "\n")
    (problem,) = parse_file(glued).problems
    assert problem.line == 1 and problem.message == (
        "a record must be a JSON object, found a JSON array (2 records in one array on one line: JSON Lines holds "
        "one record per line; a JSON array is a .json file)")
