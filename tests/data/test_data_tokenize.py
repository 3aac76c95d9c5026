"""Chat-template tokenization, assistant-only labels, the too-long policy and the token cache."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.data import spans, tokenize as tk, tokenize_cli
from pipeline.data.cache import TokenCache
from pipeline.data.formats import Record, load_records
from pipeline.errors import DataError

GOOD = Path(__file__).resolve().parent / "good"
END = "<|end|>"  # the end-of-turn marker the demo template closes every turn with (the newline after it is not trained)

EXCHANGES = [("repeat: alpha", "alpha"), ("now twice", "alpha alpha"), ("and reversed?", "ahpla")]


def record(exchanges=EXCHANGES, system: str | None = "you copy words.", index: int = 0) -> Record:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in exchanges:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return Record(id=f"r{index}", messages=messages, images=[], index=index, line=index + 1)


def supervised_runs(tokenizer, ids: np.ndarray, labels: np.ndarray) -> list[str]:
    """Decode each maximal run of supervised positions."""
    mask = labels != -100
    assert np.array_equal(labels[mask], ids[mask])  # a supervised label is the token itself
    runs, start = [], None
    for i, on in enumerate(list(mask) + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(tokenizer.decode(ids[start:i].tolist()))
            start = None
    return runs


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_multi_turn_labels_are_exactly_the_assistant_turns(tokenizer):
    rec = record()
    enc = tk.encode_records([rec], tokenizer, max_length=512, too_long="error", source="mem")
    assert enc.input_ids.tolist() == template_ids(tokenizer, rec.messages)
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == [a + END for _, a in EXCHANGES]
    assert enc.stats["supervised_tokens"] == sum(len(a) + 1 for _, a in EXCHANGES)  # char-level + <|end|>
    assert enc.stats["turns"] == 7 and enc.stats["assistant_turns"] == 3
    assert enc.stats["eot_trained"] == 1 and enc.stats["reasoning_records"] == 0


def _with_template(tokenizer_dir, template: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # a private copy: the session one stays intact
    tokenizer.chat_template = template
    return tokenizer


PLAIN_TEMPLATE = (  # no special tokens at all; assistant turns end with a blank line
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'a: ' + m['content'] + '\n\n' }}"
    "{% else %}{{ m['role'][0] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}"
)


def test_labels_follow_any_template_not_just_the_demo_one(tokenizer_dir):
    tokenizer = _with_template(tokenizer_dir, PLAIN_TEMPLATE)
    rec = record()
    enc = tk.encode_records([rec], tokenizer, max_length=512, too_long="error")
    # No special token closes a turn here: an earlier turn's content alone is trained, and the stats say so;
    # after the last turn the eos is appended and trained (with the blank line the template writes before it).
    assert enc.input_ids.tolist() == template_ids(tokenizer, rec.messages) + [tokenizer.eos_token_id]
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == (
        [a for _, a in EXCHANGES[:-1]] + [EXCHANGES[-1][1] + "\n\n" + tokenizer.eos_token])
    assert enc.stats["eot_trained"] == 0


def test_generation_prompt_that_differs_from_the_turn_is_fine(tokenizer_dir):
    # The old prefix-render method refused this (as it refused Qwen3, Phi-3 and R1-Distill).
    tokenizer = _with_template(tokenizer_dir, PLAIN_TEMPLATE.replace("{{ 'a: ' }}{% endif %}", "{{ 'a:\n' }}{% endif %}"))
    enc = tk.encode_records([record(index=4)], tokenizer, max_length=512, too_long="error", source="set.jsonl")
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == (
        [a for _, a in EXCHANGES[:-1]] + [EXCHANGES[-1][1] + "\n\n" + tokenizer.eos_token])


def test_template_that_rewrites_the_content_is_a_clear_error(tokenizer_dir):
    rewrites = PLAIN_TEMPLATE.replace("'a: ' + m['content']", "'a: ' + m['content'] | upper")
    tokenizer = _with_template(tokenizer_dir, rewrites)
    with pytest.raises(DataError) as err:
        tk.encode_records([record(index=4)], tokenizer, max_length=512, too_long="error", source="set.jsonl")
    text = str(err.value)
    assert text.startswith("set.jsonl record 4 (line 5, id 'r4'): the chat template renders")
    assert "a: ALPHA" in text and "rendered as given" in text  # both renders, around the first difference
    assert "data.chat_template" in text


def test_template_that_raises_names_the_record(tokenizer_dir):
    refuse_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    strict = refuse_system + PLAIN_TEMPLATE
    tokenizer = _with_template(tokenizer_dir, strict)
    records = [record(system=None, index=0), record(index=1)]
    with pytest.raises(DataError, match=r"record 1 \(line 2, id 'r1'\): the chat template failed: .*no system role"):
        tk.encode_records(records, tokenizer, max_length=512, too_long="error", source="set.jsonl")


def test_prefix_tokenization_fallback_agrees_with_offsets(tokenizer, monkeypatch):
    records = [record(index=i, exchanges=EXCHANGES[: i + 1]) for i in range(3)]
    # Characters outside the vocabulary and outside the BMP: offsets must count characters, not bytes.
    records.append(record(index=3, exchanges=[("répète: ü ✓", "ü ✓ 𝄞"), ("encore", "𝄞 é")]))
    with_offsets = tk.encode_records(records, tokenizer, max_length=512, too_long="error")
    monkeypatch.setattr(spans, "_supports_offsets", lambda tokenizer: False)
    with_prefixes = tk.encode_records(records, tokenizer, max_length=512, too_long="error")
    assert np.array_equal(with_offsets.input_ids, with_prefixes.input_ids)
    assert np.array_equal(with_offsets.labels, with_prefixes.labels)
    assert np.array_equal(with_offsets.offsets, with_prefixes.offsets)
    answers = [a for i in range(3) for _, a in EXCHANGES[: i + 1]] + ["ü ✓ 𝄞", "𝄞 é"]
    # one token per character (unknown ones are <unk>), plus <|end|>
    assert with_offsets.stats["supervised_tokens"] == sum(len(a) + 1 for a in answers)


def _length_mix():
    short = record(exchanges=[("repeat: abc", "abc")], system=None, index=0)  # 23 tokens
    long_answer = record(exchanges=[("repeat: x", "x" * 80)], system=None, index=1)
    long_prompt = record(exchanges=[("y" * 80, "y")], system=None, index=2)  # answer starts past the limit
    return [short, long_answer, long_prompt]


def test_truncate_cuts_and_drops_what_teaches_nothing(tokenizer):
    enc = tk.encode_records(_length_mix(), tokenizer, max_length=60, too_long="truncate")
    s = enc.stats
    assert (s["records_in"], s["records"], s["too_long"], s["truncated"], s["dropped_unsupervised"]) == (3, 2, 2, 1, 1)
    lengths = np.diff(enc.offsets)
    assert lengths.tolist() == [23, 60]
    assert s["tokens"] == 83 == enc.input_ids.size
    assert s["tokens_per_record"]["max"] == 60 and s["max_tokens_before_truncation"] > 60
    assert s["tokens_per_record"]["p50"] == pytest.approx(np.percentile(lengths, 50))
    assert s["supervised_tokens"] == int((enc.labels != -100).sum()) > 0


def test_drop_removes_over_long_records(tokenizer):
    enc = tk.encode_records(_length_mix(), tokenizer, max_length=60, too_long="drop")
    assert (enc.stats["records"], enc.stats["dropped"], enc.stats["truncated"]) == (1, 2, 0)
    assert enc.offsets.tolist() == [0, 23]


def test_error_policy_lists_every_over_long_record(tokenizer):
    with pytest.raises(DataError) as err:
        tk.encode_records(_length_mix(), tokenizer, max_length=60, too_long="error", source="d.jsonl")
    message = str(err.value)
    assert "2 record(s) of d.jsonl exceed max_length=60" in message
    assert "d.jsonl record 1 (line 2, id 'r1')" in message and "d.jsonl record 2 (line 3, id 'r2')" in message


SAME_CONTENT = {
    "sharegpt": {"id": "x", "system": "you copy words.", "conversations": [
        {"from": "human", "value": "repeat: alpha"}, {"from": "gpt", "value": "alpha"},
        {"from": "human", "value": "now twice"}, {"from": "gpt", "value": "alpha alpha"}]},
    "openai": {"id": "x", "messages": [
        {"role": "system", "content": "you copy words."},
        {"role": "user", "content": "repeat: alpha"}, {"role": "assistant", "content": "alpha"},
        {"role": "user", "content": "now twice"}, {"role": "assistant", "content": "alpha alpha"}]},
}


def test_formats_and_layouts_give_identical_tokens(tmp_path, tokenizer_dir):
    caches = {}
    for shape, raw in SAME_CONTENT.items():
        second = {**raw, "id": "y"}
        for suffix in (".json", ".jsonl"):
            src = tmp_path / f"{shape}{suffix}"
            if suffix == ".json":
                src.write_text(json.dumps([raw, second], indent=2))
            else:
                src.write_text(json.dumps(raw) + "\n" + json.dumps(second) + "\n")
            out = tmp_path / f"{shape}{suffix}.safetensors"
            assert tokenize_cli.main(["--train", str(src), "--tokenizer", str(tokenizer_dir), "--max-length", "256",
                            "--too-long", "error", "--duplicates", "error", "--reasoning", "auto", "--out-train", str(out),
                            "--out-stats", str(tmp_path / "stats.json")]) == 0
            caches[src.name] = TokenCache(out)
    reference = caches.pop("sharegpt.jsonl")
    assert len(reference) == 2
    for name, cache in caches.items():
        assert len(cache) == len(reference), name
        for i in range(len(reference)):
            for mine, theirs in zip(cache[i], reference[i]):
                assert torch.equal(mine, theirs), name
    assert not (tmp_path / "val.safetensors").exists()
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert list(stats["splits"]) == ["train"]  # no --val: no val split


def test_tokenize_cli_writes_caches_stats_and_metadata(tmp_path, tokenizer, tokenizer_dir, run_pipeline):
    out = tmp_path / "tok"
    proc = run_pipeline("tokenize", "--train", GOOD / "train.jsonl", "--val", GOOD / "val.json",
                        "--tokenizer", tokenizer_dir, "--max-length", 64, "--too-long", "truncate", "--duplicates", "error", "--reasoning", "auto",
                        "--out-train", out / "train.safetensors", "--out-val", out / "val.safetensors",
                        "--out-stats", out / "stats.json")
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((out / "stats.json").read_text())
    assert stats["tokenizer_fingerprint"] == tk.tokenizer_fingerprint(tokenizer_dir)
    for split, source in (("train", GOOD / "train.jsonl"), ("val", GOOD / "val.json")):
        cache = TokenCache(out / f"{split}.safetensors")
        records = load_records(source)
        s = stats["splits"][split]
        assert cache.metadata["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest() == s["source_sha256"]
        assert cache.metadata["tokenizer_fingerprint"] == stats["tokenizer_fingerprint"]
        assert cache.metadata["max_length"] == "64"
        assert len(cache) == s["records"] == len(records)
        assert cache.num_tokens == s["tokens"] == int(cache.lengths.sum())
        assert s["tokens_per_record"]["max"] == int(cache.lengths.max())
        supervised = 0
        for i, rec in enumerate(records):
            ids, labels = cache[i]
            assert ids.dtype == torch.long and labels.dtype == torch.long
            assert ids.tolist() == template_ids(tokenizer, rec.messages)[:64]
            supervised += int((labels != -100).sum())
        assert supervised == s["supervised_tokens"]
    assert stats["splits"]["train"]["truncated"] == 0
    assert stats["splits"]["train"]["turns"] == 14  # 5 records x 2, two system prompts, one extra exchange


def test_token_cache_access(tmp_path, tokenizer):
    records = [record(index=i, exchanges=EXCHANGES[: i + 1]) for i in range(3)]
    enc = tk.encode_records(records, tokenizer, max_length=512, too_long="error")
    from pipeline.data.cache import write_cache

    path = tmp_path / "c.safetensors"
    write_cache(path, input_ids=enc.input_ids, labels=enc.labels, offsets=enc.offsets, metadata={"max_length": 512})
    cache = TokenCache(path)
    assert len(cache) == 3 and cache.num_tokens == enc.input_ids.size
    assert cache.lengths.tolist() == np.diff(enc.offsets).tolist()
    assert cache.metadata["format"] == "pipeline-token-cache/1" and cache.metadata["max_length"] == "512"
    last_ids, last_labels = cache[-1]
    assert last_ids.tolist() == enc.input_ids[enc.offsets[2]:].tolist()
    assert last_labels.tolist() == enc.labels[enc.offsets[2]:].tolist()
    last_ids[0] = 999  # a copy, not a view of the read-only map
    assert cache[2][0][0].item() != 999
    with pytest.raises(IndexError):
        cache[3]
    assert len(list(cache)) == 3
    clone = pickle.loads(pickle.dumps(cache))  # how a DataLoader worker receives it
    assert len(pickle.dumps(cache)) < 500  # pickled by path, not by content
    assert torch.equal(clone[1][1], cache[1][1])


def test_a_token_cache_read_for_its_first_records_is_those_records_alone(tmp_path, tokenizer):
    """`TokenCache(path, records=N)` (validation.max_records): the first N records, their tokens, lengths
    and images as the whole cache has them; a worker's pickled copy is the same N; N past the end is all."""
    from pipeline.data.cache import write_cache

    records = [record(index=i, exchanges=EXCHANGES[: i % 3 + 1]) for i in range(5)]
    enc = tk.encode_records(records, tokenizer, max_length=512, too_long="error")
    images = [["a.png"], [], ["b.png", "c.png"], ["d.png"], []]
    path = tmp_path / "c.safetensors"
    write_cache(path, input_ids=enc.input_ids, labels=enc.labels, offsets=enc.offsets, metadata={}, images=images)
    whole, first = TokenCache(path), TokenCache(path, records=3)
    assert len(first) == 3 and first.lengths.tolist() == whole.lengths[:3].tolist()
    assert first.num_tokens == int(enc.offsets[3])
    assert first.supervised_counts().tolist() == whole.supervised_counts()[:3].tolist()
    assert first.image_counts.tolist() == [1, 0, 2] and first.images(2) == ["b.png", "c.png"]
    for i in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first[i], whole[i]))
    with pytest.raises(IndexError):
        first[3]
    clone = pickle.loads(pickle.dumps(first))
    assert len(clone) == 3 and torch.equal(clone[-1][0], whole[2][0])
    assert len(TokenCache(path, records=9)) == 5
    assert TokenCache(path, records=2).image_counts.tolist() == [1, 0]


