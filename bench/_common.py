"""Shared by the training benchmarks: the machine, the versions, the default run, result files.

Every benchmark writes two files under bench/results/: `<name>.md` (the full
table, for people) and `<name>.json` (the figures, the command, the machine,
the date and the library versions, for `bench/run_all.py`, which builds
bench/RESULTS.md from them).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RESULTS_MD = REPO / "bench" / "RESULTS.md"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# --- the trainer config keys the benchmarks set or read --------------------------------------------

# Every trainer key (config/train) a benchmark passes as an override or reads back from the
# resolved config, in one place: a renamed key is a one-line change here. (bench_memory.py's
# "before" trainer keeps the names of its own commit: BEFORE_KEYS there.)
KEY_TRAIN_CACHE = "tokens.train_cache"
KEY_VAL_CACHE = "tokens.val_cache"
KEY_GROUP_BY_LENGTH = "tokens.group_by_length"
KEY_PACKING = "tokens.packing"
KEY_EVAL_EVERY = "validation.every"


def cfg_value(cfg, key: str):
    """`cfg`'s value at a dotted key (one of the KEY_* above) of a loaded TrainConfig."""
    return functools.reduce(getattr, key.split("."), cfg)


# --- where and with what a figure was measured ----------------------------------------------------


def machine() -> dict:
    """Cores, CPU model, memory, GPU and the load average now (other jobs share the cores)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        kb = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemTotal")).split()[1])
        mem_gib = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = gpus_found()
    gpu = f"{len(gpus)} x {gpus[0][0]} ({gpus[0][1] / 2**30:.0f} GiB)" if gpus else None
    return {"cores": cores, "cpu": cpu, "memory_gib": mem_gib, "gpu": gpu,
            "os": f"{platform.system()} {platform.release()}", "load_average": load_average()}


def gpus_found() -> list[tuple[str, int]]:
    """(name, memory in bytes) of each CUDA GPU this process may use, asked in a child process: asking
    torch here would create a CUDA context in the benchmark's own process (half a GiB of GPU memory
    that a trainer it launches, which plans for the whole GPU, would not have)."""
    code = ("import json, torch; print(json.dumps([(torch.cuda.get_device_name(i), "
            "torch.cuda.get_device_properties(i).total_memory) for i in range(torch.cuda.device_count())] "
            "if torch.cuda.is_available() else []))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return [tuple(g) for g in json.loads(proc.stdout.strip().splitlines()[-1])] if proc.returncode == 0 else []
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return []


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_text(m: dict) -> str:
    load = m.get("load_average")
    load_text = f"; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min) at start" if load else ""
    return (f"{m['cores']} CPU cores ({m['cpu']}), {m['memory_gib']} GiB RAM, "
            f"{'GPU ' + m['gpu'] if m.get('gpu') else 'no GPU'}, {m['os']}{load_text}")


def versions(*names: str) -> dict[str, str]:
    """Versions of python and the named packages that are installed."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def versions_text(v: dict[str, str]) -> str:
    return ", ".join(f"{k} {val}" for k, val in v.items())


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "pipeline"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (pipeline/ modified)" if dirty else "") if out.returncode == 0 else None
    except OSError:
        return None


def git_tree(rev: str, root: Path, paths: list[str], what: str) -> Path:
    """`paths` of commit `rev` (`git archive`), unpacked into a new dir `root`; `what` names the tree
    in the error a shallow clone gets."""
    root.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev, *paths], cwd=REPO, capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"{what}: git archive {rev} failed in {REPO} (a shallow clone lacks it; `git fetch --unshallow`):\n"
                 f"{archive.stderr.decode()[-2000:]}")
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


def command_line(script: str) -> str:
    """The command that reproduces this run, from the repository root."""
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(script, REPO), *sys.argv[1:]])


def today() -> str:
    return datetime.date.today().isoformat()


# --- numbers ------------------------------------------------------------------------------------


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs) -> str:
    """'min..max' of a list, for tables that show how noisy the repeats were."""
    xs = list(xs)
    return f"{min(xs):,.0f}..{max(xs):,.0f}" if xs else ""


# --- the embedded default, built fresh ------------------------------------------------------------


def build_default(root: Path, *, max_length: int = 128) -> dict:
    """The embedded default model (architecture of `prepare_base`, random init) and its token caches.

    Throughput does not depend on the weights' values, so the 25 s pre-training
    of `prepare_base` is skipped; the architecture, tokenizer, dataset and
    max_length are the workflow's.
    """
    from pipeline.demo import text as demo
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint

    root = Path(root)
    tok = demo.build_tokenizer()
    model = demo.build_model(tok, seed=0)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    paths = demo.build_dataset(root / "data")
    tokenizer = load_tokenizer(root / "model")
    fp = tokenizer_fingerprint(root / "model")
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=max_length,
                      too_long="error", fingerprint=fp, split=split)
    return {"model": root / "model", "train": root / "train.safetensors", "val": root / "val.safetensors"}


def workflow_overrides() -> list[str]:
    """`train.overrides` of config/config.yaml: the trainer settings of the default run."""
    import yaml

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    return list(cfg["train"]["overrides"])


# The throughput-drop alert is off in benchmark runs: on a shared machine other jobs trigger it, and
# the evaluation + checkpoint it starts would land inside the measured updates.
BENCH_OVERRIDES = ["alerts.tps_drop_fraction=0"]


