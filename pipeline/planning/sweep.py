"""A sweep's variants: named sets of trainer overrides, from a grid, a list, or both.

    sweep:
      grid:                         # every combination, named after its values
        optim.lr: [1e-3, 2e-3]
        lora.r: [8, 16]
      variants:                     # named by hand
        no-ema: [ema.rates=[]]      # (all variants must agree on keeping EMA or not)
      prune: {at: [pilot], keep: 2} # optional: after the pilot only the 2 best go on

Each variant is a run of its own under `results/<run>/variants/<name>/`. A grid
variant's name comes from its values alone (`lr-0.001_r-8`: the last component
of each key, the whole key where two would clash), so adding a value to the
grid adds variants without renaming the others, and removing one leaves the
others' directories as they are. Pure functions of the config, importable
without torch (the Snakefile uses them when it loads).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

from pipeline.errors import UserError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Trainer keys the workflow sets for every variant alike (the shared base model and token caches).
SHARED_KEYS = ("model.path", "model.tokenizer", "tokens.train_cache", "tokens.mix", "tokens.val_cache")


def variants(sweep: dict | None) -> dict[str, list[str]]:
    """name -> trainer overrides (Hydra syntax) of every variant; {} when there is no sweep."""
    sweep = sweep or {}
    grid, named = sweep.get("grid") or {}, sweep.get("variants") or {}
    out: dict[str, list[str]] = {}
    problems = []
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)) if keys else []:
        name = "_".join(f"{_short(key, keys)}-{_slug(value)}" for key, value in zip(keys, values))
        out[name] = [f"{key}={_hydra(value)}" for key, value in zip(keys, values)]
    for name, overrides in named.items():
        if not _NAME.match(str(name)):
            problems.append(f"sweep.variants: {name!r} is not a usable name (letters, digits, '.', '_', '-')")
        elif name in out:
            problems.append(f"sweep.variants: {name!r} is also the name of a grid variant")
        else:
            out[str(name)] = [str(o) for o in overrides]
    for name, overrides in out.items():
        shared = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in SHARED_KEYS]
        if shared:
            problems.append(f"sweep variant {name!r}: {shared} would change what all variants share "
                            "(the base model and the tokenized data are set by the workflow config)")
    if problems:
        raise UserError("\n  ".join(["problems in the sweep config:", *problems]))
    return out


def prune_points(sweep: dict | None, stages: list[str]) -> tuple[list[str], int | None]:
    """(stages after which only the best `keep` variants go on, keep); ([], None) without pruning."""
    prune = (sweep or {}).get("prune")
    if not prune:
        return [], None
    at = list(prune.get("at") or [])
    unknown = [s for s in at if s not in stages[:-1]]
    if unknown:
        raise UserError(f"sweep.prune.at: {unknown} are not stages a run goes on from (stages: {stages[:-1]})")
    return sorted(at, key=stages.index), int(prune["keep"])


def _short(key: str, keys: list[str]) -> str:
    last = key.rsplit(".", 1)[-1]
    return last if sum(k.rsplit(".", 1)[-1] == last for k in keys) == 1 else key


def _slug(value) -> str:
    """A value as it appears in a name: 0.001, 16, true, 0.9-0.98 for a list."""
    if isinstance(value, (list, tuple)):
        return "-".join(_slug(v) for v in value) or "none"
    text = _hydra(value)
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "x"


def _hydra(value) -> str:
    """A YAML value as a Hydra override value."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    return str(value)


# --- prune points: which variants go on (the `sweep-prune` command writes the decision) ---

def score(eval_file: Path) -> float:
    """The lowest validation loss over the weight sets of one stage evaluation (nan if none)."""
    rows = json.loads(Path(eval_file).read_text())["rows"]
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
    return min(losses) if losses else math.nan


def prune(stage: str, keep: int, evals: dict[str, Path]) -> dict:
    """The decision at one prune point: the `keep` best variants go on, the others stop here."""
    scores = {name: score(path) for name, path in evals.items()}
    order = sorted(scores, key=lambda n: (math.isnan(scores[n]), scores[n]))  # stable: ties keep listing order
    kept = order[:keep]
    cut = scores[kept[-1]] if kept else math.nan
    stopped = {name: f"pruned after {stage}: rank {order.index(name) + 1} of {len(order)} by validation loss "
                     f"({scores[name]:.4f}; the last kept had {cut:.4f}), sweep.prune.keep={keep}"
               for name in order[keep:]}
    return {"stage": stage, "keep": keep, "scores": scores, "ranking": order, "kept": kept, "stopped": stopped}
