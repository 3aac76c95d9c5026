"""Experiment trackers: one tracker run per training run, every update exactly once, never a failure.

A real MLflow tracking server (SQLite store) is started here; W&B runs offline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from kits.train import final_digests, make_run, pipeline_env, stage_names, wait_for_step

pytest.importorskip("mlflow")

TOTAL = 12  # pilot 3 + chunk01 4 + chunk02 4 + tail 1 at fraction 0.25
OVERRIDES = ["validation.every=4"]  # in-stage full evaluations at updates 4 and 8 (and 12, the last)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    try:
        while True:
            try:
                if urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _tracker_env(monkeypatch, kind: str, uri: str = "", project: str = "tracker-test") -> None:
    monkeypatch.setenv("PIPELINE_TRACKER_KIND", kind)
    monkeypatch.setenv("PIPELINE_TRACKER_URI", uri)
    monkeypatch.setenv("PIPELINE_TRACKER_PROJECT", project)
    monkeypatch.setenv("PIPELINE_TRACKER_TAGS", "suite=pytest")



def _jsonl_metrics(run, names) -> dict[str, dict[int, float]]:
    """What the tracker must hold: metrics.jsonl of every stage, as the tracker names them."""
    from pipeline.tracker import record_metrics

    out: dict[str, dict[int, float]] = {}
    for s in names:
        for line in (run.stage_dir(s) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            for key, value in record_metrics(record).items():
                assert record["step"] not in out.setdefault(key, {}), f"{key} twice at {record['step']} in jsonl"
                out[key][record["step"]] = value
    return out


def _evaluate_stages(run, names) -> None:
    from pipeline.evaluate.stage import main as evaluate

    for s in names:
        assert evaluate(["--checkpoint", str(run.stage_dir(s) / "checkpoint"), "--stage", s, "--max-new-tokens", "16",
                         "--out", str(run.root / "eval" / f"{s}.json")]) == 0


def test_mlflow_one_run_every_update_once_across_a_sigkill(tiny, tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline.tracker import Tracker

    _tracker_env(monkeypatch, "mlflow", mlflow_server)
    run = make_run(tmp_path, tiny, total=TOTAL, fraction=0.25, overrides=OVERRIDES)
    names = stage_names(run)
    run.train("pilot")
    # chunk01 (updates 4..7) killed mid-chunk: after update 5 was logged, past the checkpoint of 4
    scratch = run.scratch("chunk01")
    cmd = [sys.executable, "-m", "pipeline", "train", "--plan", str(run.plan), "--config", str(run.config),
           "--stage", "chunk01", "--init", str(run.stage_dir("pilot") / "checkpoint"), "--scratch", str(scratch),
           "--out", str(run.stage_dir("chunk01"))]
    proc = subprocess.Popen(cmd, env=pipeline_env({"SFT_FAULTS": json.dumps({"sleep_per_step": 0.5})}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert wait_for_step(scratch / "metrics.jsonl", 5, proc), proc.stderr.read()[-3000:]
    proc.kill()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not run.stage_dir("chunk01").exists()
    logged = json.loads((run.root / "tracker" / "logged" / "chunk01.json").read_text())
    assert 3 < logged["step"] < 7, logged  # some of chunk01 reached the tracker before the kill
    prev = "pilot"
    for s in names[1:]:  # the rerun of chunk01 resumes, then the rest of the run
        run.train(s, prev)
        prev = s
    _evaluate_stages(run, names)
    tracker = Tracker(run.root, job="test")  # the smoke test's call (pipeline.evaluate.smoke.main)
    tracker.log_final({"final/exact_match": 0.75})
    tracker.close()

    client = MlflowClient(tracking_uri=mlflow_server)
    state = json.loads((run.root / "tracker" / "run.json").read_text())
    exp = client.get_experiment_by_name("tracker-test")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [state["run_id"]]  # one run
    mlrun = client.get_run(state["run_id"])
    # every metric of every update exactly once, equal to metrics.jsonl
    expected = _jsonl_metrics(run, names)
    assert set(expected["train/loss"]) == set(range(1, TOTAL + 1))
    for key, values in expected.items():
        history = client.get_metric_history(state["run_id"], key)
        steps = [m.step for m in history]
        assert sorted(steps) == sorted(values), (key, sorted(steps))  # once each (no duplicates)
        assert {m.step: m.value for m in history} == pytest.approx(values), key
    assert {4, 8, 12} <= set(expected["eval_full/raw"])  # the in-stage evaluations are among them
    # stage boundaries
    starts = client.get_metric_history(state["run_id"], "stage_start")
    plan = json.loads(run.plan.read_text())
    assert sorted((m.step, m.value) for m in starts) == [(s["start"], float(i)) for i, s in enumerate(plan["stages"])]
    assert {f"stage.{s}" for s in names} <= set(mlrun.data.tags) and mlrun.data.tags["suite"] == "pytest"
    # the parameters are the resolved config
    flat = OmegaConf.to_container(OmegaConf.load(run.config))

    def flatten(d, p=""):
        return {k2: v2 for k, v in d.items()
                for k2, v2 in (flatten(v, f"{p}{k}.").items() if isinstance(v, dict) else [(f"{p}{k}", str(v))])}

    assert mlrun.data.params == flatten(flat)
    # each stage's evaluation (raw and each EMA rate, at the stage's last update) and the final exact match
    for s in plan["stages"]:
        for weights in ("raw", "ema_0.9", "ema_0.99"):
            hist = client.get_metric_history(state["run_id"], f"eval/{weights}/loss")
            assert [m.step for m in hist].count(s["end"]) == 1, (weights, s)
    assert [(m.step, m.value) for m in client.get_metric_history(state["run_id"], "final/exact_match")] == [(TOTAL, 0.75)]


def test_wandb_offline_one_run_across_stages(tiny, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    _tracker_env(monkeypatch, "wandb", project="tracker-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = make_run(tmp_path, tiny, total=TOTAL, fraction=0.25, overrides=OVERRIDES)
    names = stage_names(run)
    run.chain(names)
    _evaluate_stages(run, names[-1:])
    wandb.teardown()  # the in-process evaluation's file is whole once wandb's service has stopped
    run_id = json.loads((run.root / "tracker" / "run.json").read_text())["run_id"]
    files = sorted((run.root / "tracker" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == len(names) + 1  # one per job (4 stages, 1 evaluation) ...
    assert {f.name for f in files} == {f"run-{run_id}.wandb"}  # ... all of the one run
    # read back with wandb's own reader of the .wandb transaction log
    history: dict[str, dict[int, float]] = {}
    ids = set()
    kinds: dict[str, Counter] = {}  # per file, its record types: what a failure below shows
    for f in files:
        for data in _wandb_records(f):
            rec = wandb_internal_pb2.Record()  # wandb's own record type
            rec.ParseFromString(data)
            kinds.setdefault(f.parent.name, Counter()).update([rec.WhichOneof("record_type")])
            if rec.WhichOneof("record_type") == "run":
                ids.add(rec.run.run_id)
            elif rec.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
                for k, v in row.items():
                    if k != "update" and not k.startswith("_"):
                        assert row["update"] not in history.setdefault(k, {}), (k, row["update"])
                        history[k][row["update"]] = v
    # and wandb's own CLI reads them as runs it would upload (without uploading anything)
    proc = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", *map(str, {f.parent for f in files})],
                          capture_output=True, text=True, env=pipeline_env(), timeout=120)
    assert proc.returncode == 0 and f"Would sync {len(files)} run(s)" in proc.stdout + proc.stderr, proc.stderr
    assert ids == {run_id}
    expected = _jsonl_metrics(run, names)
    for key, values in expected.items():
        assert history[key] == pytest.approx(values), key
    errors = run.root / "tracker" / "errors.jsonl"
    seen = (f"records per job: {kinds}; tracker errors: "
            f"{errors.read_text() if errors.is_file() else 'none'}")
    assert set(history.get("eval/raw/loss", {})) == {TOTAL}, seen


def _wandb_records(path: Path):
    """The records of a .wandb file: wandb's LevelDB-style log (a 7-byte header ":W&B", 0xBEE1,
    version 0; 32 KiB blocks of chunks, each crc32 / length / type FULL 1 FIRST 2 MIDDLE 3 LAST 4).
    wandb >= 0.2x reads it in its Go core only, so the framing is read here; the records are
    parsed with wandb's protobuf classes. The core buffers its writes: `run.finish()` can return
    before the file holds the run's records (seen: an offline file of only its 7-byte header right
    after finish), so a test that logged in-process reads the file after `wandb.teardown()`."""
    import struct

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the rest of a block too small for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def test_unreachable_tracker_changes_nothing_and_is_reported(tiny, tmp_path, monkeypatch):
    from pipeline.evaluate.summarize import main as summarize

    plain = make_run(tmp_path / "plain", tiny, total=6, fraction=0.5, chunks=1, overrides=OVERRIDES)
    plain.chain(stage_names(plain))
    _tracker_env(monkeypatch, "mlflow", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    run = make_run(tmp_path / "tracked", tiny, total=6, fraction=0.5, chunks=1, overrides=OVERRIDES)
    names = stage_names(run)
    t0 = time.time()
    run.chain(names)
    assert time.time() - t0 < 120
    for s in names:
        assert final_digests(run, s) == final_digests(plain, s)  # adapter, EMAs, optimizer: bit for bit
    errors = [json.loads(x) for x in (run.root / "tracker" / "errors.jsonl").read_text().splitlines()]
    assert errors and {e["kind"] for e in errors} == {"mlflow"}
    _evaluate_stages(run, names)
    out = run.root / "eval"
    assert summarize(["--eval", *[str(out / f"{s}.json") for s in names], "--metrics",
                      *[str(run.stage_dir(s)) for s in names], "--plan", str(run.plan), "--run", "tracked",
                      "--out-csv", str(out / "summary.csv"), "--out-loss-plot", str(out / "loss.png"),
                      "--out-eval-plot", str(out / "val.png"), "--out-summary-html",
                      str(run.root / "report" / "summary.html")]) == 0
    page = (run.root / "report" / "summary.html").read_text()
    assert "Experiment tracker failed" in page and "mlflow" in page


def test_mlflow_sweep_variants_are_child_runs_of_the_sweep(tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    from pipeline.tracker import Tracker

    _tracker_env(monkeypatch, "mlflow", mlflow_server, project="tracker-sweep")
    ids = {}
    for name, lr in (("lr_a", 0.1), ("lr_b", 0.2)):
        run_dir = tmp_path / "sweep" / "variants" / name
        run_dir.mkdir(parents=True)
        (run_dir / "train_config.yaml").write_text(f"optim:\n  lr: {lr}\n")
        tracker = Tracker(run_dir, job="test")
        tracker.log_final({"final/exact_match": lr})
        tracker.close()
        ids[name] = tracker.run_id
    parent = json.loads((tmp_path / "sweep" / "tracker" / "parent.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=mlflow_server)
    for name, run_id in ids.items():
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["sweep"] == "sweep"
        assert run.info.run_name == f"sweep/{name}" and run.data.params == {"optim.lr": str(run.data.metrics["final/exact_match"])}
    assert client.get_run(parent).info.run_name == "sweep"


def test_wandb_two_runs_in_one_process_stay_apart(tmp_path, monkeypatch):
    """A process that opens the trackers of two training runs (a notebook, a job that failed before
    closing its tracker, in-process tests) logs each run's metrics to that run. wandb.init's own
    default, while another run is active in the process, is to hand back that other run."""
    wandb = pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    from pipeline.tracker import Tracker

    _tracker_env(monkeypatch, "wandb", project="tracker-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first, second = Tracker(tmp_path / "first", job="test"), Tracker(tmp_path / "second", job="test")
    first.log_evaluation({"stage": "tail", "step": 3, "rows": [{"weights": "raw", "loss": 1.5}]})
    second.log_evaluation({"stage": "tail", "step": 5, "rows": [{"weights": "raw", "loss": 2.5}]})
    second.close()
    first.close()
    wandb.teardown()  # the files are whole once wandb's service has stopped (see _wandb_records)
    for tracker, step, loss in ((first, 3, 1.5), (second, 5, 2.5)):
        assert not (tracker.dir / "errors.jsonl").exists(), (tracker.dir / "errors.jsonl").read_text()
        run_id = tracker.run_id
        files = list((tracker.dir / "wandb").glob("offline-run-*/run-*.wandb"))
        assert [f.name for f in files] == [f"run-{run_id}.wandb"], (tracker.run_dir.name, files)
        rows, kinds = [], []
        for data in _wandb_records(files[0]):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            kinds.append(rec.WhichOneof("record_type"))
            if rec.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in rec.history.item})
        assert [(r["update"], r["eval/raw/loss"]) for r in rows if "eval/raw/loss" in r] == [(step, loss)], (rows, kinds)