def test_token_cache_rejects_other_files(tmp_path):
    from safetensors.numpy import save_file

    save_file({"input_ids": np.zeros(3, dtype=np.int64)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(DataError, match="not a token cache"):
        TokenCache(tmp_path / "x.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x01")
    with pytest.raises(DataError, match="not a safetensors file"):
        TokenCache(tmp_path / "junk.safetensors")


@pytest.mark.parametrize(("policy", "cached"), [("drop", 2), ("error", 3), ("warn", 3)])
def test_duplicates_drop_caches_each_conversation_once(tmp_path, tokenizer_dir, policy, cached):
    raw = SAME_CONTENT["sharegpt"]
    other = {**raw, "id": "y", "conversations": raw["conversations"][:2]}
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in [raw, other, {**raw, "id": "z"}]))  # z repeats x
    out = tmp_path / "train.safetensors"
    assert tokenize_cli.main(["--train", str(src), "--tokenizer", str(tokenizer_dir), "--max-length", "256",
                    "--too-long", "error", "--duplicates", policy, "--reasoning", "auto", "--out-train", str(out),
                    "--out-stats", str(tmp_path / "stats.json")]) == 0
    stats = json.loads((tmp_path / "stats.json").read_text())
    split = stats["splits"]["train"]
    assert stats["duplicates"] == policy
    assert (split["records_in"], split["records"], split["duplicates_dropped"]) == (3, cached, 3 - cached)
    cache = TokenCache(out)
    assert len(cache) == cached and cache.metadata["duplicates"] == policy
    assert len({tuple(cache[i][0].tolist()) for i in range(len(cache))}) == 2  # x and y, x once under drop


