"""A chunked, killed, corrupted or preempted run computes exactly what one run computes.

On `tiny_mixed`: records of mixed lengths, which the default packing (`pipeline.planning.packing`)
puts several to a row, so every guarantee here holds for packed micro-batches."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from kits.train import chain_and_compare, final_digests, make_run, pipeline_env, stage_names, step_losses, wait_for_step

TOTAL = 12  # pilot 3 + chunk01 4 + chunk02 4 + tail 1 at fraction 0.25


@pytest.fixture(scope="module")
def reference(tiny_mixed, tmp_path_factory):
    """One uninterrupted process over all updates: what every other run must reproduce."""
    run = make_run(tmp_path_factory.mktemp("reference"), tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True)
    run.train("all")
    return run


def test_chunked_run_equals_one_run(tiny_mixed, tmp_path, reference):
    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25)
    packing = json.loads(run.plan.read_text())["packing"]  # packed (on this CPU: one flat row, record by record)
    assert packing["layout"]["cpu"] == "records" and packing["padding_rows"] < packing["padding_before"] / 2
    names = chain_and_compare(run, reference)  # adapter, every EMA shadow and the optimizer state, byte for byte
    assert [s for s, _ in step_losses([run.stage_dir(s) for s in names])] == list(range(1, TOTAL + 1))



def test_sigkill_at_many_points_resumes_bitwise(tiny_mixed, tmp_path, reference):
    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True)
    scratch = run.scratch("all")
    # 1: killed inside a save (files written, MANIFEST not): that checkpoint must never load
    proc = run.train("all", faults={"sigkill_in_save_at": 4}, check=False)
    assert proc.returncode == -signal.SIGKILL
    partial = [p for p in scratch.iterdir() if p.name.startswith("step_000004.tmp-")]
    assert partial and not (partial[0] / "MANIFEST.json").exists()
    # 2-6: SIGKILL at different moments of the run, each followed by a resume
    cmd = [sys.executable, "-m", "pipeline", "train", "--plan", str(run.plan), "--config", str(run.config),
           "--stage", "all", "--scratch", str(scratch), "--out", str(run.stage_dir("all"))]
    env = pipeline_env({"SFT_FAULTS": json.dumps({"sleep_per_step": 0.15})})
    for kill_after in (3, 5, 6, 9, 11):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if wait_for_step(scratch / "metrics.jsonl", kill_after, proc):
            proc.kill()
        proc.wait(timeout=60)
        assert not run.stage_dir("all").exists(), "a killed stage must not publish its output"
    run.train("all")
    assert final_digests(run) == final_digests(reference)
    assert step_losses([run.stage_dir("all")]) == step_losses([reference.stage_dir("all")])


def test_corrupt_checkpoints_are_skipped_with_a_warning(tiny_mixed, tmp_path, reference):
    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True)
    proc = run.train("all", faults={"fail_at_step": 9}, check=False)
    assert proc.returncode == 1
    scratch = run.scratch("all")
    assert sorted(p.name for p in scratch.glob("step_??????")) == ["step_000004", "step_000006", "step_000008"]
    flipped = scratch / "step_000008" / "adapter" / "adapter_model.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = scratch / "step_000006" / "training_state" / "optimizer.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    proc = run.train("all")
    assert f"{flipped} does not match its sha256" in proc.stderr
    assert f"{truncated} has" in proc.stderr and "truncated" in proc.stderr
    assert "start from " + str(scratch / "step_000004") in proc.stdout
    assert final_digests(run) == final_digests(reference)


def test_preemption_signal_saves_and_exits_with_retry_code(tiny_mixed, tmp_path, reference):
    from pipeline import layout

    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True)
    scratch = run.scratch("all")
    cmd = [sys.executable, "-m", "pipeline", "train", "--plan", str(run.plan), "--config", str(run.config),
           "--stage", "all", "--scratch", str(scratch), "--out", str(run.stage_dir("all"))]
    env = pipeline_env({"SFT_FAULTS": json.dumps({"sleep_per_step": 0.15})})
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for_step(scratch / "metrics.jsonl", 5, proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == layout.EXIT_PREEMPTED, err[-2000:]
    assert "preempted at update" in out
    latest = scratch / (scratch / "LATEST").read_text().strip()
    saved = json.loads((latest / "MANIFEST.json").read_text())
    assert 5 <= saved["step"] < TOTAL
    run.train("all")
    assert final_digests(run) == final_digests(reference)


def test_nan_gradient_skips_the_update(tiny_mixed, tmp_path):
    from safetensors.torch import load_file

    run = make_run(tmp_path, tiny_mixed, total=6, fraction=0.5, chunks=1, single_stage=True)
    proc = run.train("all", faults={"nan_grad_steps": [3]})
    assert "update 3 skipped: non-finite gradient" in proc.stderr
    rows = [json.loads(x) for x in (run.stage_dir("all") / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # per-update lines (not eval / rank-check events)
    assert [r["skipped"] for r in rows] == [False, False, False, True, False, False]
    assert rows[-1]["skipped_total"] == 1
    opt = load_file(run.stage_dir("all") / "checkpoint" / "training_state" / "optimizer.safetensors")
    adam_steps = {float(v) for k, v in opt.items() if k.endswith("::step")}
    assert adam_steps == {5.0}  # 6 updates, one skipped: AdamW stepped 5 times


def test_consecutive_nan_gradients_abort_with_a_checkpoint(tiny_mixed, tmp_path):
    run = make_run(tmp_path, tiny_mixed, total=12, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["precision.max_consecutive_nonfinite=3"])
    proc = run.train("all", faults={"nan_grad_steps": [2, 3, 4, 5, 6]}, check=False)
    assert proc.returncode == 2
    assert "3 non-finite updates in a row at update 5" in proc.stderr
    assert "Traceback" not in proc.stderr
    saved = run.scratch("all") / "step_000005"
    assert (saved / "MANIFEST.json").is_file()
    assert not run.stage_dir("all").exists()


@pytest.mark.distributed
def test_ddp_two_ranks_chunked_equals_one_run(tiny_mixed, tmp_path):
    chunked = make_run(tmp_path / "chunked", tiny_mixed, total=8, fraction=0.25, chunks=2)
    names = stage_names(chunked)
    chunked.chain(names, nproc=2)
    one = make_run(tmp_path / "one", tiny_mixed, total=8, fraction=0.25, chunks=2, single_stage=True)
    one.train("all", nproc=2)
    assert final_digests(chunked, names[-1]) == final_digests(one)
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    ckpt = one.stage_dir("all") / "checkpoint" / "training_state"
    assert (ckpt / "rng_rank000.json").is_file() and (ckpt / "rng_rank001.json").is_file()


def test_full_finetuning_chunked_equals_one_run(tiny_mixed, tmp_path):
    chunked = make_run(tmp_path / "chunked", tiny_mixed, total=6, fraction=0.34, chunks=2, overrides=["lora=full"])
    names = stage_names(chunked)
    chunked.chain(names)
    one = make_run(tmp_path / "one", tiny_mixed, total=6, fraction=0.34, chunks=2, overrides=["lora=full"],
                   single_stage=True)
    one.train("all")
    digests = final_digests(one)
    assert "model/model.safetensors" in digests and "ema/0.9/model.safetensors" in digests
    assert final_digests(chunked, names[-1]) == digests
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
