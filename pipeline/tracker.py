"""Experiment trackers (MLflow, Weights & Biases): one tracker run per training run.

Settings come from the workflow config's `tracker:` section, which the rules pass
to every job as environment variables (`PIPELINE_TRACKER_*`, see `settings_from_env`).
They are not trainer hyperparameters on purpose: turning tracking on or off must
not change the resolved trainer config (which would retrain every stage).

    PIPELINE_TRACKER_KIND      none | mlflow | wandb (default none: nothing is imported or logged)
    PIPELINE_TRACKER_URI       MLflow tracking URI / W&B base URL (empty: the library's default)
    PIPELINE_TRACKER_PROJECT   MLflow experiment / W&B project (default "sft")
    PIPELINE_TRACKER_ENTITY    W&B entity (team or user)
    PIPELINE_TRACKER_TAGS      comma-separated key=value tags
    PIPELINE_TRACKER_RUN_NAME  run name (default: the run dir's name)

One tracker run per training run: its id lives in `<run>/tracker/run.json`
(created once, atomically, keyed on the resolved config's sha256), so every stage
job, retry, preemption and the evaluate / smoke / summarize jobs log to the same
run. A sweep variant (`<run>/variants/<name>/`) is a run of its own, grouped under
the sweep (W&B group, MLflow parent run).

Exactly once: per-update metrics are taken from the stage's metrics.jsonl and sent
only up to the newest *committed* checkpoint (the resume point), right after it is
committed, and at stage end. A per-stage watermark (`<run>/tracker/logged/<stage>.json`)
says what was sent; a retry re-trains (and later sends) only what lies beyond it.

Never fails training: every call is guarded; the first failure (unreachable
server, missing package) is recorded in `<run>/tracker/errors.jsonl` (the summary
reports it) and the tracker goes quiet for the rest of the job. Unsent metrics stay
in metrics.jsonl behind the watermark: the next job that reaches the tracker sends them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import layout

log = logging.getLogger("pipeline.tracker")

KINDS = ("none", "mlflow", "wandb")
ENV_PREFIX = "PIPELINE_TRACKER_"
DIR = layout.TRACKER_DIR
ERRORS = "errors.jsonl"
TIMEOUT_S = 10


@dataclass
class Settings:
    kind: str = "none"
    uri: str = ""
    project: str = "sft"
    entity: str = ""
    tags: dict = field(default_factory=dict)
    run_name: str = ""


def settings_from_env(env=None) -> Settings:
    env = os.environ if env is None else env
    get = lambda k, d="": env.get(ENV_PREFIX + k, d).strip()  # noqa: E731
    tags = dict(t.split("=", 1) for t in get("TAGS").split(",") if "=" in t)
    kind = get("KIND", "none").lower() or "none"
    if kind not in KINDS:
        log.warning("%sKIND=%r: expected %s; tracking off", ENV_PREFIX, kind, " | ".join(KINDS))
        kind = "none"
    return Settings(kind, get("URI"), get("PROJECT", "sft") or "sft", get("ENTITY"), tags, get("RUN_NAME"))


def env_for(section: dict) -> dict[str, str]:
    """The environment variables for a workflow config `tracker:` section (what the rules export)."""
    if not section or section.get("kind", "none") == "none":
        return {}
    tags = section.get("tags") or {}
    return {ENV_PREFIX + "KIND": section["kind"], ENV_PREFIX + "URI": section.get("uri") or "",
            ENV_PREFIX + "PROJECT": section.get("project") or "sft", ENV_PREFIX + "ENTITY": section.get("entity") or "",
            ENV_PREFIX + "TAGS": ",".join(f"{k}={v}" for k, v in tags.items()),
            ENV_PREFIX + "RUN_NAME": section.get("run_name") or ""}


def errors(run_dir: Path) -> list[dict]:
    """The tracker failures recorded for a run (for the summary)."""
    path = Path(run_dir) / DIR / ERRORS
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _flatten(obj, prefix="") -> dict:
    out = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN: not a loggable value


def record_metrics(record: dict) -> dict[str, float]:
    """The tracker metrics of one metrics.jsonl line (an update, or an in-stage evaluation)."""
    if record.get("event") == "eval":
        kind = record.get("kind", "full")
        return {f"eval_{kind}/{k[4:]}": float(v) for k, v in record.items() if k.startswith("val_") and _numeric(v)}
    if "event" in record:
        return {}
    out = {}
    for k, v in record.items():
        if k == "step":
            continue
        if isinstance(v, bool):
            v = float(v)
        if _numeric(v):
            out[f"train/{k}"] = float(v)
    return out


class Tracker:
    """The facade the jobs use; every method is a no-op when off or after a failure, and never raises."""

    def __init__(self, run_dir: Path, settings: Settings | None = None, *, job: str = ""):
        self.run_dir = Path(run_dir)
        self.tree = layout.RunTree(self.run_dir)
        self.settings = settings or settings_from_env()
        self.job = job
        self.backend = None
        self.failed = False
        self._offsets: dict[str, tuple[int, int]] = {}  # stage -> (byte offset, watermark) read so far

    @property
    def enabled(self) -> bool:
        return self.settings.kind != "none" and not self.failed

    @property
    def dir(self) -> Path:
        return self.tree.tracker

    def _fail(self, what: str, err: BaseException) -> None:
        self.failed = True
        text = f"{type(err).__name__}: {err}"[:2000]
        log.warning("tracker %s unavailable (%s): %s; training goes on, metrics stay in metrics.jsonl",
                    self.settings.kind, what, text)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with (self.dir / ERRORS).open("a") as f:
                f.write(json.dumps({"time": time.time(), "kind": self.settings.kind, "uri": self.settings.uri,
                                    "job": self.job, "what": what, "error": text}) + "\n")
        except OSError:
            pass
        try:
            if self.backend is not None:
                self.backend.abort()
        except Exception:  # noqa: BLE001
            pass
        self.backend = None

    def _guard(self, what: str, fn):
        if not self.enabled:
            return None
        try:
            if self.backend is None:
                self.backend = self._open()
            return fn(self.backend)
        except Exception as err:  # noqa: BLE001 - a tracker must never fail the job
            self._fail(what, err)
            return None

    # --- the run --------------------------------------------------------------------------

    def _config(self) -> tuple[dict, str]:
        path = self.tree.train_config
        if not path.is_file():
            return {}, ""
        text = path.read_text()
        from omegaconf import OmegaConf

        return _flatten(OmegaConf.to_container(OmegaConf.create(text))), hashlib.sha256(text.encode()).hexdigest()

    def _group(self) -> str | None:
        """The sweep a variant run belongs to (`<sweep>/variants/<name>`), else None."""
        sweep = layout.sweep_of(self.tree)
        return sweep.root.name if sweep else None

    def _open(self):
        params, config_sha = self._config()
        state_path = self.dir / "run.json"
        state = _read_json(state_path)
        if state and (state.get("kind") != self.settings.kind or state.get("config_sha256") != config_sha):
            state = None  # another tracker, or a changed config: a new training run
        name = self.settings.run_name or (f"{self._group()}/{self.run_dir.name}" if self._group() else self.run_dir.name)
        backend = {"mlflow": MlflowBackend, "wandb": WandbBackend}[self.settings.kind](self.settings, self.dir)
        run_id = backend.open(state["run_id"] if state else None, name=name, group=self._group(),
                              sweep_dir=layout.sweep_of(self.tree).root if self._group() else None)
        if not state:
            # the first job to create the run records it (before anything else can fail); a job racing
            # it created a run of its own, which it uses this once
            self.dir.mkdir(parents=True, exist_ok=True)
            state = {"kind": self.settings.kind, "run_id": run_id, "config_sha256": config_sha, "name": name,
                     "params_logged": False}
            try:
                os.close(os.open(self.dir / "run.json.lock", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                _write_json(state_path, state)
                os.unlink(self.dir / "run.json.lock")
            except FileExistsError:
                pass
        if not state.get("params_logged"):
            backend.log_params(params)
            if state["run_id"] == run_id:
                _write_json(state_path, {**state, "params_logged": True})
        return backend

    @property
    def run_id(self) -> str | None:
        state = _read_json(self.dir / "run.json")
        return state["run_id"] if state else None

    # --- what the jobs log ----------------------------------------------------------------------

    def _watermark_path(self, stage: str) -> Path:
        return self.dir / "logged" / f"{stage}.json"

    def _watermark(self, stage: str, run_id: str) -> dict:
        mark = _read_json(self._watermark_path(stage))
        return mark if mark and mark.get("run_id") == run_id else {"run_id": run_id, "step": -1, "complete": False}

    def sync_metrics(self, stage: str, metrics: Path, *, upto: int | None = None, index: int = 0,
                     start: int = 0, final: bool = False) -> None:
        """Send the lines of `metrics` (a stage's metrics.jsonl) with step in (watermark, upto]; the
        first send of a stage marks its boundary (`stage_start` = the stage's index, at `start`)."""
        self._guard(f"logging {stage} metrics", lambda b: self._sync(b, stage, Path(metrics), upto, index, start, final))

    def _sync(self, backend, stage, metrics, upto, index, start, final) -> None:
        mark = self._watermark(stage, backend.run_id)
        if mark["complete"] or not metrics.is_file():
            return
        offset, seen = self._offsets.get(stage, (0, None))
        if seen != mark["step"]:
            offset = 0
        points, top = [], mark["step"]
        with metrics.open("rb") as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only (the loop may be appending)
        consumed = offset
        pos = 0
        for raw in data[:end].split(b"\n")[:-1]:
            line_end = pos + len(raw) + 1
            try:
                record = json.loads(raw)
            except ValueError:
                pos = line_end
                continue
            step = int(record.get("step", -1))
            if upto is not None and step > upto:
                break
            pos = line_end
            consumed = offset + pos
            if step <= mark["step"]:
                continue
            points += [(k, v, step) for k, v in record_metrics(record).items()]
            top = max(top, step)
        if mark["step"] < 0 and (points or final):
            points.insert(0, ("stage_start", float(index), start))
            backend.set_tags({f"stage.{stage}": f"index {index}, from update {start}"})
        if points:
            backend.log_metrics(points)
        mark = {"run_id": backend.run_id, "step": top, "complete": final}
        _write_json(self._watermark_path(stage), mark)
        self._offsets[stage] = (consumed, top)

    def sync_stages(self, stages: list[dict]) -> None:
        """Catch up the finished stages of the plan (`plan.json`'s stages; each stage's published
        metrics.jsonl): what an earlier job could not send is sent now."""
        for i, st in enumerate(stages):
            metrics = self.tree.stage(st["name"]) / layout.STAGE_METRICS
            if metrics.is_file():
                self.sync_metrics(st["name"], metrics, index=i, start=st["start"], final=True)

    def log_evaluation(self, result: dict) -> None:
        """An `evaluate` job's rows (raw and each EMA rate) at the stage's final update; once per stage."""
        stage = result.get("stage", "?")
        step = int(result.get("step", 0))

        def send(backend):
            marker = self.dir / "logged" / f"eval_{stage}.json"
            if (_read_json(marker) or {}).get("run_id") == backend.run_id:
                return
            points = []
            for row in result.get("rows", []):
                for k, v in row.items():
                    if k != "weights" and _numeric(v):
                        points.append((f"eval/{row['weights']}/{k}", float(v), step))
            if points:
                backend.log_metrics(points)
            _write_json(marker, {"run_id": backend.run_id})

        self._guard(f"logging evaluation of {stage}", send)

    def log_final(self, metrics: dict[str, float], *, marker: str = "final") -> None:
        """Metrics of the finished run (the smoke test's exact match) at the run's last update; once."""
        step = self.last_update()
        self.log_once([(k, v, step) for k, v in metrics.items()], marker=marker, what="final metrics")

    def last_update(self) -> int:
        """The run's last update (plan.json's total_updates; 0 before it is planned)."""
        return int((_read_json(self.tree.plan) or {}).get("total_updates", 0))

    def log_once(self, points: list[tuple[str, float, int]], *, marker: str, what: str = "metrics") -> None:
        """(name, value, update) points, sent once per tracker run: `tracker/logged/<marker>.json` records
        that they were (a job that runs again, or another job with the same marker, sends nothing)."""
        def send(backend):
            path = self.dir / "logged" / f"{marker}.json"
            if (_read_json(path) or {}).get("run_id") == backend.run_id:
                return
            backend.log_metrics([(k, float(v), step) for k, v, step in points if _numeric(v)])
            _write_json(path, {"run_id": backend.run_id})

        self._guard(f"logging {what}", send)

    def log_artifacts(self, paths) -> None:
        def send(backend):
            for p in paths:
                if Path(p).is_file():
                    backend.log_artifact(Path(p))

        self._guard("uploading artifacts", send)

    def close(self) -> None:
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception as err:  # noqa: BLE001
                self._fail("closing", err)
            self.backend = None


# --- backends ---------------------------------------------------------------------------------


class MlflowBackend:
    def __init__(self, settings: Settings, state_dir: Path):
        # Never wait on an unreachable server: no retries, short timeouts.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(TIMEOUT_S))
        from mlflow.tracking import MlflowClient

        self.settings = settings
        self.client = MlflowClient(tracking_uri=settings.uri or None)
        self.run_id = None

    def _experiment(self) -> str:
        exp = self.client.get_experiment_by_name(self.settings.project)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(self.settings.project)
        except Exception:  # noqa: BLE001 - created meanwhile by a parallel job
            return self.client.get_experiment_by_name(self.settings.project).experiment_id

    def open(self, run_id, *, name, group, sweep_dir) -> str:
        if run_id is not None:
            self.client.get_run(run_id)  # reachable, and the run exists
            self.run_id = run_id
            return run_id
        exp = self._experiment()
        tags = {**self.settings.tags}
        if group:
            tags["mlflow.parentRunId"] = self._parent(exp, group, Path(sweep_dir))
            tags["sweep"] = group
        self.run_id = self.client.create_run(exp, run_name=name, tags=tags).info.run_id
        return self.run_id

    def _parent(self, exp: str, group: str, sweep_dir: Path) -> str:
        path = sweep_dir / DIR / "parent.json"
        state = _read_json(path)
        if state:
            return state["run_id"]
        lock = path.with_name("parent.json.lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # another variant is creating it
            for _ in range(100):
                time.sleep(0.1)
                if (state := _read_json(path)):
                    return state["run_id"]
            raise RuntimeError(f"{path} was never written")
        run = self.client.create_run(exp, run_name=group, tags={**self.settings.tags, "sweep": group})
        self.client.set_terminated(run.info.run_id)
        _write_json(path, {"run_id": run.info.run_id})
        return run.info.run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def set_tags(self, tags: dict) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_metrics(self, points) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, v, now, step) for k, v, step in points]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        pass  # the run stays open across jobs; it holds no client-side state

    abort = close


class WandbBackend:
    """W&B: `wandb.init(id=..., resume="allow")` per job. In offline mode (WANDB_MODE=offline)
    each job writes a run directory under `<run>/tracker/wandb/`, all with the run's one id;
    `wandb sync` uploads them as one run."""

    def __init__(self, settings: Settings, state_dir: Path):
        import wandb

        self.wandb, self.settings, self.dir = wandb, settings, state_dir
        self.run = None
        self.run_id = None
        if settings.uri:
            os.environ.setdefault("WANDB_BASE_URL", settings.uri)

    def open(self, run_id, *, name, group, sweep_dir) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            project=self.settings.project, entity=self.settings.entity or None, id=run_id or uuid.uuid4().hex[:12],
            resume="allow", name=name, group=group, tags=[f"{k}={v}" for k, v in self.settings.tags.items()] or None,
            dir=str(self.dir),
            # this run's own object even while another run is active in the process (wandb's default
            # there hands back that other run, and this run's metrics would be logged to it)
            reinit="create_new",
            settings=self.wandb.Settings(init_timeout=TIMEOUT_S * 3, silent=True, console="off"),
        )
        self.run.define_metric("update")
        self.run.define_metric("*", step_metric="update")
        self.run_id = self.run.id
        return self.run_id

    def log_params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def set_tags(self, tags: dict) -> None:
        self.run.summary.update(tags)

    def log_metrics(self, points) -> None:
        by_step: dict[int, dict] = {}
        for k, v, step in points:
            by_step.setdefault(step, {})[k] = v
        for step in sorted(by_step):
            self.run.log({"update": step, **by_step[step]})

    def log_artifact(self, path: Path) -> None:
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self.run.finish()

    def abort(self) -> None:
        try:
            self.run.finish(exit_code=1)
        except Exception:  # noqa: BLE001
            pass