# --- vision-language models ------------------------------------------------------------------------


def _vlm_record(image: str, index: int = 0, turns=(("<image>\nwhat color is it?", "red"), ("and now?", "still red"))):
    messages = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return Record(id=f"v{index}", messages=messages, images=[image], index=index, line=index + 1)


@pytest.mark.parametrize(("family", "per_image"), [("tiny_llava", 16), ("tiny_qwen2_vl", 4)])
def test_vision_language_tokens_expand_each_image_and_never_supervise_it(request, family, per_image, tmp_path):
    data = request.getfixturevalue(family)
    tokenizer, images = tk.load_chat(data["model"])
    image = str(data["data"] / "images" / "train-00000.png")
    rec = _vlm_record(image)
    enc = tk.encode_records([rec], tokenizer, max_length=512, too_long="error", source="mem", images=images)
    is_image = enc.input_ids == images.image_token_id
    assert is_image.sum() == per_image == len(images.expansion(image).split(images.image_token)) - 1
    assert (enc.labels[is_image] == -100).all()
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == ["red" + END, "still red" + END]
    assert enc.images == [[image]] and enc.stats["images"] == 1
    # the cache keeps each record's images with its tokens
    tk.tokenize_file(data["data"] / "val.jsonl", tokenizer, out_path=tmp_path / "val.safetensors", max_length=96,
                     too_long="error", fingerprint="x", split="val", images=images)
    cache = TokenCache(tmp_path / "val.safetensors")
    records = load_records(data["data"] / "val.jsonl")
    assert cache.has_images and [cache.images(i) for i in range(len(cache))] == [r.images for r in records]
    assert all(int((cache[i][0] == images.image_token_id).sum()) == per_image for i in range(len(cache)))


