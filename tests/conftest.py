"""Fixtures shared across the test packages.

`tiny`: a tiny real model, dataset and token caches for the trainer, evaluation
and export tests (helpers to run stages on it: kits/train.py). `tiny_llava` and
`tiny_qwen2_vl`: the same for two vision-language families (kits/vlm.py).

`local_default_run` is the reference the workflow and SLURM tests compare with:
one cold `snakemake --cores all` of the embedded default in a copy of the
workflow, made once per test session (about 2-4 minutes on 2 cores). No test
may change it: a test that edits or retrains takes a copy (`copy_run`).
`embedded_base`: the embedded default's base model and demo dataset alone, as
`prepare_base` makes them, for the other whole-DAG tests of that default.

GPUs: every test runs on the CPU unless it is marked `gpu`. The tests' CPU
figures (fp32 under `precision.mode=auto`, gloo ranks on one machine, bitwise
comparisons of CPU kernels) hold only there: on a GPU host `auto` would pick
bf16 and two ranks would need two GPUs. So this process and every process a
test starts (trainers, torchrun, snakemake) see no GPU (CUDA_VISIBLE_DEVICES
set empty before anything asks CUDA), and a `gpu` test gets back the devices
the session was started with, or is skipped where torch sees none.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kits.run import EMBEDDED_RESULTS, copy_workflow, snakemake

from pipeline.layout import RunTree

# Before any test module imports torch: CUDA reads the variable once, when first asked.
SESSION_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _session_env() -> dict:
    """This process's environment with the GPUs the session was started with."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES")
    if SESSION_VISIBLE_DEVICES is not None:
        env["CUDA_VISIBLE_DEVICES"] = SESSION_VISIBLE_DEVICES
    return env


def session_has_cuda() -> bool:
    """Whether torch sees a CUDA GPU with the session's devices: asked in a child process (this one
    hides them), and only where nvidia-smi is installed (no torch start-up on a CPU machine)."""
    if shutil.which("nvidia-smi") is None:
        return False
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          env=_session_env(), capture_output=True, text=True, timeout=300)
    return proc.stdout.strip().endswith("True")


# `pytest -n 2` (the README's test command) runs the tests in two pytest-xdist workers, handing
# out whole groups (`--dist loadgroup`, pyproject's addopts) in the order below. A group is one
# module, so that a module's fixtures (a whole-DAG run shared by its tests) are made once, except:
# - "slurm": the SLURM suite, one at a time on the one local cluster;
# - "default_run": the tests that read `local_default_run` (made once, shared with the SLURM suite,
#   which compares with it).
# These two and then the other snakemake modules are handed out first: the long groups start at
# once and the short unit-test modules fill the end. Within each of those ranks the longest module
# goes first (its seconds in a CI run: tests/group_seconds.json, made by .ci/group_seconds.py), so
# that no long module starts last and leaves the other worker idle at the end.
SLURM_GROUP, DEFAULT_RUN_GROUP = "slurm", "default_run"
GROUP_SECONDS = json.loads((Path(__file__).with_name("group_seconds.json")).read_text())


def xdist_group(item) -> str:
    if item.get_closest_marker("slurm"):
        return SLURM_GROUP
    if {"local_default_run", "done"} & set(item.fixturenames):
        return DEFAULT_RUN_GROUP
    return item.nodeid.split("::")[0]


def _hand_out_order(item) -> tuple[int, float]:
    group = xdist_group(item)
    if group in (SLURM_GROUP, DEFAULT_RUN_GROUP):
        return 0, 0.0
    rank = 1 if item.get_closest_marker("workflow") or "/workflow/" in group else 2
    return rank, -GROUP_SECONDS.get(group, 0.0)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the markers
def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and not session_has_cuda():
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
    items.sort(key=_hand_out_order)  # stable: collection order within each rank


@pytest.fixture(autouse=True)
def _session_gpus_for_gpu_tests(request, monkeypatch):
    """A `gpu` test (and the processes it starts) sees the session's GPUs; every other test none."""
    if request.node.get_closest_marker("gpu") is None:
        return
    if SESSION_VISIBLE_DEVICES is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SESSION_VISIBLE_DEVICES)


def _cold_default_run(root: Path) -> None:
    proc = snakemake(copy_workflow(root), "--cores", "all")
    assert proc.returncode == 0, proc.stderr[-6000:]