def resolved_config(overrides: list[str]) -> str:
    """config/train/ with these overrides, resolved as the workflow resolves it (the text `plan` takes)."""
    from pipeline import config as train_config

    return train_config.to_yaml(train_config.resolve(REPO / "config" / "train", "config", overrides))


def plan_run(root: Path, default: dict, *, total: int, overrides: list[str], fraction: float = 0.05,
             chunks: int = 2, single_stage: bool = False) -> dict:
    """plan.json + train_config.yaml through `python -m pipeline plan` (in process).

    `single_stage` replaces the plan's stages by one stage `all` over every
    update (what one uninterrupted process computes).
    """
    from pipeline.planning import plan as planner

    root.mkdir(parents=True, exist_ok=True)
    if single_stage:  # any valid split: the stages are replaced below
        fraction, chunks = 0.5, 1
    base = [f"model.path={default['model']}", f"{KEY_TRAIN_CACHE}={default['train']}",
            f"{KEY_VAL_CACHE}={default['val']}"]
    args = ["--total-updates", str(total), "--pilot-fraction", str(fraction), "--num-chunks", str(chunks),
            "--resolved-config", resolved_config(_overriding([*base, *BENCH_OVERRIDES, *overrides],
                                                             SMOKE_OVERRIDES if SMOKE else [])),
            "--export-weights", "raw", "--out-plan", str(root / "plan.json"), "--out-config", str(root / "train_config.yaml")]
    from contextlib import redirect_stdout
    import io

    with redirect_stdout(io.StringIO()):
        assert planner.main(args) == 0
    plan = json.loads((root / "plan.json").read_text())
    if single_stage:
        plan["stages"] = [{"name": "all", "start": 0, "end": total}]
        (root / "plan.json").write_text(json.dumps(plan))
    return {"plan": root / "plan.json", "config": root / "train_config.yaml",
            "stages": [s["name"] for s in plan["stages"]]}


def _overriding(overrides: list[str], last: list[str]) -> list[str]:
    """`overrides` + `last`, `last` replacing any override of the same key (Hydra refuses a key twice)."""
    keys = {o.split("=", 1)[0] for o in last}
    return [o for o in overrides if o.split("=", 1)[0] not in keys] + last


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("SFT_FAULTS", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# --- result files ---------------------------------------------------------------------------------


def run_child(cmd: list[str], work: Path, threads: int, label: str, extra_env: dict | None = None) -> list[float] | None:
    """Run one benchmark child with `threads` torch threads, its output in work/log.txt.

    Exits with the log's tail if it fails; returns the load average at its start.
    """
    env = {**child_env(), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **(extra_env or {})}
    load = load_average()
    with open(work / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{label} failed ({proc.returncode}); log:\n{(work / 'log.txt').read_text()[-4000:]}")
    return load


def write_results(name: str, md_lines: list[str], data: dict, out_dir: Path = RESULTS) -> None:
    """`<name>.md` and `<name>.json` in `out_dir`; a smoke run's are marked as such and never go to bench/results/."""
    if SMOKE:
        if _inside(Path(out_dir), RESULTS):
            raise SystemExit(f"smoke run: refusing to write {name} into {RESULTS}")
        md_lines = [SMOKE_BANNER, "", *md_lines]
        data = {**data, "smoke": True}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text("\n".join(md_lines).rstrip() + "\n")
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print("\n".join(md_lines))
    print(f"\nwrote {out_dir / (name + '.md')} and {name}.json", file=sys.stderr)


# --- smoke mode -----------------------------------------------------------------------------------

# `--smoke` runs a script end to end on tiny sizes in seconds, so that tests/test_bench_smoke.py
# notices a benchmark that stopped running (a renamed trainer function, a config key, a changed
# library) long before someone needs its figures. The figures of a smoke run measure nothing.
SMOKE = False
# A smoke run's trainer runs take small batches: a few sequences per update is enough to run every line.
SMOKE_OVERRIDES = ["optim.global_batch=4", "optim.micro_batch=2"]
SMOKE_BANNER = "**Smoke run** (`--smoke`: tiny sizes, a check that the benchmark runs; these figures measure nothing)."
SMOKE_HELP = ("tiny sizes, seconds: check that the benchmark runs end to end; results go to the given output "
              "path if it is outside bench/results/, else to a new temp dir (never bench/results/, RESULTS.md)")


def add_smoke(ap) -> None:
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)


def smoke(args, out: str = "out_dir", **tiny) -> bool:
    """If `args.smoke`: set the `tiny` settings on `args` and move `args.<out>` (a dir or a file) out of
    bench/results/ into a new temp dir (a path the user gave outside it is kept). Returns args.smoke."""
    global SMOKE
    if not args.smoke:
        return False
    SMOKE = True
    for key, value in tiny.items():
        setattr(args, key, value)
    path = Path(getattr(args, out)).resolve()
    if _inside(path, RESULTS) or path == RESULTS_MD:
        tmp = Path(tempfile.mkdtemp(prefix="bench_smoke_"))
        setattr(args, out, tmp if path == RESULTS else tmp / path.name)
    print(f"smoke run: results go to {getattr(args, out)}", file=sys.stderr)
    return True


def _inside(path: Path, root: Path) -> bool:
    path, root = Path(path).resolve(), Path(root).resolve()
    return path == root or root in path.parents