def test_truncation_never_cuts_an_image(tiny_llava):
    tokenizer, images = tk.load_chat(tiny_llava["model"])
    image = str(tiny_llava["data"] / "images" / "train-00000.png")
    early = _vlm_record(image, 0)  # the image comes first: truncation keeps it whole
    late = _vlm_record(image, 1, turns=(("hello", "hi " * 20), ("<image>\nwhat color is it?", "red")))
    enc = tk.encode_records([early, late], tokenizer, max_length=50, too_long="truncate", source="mem", images=images)
    assert enc.stats["records"] == 1 and enc.stats["truncated"] == 1 and enc.stats["dropped_image_cut"] == 1
    assert enc.images == [[image]] and int((enc.input_ids == images.image_token_id).sum()) == 16


def test_text_only_cache_holds_no_image_tensors(tokenizer, tmp_path):
    tk.tokenize_file(GOOD / "train.jsonl", tokenizer, out_path=tmp_path / "t.safetensors", max_length=512,
                     too_long="error", fingerprint="x", split="train")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "t.safetensors"), "np") as f:
        assert sorted(f.keys()) == ["input_ids", "labels", "offsets"]  # as before images existed
    assert not TokenCache(tmp_path / "t.safetensors").has_images


def _tokenized_alike(model: Path, expected: Path, got: Path, out: Path) -> TokenCache:
    """Tokenize two files of the same vision records with `model`'s processor: the same tokens record for record,
    and images of the same bytes (one file may name them, the other embed them). The cache of `got`."""
    tokenizer, images = tk.load_chat(model)
    caches = []
    for k, source in enumerate((expected, got)):
        tk.tokenize_file(source, tokenizer, out_path=out / f"alike{k}.safetensors", max_length=96,
                         too_long="error", fingerprint="x", split="val", images=images)
        caches.append(TokenCache(out / f"alike{k}.safetensors"))
    want, have = caches
    assert len(have) == len(want) > 0
    for i in range(len(want)):
        assert all(torch.equal(a, b) for a, b in zip(have[i], want[i]))
        assert [Path(p).read_bytes() for p in have.images(i)] == [Path(p).read_bytes() for p in want.images(i)]
    return have