def _made_once(tmp_path_factory, worker_id, name: str, make) -> Path:
    """`make(directory)` once per test session. Under pytest-xdist the workers share it: the first to
    ask makes it in the session's common temporary directory while holding a lock, and a worker that
    asks meanwhile waits for it. A failure (a timeout too) is reported to every worker that asks
    later, with its message, not made again over its remains."""
    if worker_id == "master":
        made = tmp_path_factory.mktemp(name)
        make(made)
        return made
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / name
    failed, complete = shared.with_suffix(".failed"), shared.with_suffix(".complete")
    with FileLock(str(shared.with_suffix(".lock"))):
        if failed.exists():
            pytest.fail(f"{name}, made once for the session, failed in another worker:\n{failed.read_text()}")
        if not complete.exists():
            try:
                make(shared)
            except Exception as err:
                failed.write_text(f"{type(err).__name__}: {err}")
                raise
            complete.touch()
    return shared


@pytest.fixture(scope="session")
def local_default_run(tmp_path_factory, worker_id) -> Path:
    """A cold local run of the embedded default, as the README's quickstart does it, shared by the
    workers (`_made_once`). The SLURM suite asks after its own run of several minutes, by which
    time the other worker has usually made it."""
    return _made_once(tmp_path_factory, worker_id, "local-default-run", _cold_default_run)


def _prepared_embedded_base(root: Path) -> None:
    workdir = copy_workflow(root)
    tree = RunTree(EMBEDDED_RESULTS)
    targets = [tree.base_model, *(tree.demo_split(split) for split in ("train", "val", "test"))]
    proc = snakemake(workdir, *map(str, targets), "--cores", "1")
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.fixture(scope="session")
def embedded_base(tmp_path_factory, worker_id) -> Path:
    """results/embedded/ of the embedded default as its `prepare_base` job writes it (base model and
    demo dataset, ~40 s), made once for the session's whole-DAG tests that are not about making it
    and shared by the workers (`_made_once`); kits.run.seed_embedded_base puts it into a workflow copy."""
    return _made_once(tmp_path_factory, worker_id, "embedded-base", _prepared_embedded_base) / EMBEDDED_RESULTS


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict:
    """A 2-layer Llama (random init), the demo tokenizer, and train/val caches."""
    import torch

    from pipeline.demo import text as demo
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

    root = tmp_path_factory.mktemp("tiny")
    tok = demo.build_tokenizer()
    model = demo.build_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    paths = demo.build_dataset(root / "data", n_train=96, n_val=16, n_test=8)
    tokenizer = load_tokenizer(root / "model")
    fp = tokenizer_fingerprint(root / "model")
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=64,
                      too_long="error", fingerprint=fp, split=split)
    torch.set_num_threads(1)
    return {"root": root, "model": root / "model", "train": root / "train.safetensors",
            "val": root / "val.safetensors", "test": paths["test"]}


@pytest.fixture(scope="session")
def tiny_mixed(tiny, tmp_path_factory) -> dict:
    """`tiny`'s model with train/val caches of the demo task at mixed lengths (about 24..96 tokens),
    so that packing (`pipeline.planning.packing`) puts several records in a row."""
    from pipeline.demo import text as demo
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

    root = tmp_path_factory.mktemp("tiny_mixed")
    paths = demo.build_mixed_dataset(root / "data", lengths=(24, 96), n_train=64, n_val=16)
    tokenizer = load_tokenizer(tiny["model"])
    fp = tokenizer_fingerprint(tiny["model"])
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=128,
                      too_long="error", fingerprint=fp, split=split)
    return {**tiny, "root": root, "train": root / "train.safetensors", "val": root / "val.safetensors"}


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> dict:
    """A tiny random LLaVA, the demo colour questions with their images, train/val caches."""
    from kits.vlm import make_vlm_data, save_llava

    root = tmp_path_factory.mktemp("tiny_llava")
    return make_vlm_data(root, save_llava(root / "model"))


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory) -> dict:
    """A tiny random Qwen2-VL, the demo colour questions with their images, train/val caches."""
    from kits.vlm import make_vlm_data, save_qwen2_vl

    root = tmp_path_factory.mktemp("tiny_qwen2_vl")
    return make_vlm_data(root, save_qwen2_vl(root / "model"))


@pytest.fixture
def own_signal_handlers():
    """For tests that run the trainer in their own process: it installs its preemption handlers
    (SIGTERM, SIGUSR1); pytest's own are put back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
