"""The run's schedule: how many updates each stage does, and the LR at any update.

Pure functions of the workflow config, importable without torch: the Snakefile
uses `plan_stages` to name its stages, and the trainer uses `lr_factor`. The LR
schedule, EMA and data order span the whole run; a stage is only a window
[start, end) of global update indices, which is what makes a chunked run the
same computation as one long run.

The `plan` command (`pipeline.planning.plan`) writes these stages to plan.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError

PILOT = "pilot"
TAIL = "tail"


@dataclass(frozen=True)
class Stage:
    name: str
    start: int  # first global update index (inclusive)
    end: int  # last global update index (exclusive)

    @property
    def updates(self) -> int:
        return self.end - self.start


def chunk_name(i: int, num_chunks: int) -> str:
    """chunk01..chunkNN, zero-padded to at least two digits so names sort."""
    return f"chunk{i:0{max(2, len(str(num_chunks)))}d}"


def plan_stages(total_updates: int, pilot_fraction: float, num_chunks: int) -> list[Stage]:
    """pilot = round(total * fraction); chunk = (total - pilot) // N; tail = the rest.

    15000 updates, 5%, 8 chunks -> 750 + 8 x 1781 + 2. The tail is omitted when
    nothing is left for it; every other stage must have at least one update.
    """
    problems = []
    if total_updates < 1:
        problems.append(f"schedule.total_updates={total_updates} must be >= 1")
    if not 0.0 < pilot_fraction < 1.0:
        problems.append(f"schedule.pilot_fraction={pilot_fraction} must be in (0, 1)")
    if num_chunks < 1:
        problems.append(f"schedule.num_chunks={num_chunks} must be >= 1")
    if problems:
        raise UserError("; ".join(problems))
    # round half up, as the seeds' arithmetic did (Python's round() is banker's rounding)
    pilot = int(math.floor(total_updates * pilot_fraction + 0.5))
    chunk = (total_updates - pilot) // num_chunks
    if pilot < 1 or chunk < 1:
        raise UserError(
            f"schedule: {total_updates} updates with pilot_fraction={pilot_fraction} and "
            f"num_chunks={num_chunks} leaves a pilot of {pilot} and chunks of {chunk} updates; "
            "every stage needs at least one update"
        )
    stages = [Stage(PILOT, 0, pilot)]
    for i in range(1, num_chunks + 1):
        start = pilot + (i - 1) * chunk
        stages.append(Stage(chunk_name(i, num_chunks), start, start + chunk))
    if stages[-1].end < total_updates:
        stages.append(Stage(TAIL, stages[-1].end, total_updates))
    assert stages[-1].end == total_updates and sum(s.updates for s in stages) == total_updates
    return stages


def lr_factor(step: int, total_updates: int, warmup_fraction: float, min_lr_ratio: float) -> float:
    """Linear warmup then cosine to `min_lr_ratio`, over the whole run's updates.

    `step` is the global update index (0-based); the factor applies to that update.
    """
    warmup = int(total_updates * warmup_fraction)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total_updates - warmup - 1)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def read_plan(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"plan {path} not found (the `plan` rule writes it)")
    return json.loads(path.read_text())


def stage_from_plan(plan: dict, name: str) -> tuple[Stage, Stage | None]:
    """The named stage and the one before it (None for the first)."""
    stages = [Stage(**s) for s in plan["stages"]]
    for i, stage in enumerate(stages):
        if stage.name == name:
            return stage, (stages[i - 1] if i else None)
    raise UserError(f"stage {name!r} is not in the plan (stages: {[s.name for s in stages]})")