def test_images_embedded_in_a_parquet_file_tokenize_as_their_files(tiny_llava, tmp_path, monkeypatch):
    """The demo's validation records as a Parquet file that `datasets` writes, each image embedded as its bytes
    (an Image column): validation checks the images it writes to the store, and the token cache holds the
    same tokens as from the JSON Lines file with image paths, its images the store's files of the same bytes.
    An embedded image that does not decode is its record's problem."""
    import datasets

    from pipeline.data import validate as v

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = tiny_llava["data"]
    rows = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines()]
    for row in rows:
        row["image"] = {"bytes": (data / row["image"]).read_bytes(), "path": None}
    embedded = datasets.Dataset.from_list(rows).cast_column("image", datasets.Image())
    embedded.to_parquet(str(tmp_path / "val.parquet"))
    report = v.validate_dataset(tmp_path / "val.parquet", tokenizer_dir=tiny_llava["model"], max_length=96,
                                too_long="error")
    assert report.ok, report.summary()

    stored = _tokenized_alike(tiny_llava["model"], data / "val.jsonl", tmp_path / "val.parquet", tmp_path)
    assert len(stored) == len(rows)
    for i in range(len(rows)):
        (written,) = stored.images(i)
        assert written.startswith(str(tmp_path / "hf" / "sft-pipeline" / "images"))

    rows[3]["image"] = {"bytes": b"\x89PNG\r\n\x1a\n but no picture", "path": None}
    datasets.Dataset.from_list(rows).cast_column("image", datasets.Image()).to_parquet(str(tmp_path / "bad.parquet"))
    report = v.validate_dataset(tmp_path / "bad.parquet", tokenizer_dir=tiny_llava["model"], max_length=96,
                                too_long="error")
    assert [(p.index, p.reason) for _, p in report.problems] == [(3, "image_undecodable")]


