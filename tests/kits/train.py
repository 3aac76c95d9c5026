"""Helpers to plan runs and run training stages in fresh processes (used by tests/train)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def pipeline_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("SFT_FAULTS", None)
    env.update(extra or {})
    return env


@dataclass
class Run:
    root: Path
    plan: Path
    config: Path

    def stage_dir(self, stage: str) -> Path:
        return self.root / "stages" / stage

    def scratch(self, stage: str) -> Path:
        return self.root / "work" / stage

    def train(self, stage: str, init: str | None = None, *, faults: dict | None = None, check: bool = True,
              nproc: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run one stage in a fresh process (under torchrun when nproc is given)."""
        args = ["--plan", self.plan, "--config", self.config, "--stage", stage,
                "--scratch", self.scratch(stage), "--out", self.stage_dir(stage)]
        if init:
            args += ["--init", self.stage_dir(init) / "checkpoint"]
        if nproc:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "pipeline", "train", *map(str, args)]
        else:
            cmd = [sys.executable, "-m", "pipeline", "train", *map(str, args)]
        env = pipeline_env({"SFT_FAULTS": json.dumps(faults)} if faults else None)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"stage {stage} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc

    def chain(self, stages: list[str], **kw) -> None:
        prev = None
        for s in stages:
            self.train(s, prev, **kw)
            prev = s


def resolved_config(overrides) -> list[str]:
    """`--resolved-config <text>` for `python -m pipeline plan`: config/train/ with these overrides,
    resolved as the workflow resolves it when it loads (`pipeline.config.resolve`, then `to_yaml`)."""
    from pipeline import config as train_config

    cfg = train_config.resolve(REPO / "config" / "train", "config", list(overrides))
    return ["--resolved-config", train_config.to_yaml(cfg)]


def make_run(root: Path, tiny: dict, *, total: int, fraction: float = 0.2, chunks: int = 2,
             overrides: list[str] = (), single_stage: bool = False) -> Run:
    """Plan + resolved config for a run; `single_stage` plans one stage `all` over every update."""
    from pipeline.planning import plan as planner

    root.mkdir(parents=True, exist_ok=True)
    base = [f"model.path={tiny['model']}", f"tokens.train_cache={tiny['train']}", f"tokens.val_cache={tiny['val']}",
            "optim.global_batch=8", "optim.micro_batch=4", "optim.lr=1e-3", "ema.rates=[0.9,0.99]",
            "checkpoint.save_every=2", "checkpoint.keep_last=3", "lora.r=4", "lora.alpha=8", "validation.batch_size=8",
            # Dropout on (the default is 0): its masks draw from the RNG streams that chunked, resumed and
            # checkpointed runs must carry on exactly, so the bitwise comparisons cover those streams.
            "lora.dropout=0.05"]
    args = ["--total-updates", str(total), "--pilot-fraction", str(fraction), "--num-chunks", str(chunks),
            *resolved_config([*base, *overrides]),
            "--export-weights", "raw", "--out-plan", str(root / "plan.json"), "--out-config", str(root / "train_config.yaml")]
    assert planner.main(args) == 0
    if single_stage:
        plan = json.loads((root / "plan.json").read_text())
        plan["stages"] = [{"name": "all", "start": 0, "end": total}]
        (root / "plan.json").write_text(json.dumps(plan))
    return Run(root, root / "plan.json", root / "train_config.yaml")


def train_and_export(run: Run, base: Path, export: Path, stage_name: str = "all") -> Path:
    """Run one stage of `run` in this process (the command the workflow's rule runs), then consolidate its
    final adapter to `export`/adapter (a PEFT dir), which is returned."""
    from pipeline.export.consolidate import consolidate
    from pipeline.train import stage

    out = run.stage_dir(stage_name)
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", stage_name,
                       "--scratch", str(run.scratch(stage_name)), "--out", str(out)]) == 0
    consolidate(out / "checkpoint", base, out_adapter=export / "adapter", models="main")
    return export / "adapter"


def merge_and_verify(base: Path, adapter: Path, export: Path, train_config: Path | None = None) -> dict:
    """Merge `adapter` into `base` (`export`/merged) and return `verify_merge`'s report on it."""
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import verify

    merge_dirs(base, adapter, export / "merged")
    return verify(base, adapter, export / "merged", export / "verification.json", device="cpu",
                  train_config=train_config)


def stage_names(run: Run) -> list[str]:
    return [s["name"] for s in json.loads(run.plan.read_text())["stages"]]


def checkpoint_digests(ckpt: Path) -> dict[str, str]:
    """sha256 of every weight / optimizer file of a checkpoint (not RNG or progress metadata)."""
    import hashlib

    out = {}
    for path in sorted(ckpt.rglob("*.safetensors")):
        rel = str(path.relative_to(ckpt))
        if "rng_rank" in rel:
            continue
        out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def step_losses(stage_dirs: list[Path]) -> list[tuple[int, float]]:
    rows = []
    for d in stage_dirs:
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "loss" in r:
                rows.append((r["step"], r["loss"]))
    return rows


def final_digests(run: Run, stage: str = "all") -> dict[str, str]:
    """`checkpoint_digests` of one stage's final checkpoint."""
    return checkpoint_digests(run.stage_dir(stage) / "checkpoint")


def chain_and_compare(run: Run, reference: Run) -> list[str]:
    """Train `run` as pilot, chunk01, chunk02, tail (one process each) and check it computed what
    `reference` did in one stage: the adapter, every EMA shadow and the optimizer state byte for
    byte, and every update's loss. Returns the stage names."""
    names = stage_names(run)
    assert names == ["pilot", "chunk01", "chunk02", "tail"]
    run.chain(names)
    digests = final_digests(run, "tail")
    assert {"adapter/adapter_model.safetensors", "ema/0.9/adapter_model.safetensors",
            "ema/0.99/adapter_model.safetensors", "training_state/optimizer.safetensors"} <= set(digests)
    assert digests == final_digests(reference)
    assert step_losses([run.stage_dir(s) for s in names]) == step_losses([reference.stage_dir("all")])
    return names


def wait_for_step(path: Path, step: int, proc, timeout: float = 120) -> bool:
    """Wait until `path` (a metrics.jsonl) logs update `step`; False if `proc` exits first."""
    import json
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        if path.is_file():
            lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
            if any(r.get("step", 0) >= step for r in lines):
                return True
        time.sleep(0.02)
    raise TimeoutError(f"update {step} never logged")
