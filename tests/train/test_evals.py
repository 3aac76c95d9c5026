"""Evaluation inside stages: the run's best weights, and a preemption in the middle of an eval."""

from __future__ import annotations

import json
import subprocess
import sys

from kits.train import make_run, stage_names

from pipeline import layout

OVERRIDES = ["validation.every=2", "checkpoint.save_every=0"]


def _progress(stage_dir):
    path = stage_dir / layout.STAGE_CHECKPOINT / layout.TRAINING_STATE_DIR / layout.PROGRESS_FILE
    return json.loads(path.read_text())


def _full_evals(stage_dirs):
    rows = []
    for d in stage_dirs:
        for line in (d / layout.STAGE_METRICS).read_text().splitlines():
            r = json.loads(line)
            if r.get("event") == "eval" and r.get("kind") == "full":
                rows.append(r)
    return rows


def _best_file(run, record, kind):
    return run.stage_dir(record["stage"]) / "best" / kind / "adapter_model.safetensors"


def test_best_weights_of_a_chunked_run_are_those_of_one_run(tiny, tmp_path):
    chunked = make_run(tmp_path / "chunked", tiny, total=12, fraction=0.25, chunks=2, overrides=OVERRIDES)
    stages = stage_names(chunked)
    chunked.chain(stages)
    single = make_run(tmp_path / "single", tiny, total=12, single_stage=True, overrides=OVERRIDES)
    single.train("all")

    best_c = _progress(chunked.stage_dir(stages[-1]))["best"]
    best_s = _progress(single.stage_dir("all"))["best"]
    assert set(best_c) == {"raw", "ema"}
    for kind in ("raw", "ema"):
        assert {k: best_c[kind][k] for k in ("loss", "step", "rate")} == \
               {k: best_s[kind][k] for k in ("loss", "step", "rate")}, kind
        assert _best_file(chunked, best_c[kind], kind).read_bytes() == _best_file(single, best_s[kind], kind).read_bytes()

    # Every eval_every updates of the run, wherever the stage boundaries fall; the best is the lowest.
    evals = _full_evals([chunked.stage_dir(s) for s in stages])
    assert [r["step"] for r in evals] == [2, 4, 6, 8, 10, 12]
    assert best_c["raw"]["loss"] == min(r["val_raw"] for r in evals)
    ema_losses = [r[k] for r in evals for k in r if k.startswith("val_ema_")]
    assert best_c["ema"]["loss"] == min(ema_losses)

    # export-best writes loadable PEFT dirs of exactly those weights.
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "export-best", "--stages", str(chunked.root / "stages"),
                           "--last", stages[-1], "--out-best", str(out / "best"), "--out-best-ema",
                           str(out / "best_ema")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (out / "best/adapter_model.safetensors").read_bytes() == _best_file(chunked, best_c["raw"], "raw").read_bytes()
    meta = json.loads((out / "best_ema/best.json").read_text())
    assert meta["step"] == best_c["ema"]["step"] and meta["rate"] == best_c["ema"]["rate"]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny["model"]), out / "best_ema")
    assert any("lora_B" in n for n, _ in model.named_parameters())


def test_preemption_during_an_eval_redoes_it_after_resume(tiny, tmp_path):
    run = make_run(tmp_path / "run", tiny, total=8, single_stage=True, overrides=OVERRIDES)
    first = run.train("all", faults={"usr1_in_eval_at": 4}, check=False)
    assert first.returncode == layout.EXIT_PREEMPTED, first.stderr[-3000:]
    assert "preempted at update 4" in first.stdout
    saved = json.loads((run.scratch("all") / "step_000004" / layout.TRAINING_STATE_DIR /
                        layout.PROGRESS_FILE).read_text())
    assert saved["eval_pending"] == ["full", "every full"]
    run.train("all")

    reference = make_run(tmp_path / "reference", tiny, total=8, single_stage=True, overrides=OVERRIDES)
    reference.train("all")
    evals = _full_evals([run.stage_dir("all")])
    assert [r["step"] for r in evals] == [2, 4, 6, 8]  # the interrupted one exactly once
    assert "redone after preemption" in evals[1]["reason"]
    ref_evals = _full_evals([reference.stage_dir("all")])
    assert [r["val_raw"] for r in evals] == [r["val_raw"] for r in ref_evals]
    assert _progress(run.stage_dir("all"))["best"] == _progress(reference.stage_dir("all"))["best"]
    adapter = f"{layout.STAGE_CHECKPOINT}/{layout.ADAPTER_DIR}/adapter_model.safetensors"
    assert (run.stage_dir("all") / adapter).read_bytes() == (reference.stage_dir("all") / adapter).read_bytes()


def test_validation_on_its_first_records_is_validation_on_a_set_of_those_records(tiny, tmp_path):
    """validation.max_records=5: the in-stage full evals and the evaluation job's losses are those of a
    validation set holding only the first 5 records (of 16), bit for bit."""
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint
    from pipeline.evaluate.stage import main as evaluate

    source = tiny["root"] / "data" / "val.jsonl"
    first = tmp_path / "first5.jsonl"
    first.write_text("".join(source.read_text().splitlines(keepends=True)[:5]))
    tokenize_file(first, load_tokenizer(tiny["model"]), out_path=tmp_path / "first5.safetensors", max_length=64,
                  too_long="error", fingerprint=tokenizer_fingerprint(tiny["model"]), split="val")
    runs = {"limited": make_run(tmp_path / "limited", tiny, total=4, single_stage=True,
                                overrides=[*OVERRIDES, "validation.max_records=5"]),
            "five": make_run(tmp_path / "five", {**tiny, "val": tmp_path / "first5.safetensors"}, total=4,
                             single_stage=True, overrides=OVERRIDES)}
    losses, evaluated = {}, {}
    for name, run in runs.items():
        run.train("all")
        losses[name] = [{k: v for k, v in full.items() if k.startswith("val_")}
                        for full in _full_evals([run.stage_dir("all")])]  # after updates 2 and 4
        out = run.root / "eval.json"
        assert evaluate(["--checkpoint", str(run.stage_dir("all") / "checkpoint"), "--stage", "all", "--max-new-tokens", "4",
                         "--out", str(out)]) == 0
        evaluated[name] = [(r["loss"], r["tokens"]) for r in json.loads(out.read_text())["rows"]]
    assert len(losses["limited"]) == 2 and len(losses["limited"][-1]) == 3  # raw and two EMA rates
    assert len(evaluated["limited"]) == 3
    assert losses["limited"] == losses["five"]
    assert evaluated["limited"] == evaluated["five"]