def test_the_cauldron_shape_in_a_parquet_file_puts_each_record_s_images_before_its_first_question(
        tiny_llava, tmp_path, monkeypatch):
    """The demo's validation records as The Cauldron / FineVision keep theirs (their dataset card's features:
    `images`, a list of embedded images; `texts`, a list of {user, assistant, source}), written by `datasets`:
    they validate, and each record tokenizes as the same record with its image placeholder put before the
    first question's text by hand. A second exchange is a second user turn and its answer; a record whose turns
    hold placeholders keeps them where they are."""
    import datasets

    from pipeline.data import validate as v
    from pipeline.data.normalize import normalize_record

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = tiny_llava["data"]
    rows = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines()]
    turns = [[(r["conversations"][0]["value"].removeprefix("<image>\n"), r["conversations"][1]["value"])]
             for r in rows]
    turns[1].append(("and the shape?", "a circle"))
    features = datasets.Features({
        "images": datasets.List(datasets.Image()),
        "texts": datasets.List({"user": datasets.Value("string"), "assistant": datasets.Value("string"),
                                "source": datasets.Value("string")})})
    cauldron = datasets.Dataset.from_dict({
        "images": [[{"bytes": (data / r["image"]).read_bytes(), "path": None}] for r in rows],
        "texts": [[{"user": q, "assistant": a, "source": "demo"} for q, a in exchanges] for exchanges in turns],
    }, features=features)
    cauldron.to_parquet(str(tmp_path / "val.parquet"))
    report = v.validate_dataset(tmp_path / "val.parquet", tokenizer_dir=tiny_llava["model"], max_length=96,
                                too_long="error")
    assert report.ok, report.summary()

    def by_hand(r, exchanges) -> dict:
        texts = [t for exchange in exchanges for t in exchange]
        return {"image": str(data / r["image"]), "conversations": [
            {"from": "human" if k % 2 == 0 else "gpt", "value": ("<image>" if k == 0 else "") + text}
            for k, text in enumerate(texts)]}

    (tmp_path / "by_hand.jsonl").write_text("".join(json.dumps(by_hand(r, t)) + "\n" for r, t in zip(rows, turns)))
    got = _tokenized_alike(tiny_llava["model"], tmp_path / "by_hand.jsonl", tmp_path / "val.parquet", tmp_path)
    assert len(got) == len(rows) and len(got[1][0]) > len(got[0][0])  # the second exchange is there

    placed = {"images": ["a.png"], "texts": [{"user": "compare", "assistant": "x"},
                                              {"user": "now this: <image>", "assistant": "y"}]}
    record, problems = normalize_record(placed, index=0, line=None, file="f", kind="parquet", base_dir="/d")
    assert not problems and [m["content"] for m in record.messages] == ["compare", "x", "now this: <image>", "y"]


def test_trl_vision_records_with_bare_image_parts_take_the_record_s_images_in_order(tiny_llava, tmp_path,
                                                                                   monkeypatch):
    """The demo's validation records as TRL's vision datasets keep theirs (HuggingFaceH4/llava-instruct-mix-vsft's
    features: `messages` whose content parts are {type, text, index}, an image part holding no image; `images`, a
    list of embedded images), written by `datasets`: each bare image part is the place of the record's next image,
    and the records tokenize as the JSON Lines file with `<image>` at those places."""
    import datasets

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = tiny_llava["data"]
    rows = [json.loads(line) for line in (data / "val.jsonl").read_text().splitlines()]
    part = {"type": datasets.Value("string"), "text": datasets.Value("string"), "index": datasets.Value("int64")}
    features = datasets.Features({
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(part)}),
        "images": datasets.List(datasets.Image())})

    def trl(row: dict) -> dict:
        question, answer = (turn["value"] for turn in row["conversations"])
        text = question.removeprefix("<image>")  # "\n..." after the image, as in the JSON Lines record
        return {"images": [{"bytes": (data / row["image"]).read_bytes(), "path": None}], "messages": [
            {"role": "user", "content": [{"type": "image", "text": None, "index": 0},
                                         {"type": "text", "text": text, "index": None}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer, "index": None}]}]}

    datasets.Dataset.from_list([trl(r) for r in rows], features=features).to_parquet(str(tmp_path / "val.parquet"))
    got = _tokenized_alike(tiny_llava["model"], data / "val.jsonl", tmp_path / "val.parquet", tmp_path)
    assert len(got) == len(rows)
