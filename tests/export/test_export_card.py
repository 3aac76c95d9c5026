"""Model cards of the export dirs, and what an export carries over from its base."""

from __future__ import annotations

import json

import pytest
import yaml

from export_helpers import save_adapter, save_base

PLAN = {"total_updates": 300, "stages": [{"name": "pilot", "start": 0, "end": 15},
                                         {"name": "chunk01", "start": 15, "end": 299},
                                         {"name": "tail", "start": 299, "end": 300}]}
STATS = {"max_length": 128, "too_long": "error", "splits": {
    "train": {"source": "data/train.jsonl", "records_in": 2000, "records": 1990, "tokens": 53956, "supervised_tokens": 11978},
    "val": {"source": "data/val.jsonl", "records_in": 128, "records": 128, "tokens": 3382, "supervised_tokens": 731}}}
CONFIG = {"seed": 0, "model": {"path": "base/model", "dtype": "auto"},
          "lora": {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["all-linear"]},
          "ema": {"rates": [0.9, 0.98], "every": 1},
          "optim": {"lr": 0.002, "warmup_fraction": 0.05, "global_batch": 32, "micro_batch": 16}}


def evaluation(stage, step, rows):
    return {"stage": stage, "step": step, "rows": [
        {"weights": w, "loss": loss, "perplexity": 1.0, "exact_match": em, "n_test": 64, "samples": []}
        for w, loss, em in rows]}


@pytest.fixture
def run_files(tmp_path):
    files = {"plan": tmp_path / "plan.json", "stats": tmp_path / "stats.json", "config": tmp_path / "train_config.yaml"}
    files["plan"].write_text(json.dumps(PLAN))
    files["stats"].write_text(json.dumps(STATS))
    files["config"].write_text(yaml.safe_dump(CONFIG))
    evals = [evaluation("base", 0, [("base", 5.78, 0.0)]),
             evaluation("pilot", 15, [("raw", 2.661, 0.0), ("ema_0.9", 3.337, 0.0)]),
             evaluation("tail", 300, [("raw", 0.0041, 1.0), ("ema_0.9", 0.0040, 0.984375)])]
    files["evals"] = []
    for record in evals:
        path = tmp_path / f"{record['stage']}.json"
        path.write_text(json.dumps(record))
        files["evals"].append(path)
    return files


def card_args(files, run="demo"):
    return ["--card-run", run, "--card-plan", str(files["plan"]), "--card-stats", str(files["stats"]),
            "--card-config", str(files["config"]), "--card-eval", *map(str, files["evals"])]


def test_adapter_card_lists_base_data_config_schedule_evaluation_and_loading(tmp_path, run_files):
    from pipeline.export.card import write_card

    dst = tmp_path / "adapter_ema"
    dst.mkdir()
    (dst / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "results/embedded/model"}))
    (dst / "chat.json").write_text(json.dumps({"template": "builtin:chatml", "end_of_turn": "<|im_end|>",
                                               "base_vocab_size": 50, "vocab_size": 52,
                                               "added_tokens": {"<|im_start|>": 50, "<|im_end|>": 51}}))
    text = write_card(dst, run="demo", plan=run_files["plan"], stats=run_files["stats"],
                      train_config=run_files["config"], evals=run_files["evals"]).read_text()
    assert text.startswith("---\nbase_model: results/embedded/model\nlibrary_name: peft\n")
    assert "# demo / adapter_ema" in text and "EMA" in text
    assert "| train | data/train.jsonl | 2000 | 1990 | 53956 | 11978 |" in text
    assert "| LoRA rank r | 16 |" in text and "| learning rate | 0.002 |" in text and "| EMA rates | 0.9, 0.98 |" in text
    assert "| chunk01 | 16 | 299 | 284 |" in text  # the schedule
    for row in ("| base | 0 | base | 5.78 |", "| pilot | 15 | ema_0.9 | 3.337 |", "| tail | 300 | raw | 0.0041 |",
                "| tail | 300 | ema_0.9 | 0.004 | 1 | 0.9844 | 64 |"):
        assert row in text, row
    assert "PeftModel.from_pretrained" in text and "resize_token_embeddings(len(tokenizer))" in text
    assert "`<|im_end|>`" in text and "python -m pipeline chat adapter_ema" in text


def test_merged_card_via_the_merge_command_loads_with_transformers(tmp_path, run_files):
    from pipeline.cli import main

    model = save_base(tmp_path / "base", shard=None)
    (tmp_path / "base" / "pretrain_report.json").write_text("{}")  # the demo's; not part of the model
    (tmp_path / "base" / "README.md").write_text("# the base's card\n")
    (tmp_path / "base" / "LICENSE").write_text("licence\n")
    save_adapter(model, tmp_path / "adapter")
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
                 "--out", str(out), *card_args(run_files)]) == 0
    names = {p.name for p in out.iterdir()}
    assert "pretrain_report.json" not in names and "LICENSE" in names
    text = (out / "README.md").read_text()
    assert "the base's card" not in text and "library_name: transformers" in text
    assert "## Evaluation" in text and "| tail | 300 | raw | 0.0041 |" in text
    assert 'pipeline("text-generation", model="merged", tokenizer="merged")' in text
    assert "resize_token_embeddings" not in text
    from transformers import pipeline

    generate = pipeline("text-generation", model=str(out), tokenizer=str(out))
    assert generate("repeat: ab", max_new_tokens=2)[0]["generated_text"].startswith("repeat: ab")


def test_no_card_without_card_options(tmp_path, llama_pair):
    from pipeline.cli import main

    base, adapter = llama_pair(shard=None)
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m")]) == 0
    assert not (tmp_path / "m" / "README.md").exists()


def test_hf_files_allow_list():
    from pipeline.storage.hf_dir import is_hf_file

    for name in ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
                 "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                 "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "added_tokens.json",
                 "modeling_custom.py", "LICENSE", "LICENSE.txt", "USE_POLICY.md"):
        assert is_hf_file(name), name
    for name in ("pretrain_report.json", "README.md", "model.safetensors", "model.safetensors.index.json",
                 ".gitattributes", "trainer_state.json", "eval_results.json", "figure.png", "pytorch_model.bin"):
        assert not is_hf_file(name), name


def test_a_hub_dataset_is_named_by_its_url_not_its_pin(tmp_path):
    """A split fetched from the hub (`fetch_data`) is read through its pin; the card names its URL."""
    from pipeline.export.card import build_card

    url = "hf://datasets/org/chats/data/train-*.parquet"
    pin = tmp_path / "train.hub.json"
    pin.write_text(json.dumps({"url": url, "repo_id": "org/chats", "revision": "0" * 40, "pattern": "data/train-*.parquet",
                               "files": [str(tmp_path / "train-00000-of-00002.parquet")]}))
    dst = tmp_path / "merged"
    dst.mkdir()
    stats = {"splits": {"train": {**STATS["splits"]["train"], "source": str(pin)}, "val": STATS["splits"]["val"]}}
    card = build_card(dst, run="demo", plan=PLAN, stats=stats, config=CONFIG, evals=[])
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in card.splitlines()
            if line.startswith("| train ") or line.startswith("| val ")}
    assert rows == {"train": url, "val": "data/val.jsonl"}, card
