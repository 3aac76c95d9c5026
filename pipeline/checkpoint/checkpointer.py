"""A training stage's checkpoints: where it starts, what it saves, what it publishes.

One object per stage owns all of it:

* the start point: the newest valid checkpoint in the stage's scratch dir
  written for the same computation (a resumed attempt), else the previous
  stage's final checkpoint (`--init`), else nothing (a fresh adapter);
* `restore`: weights, EMA shadows and optimizer through the parallelism
  strategy, then scheduler, scaler, progress and this rank's RNG;
* `save`: a snapshot of all loop state (CPU copies, taken on the training
  thread) written by rank 0 on a background thread, atomically, MANIFEST last
  (`pipeline.checkpoint.io`); periodic, on alerts, on preemption, at the end;
* the run's best weights, written when an evaluation improves on them;
* `publish`: the final checkpoint, the metrics and the best weights become the
  stage's declared output dir in one rename; the scratch dir is then removed.

The identity of a stage's computation is a fingerprint of (resolved config,
plan, stage, input checkpoint's MANIFEST): a scratch checkpoint with another
fingerprint (a changed hyperparameter, a retrained previous stage) is stale and
never resumed. All methods are collective (every rank calls them) unless noted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from pipeline import layout
from pipeline.checkpoint import io as ckpt_io
from pipeline.checkpoint.reader import open_checkpoint
from pipeline.checkpoint.state import Snapshot, capture_rng, write_snapshot, write_weights
from pipeline.distributed import Dist, barrier, broadcast_object, gather_objects, print0
from pipeline.errors import UserError
from pipeline.storage import publish

log = logging.getLogger("pipeline.train")

_HASHES = ".sha256-rank{rank:05d}.json"  # a rank's checksums of its DCP files, read by rank 0
_HASH_WAIT_S = 1800.0


def _rank_files(rank: int) -> str:
    """The files DCP's FileSystemWriter writes for one rank."""
    return f"__{rank}_*"


def fingerprint(config_text: str, plan: dict, stage: str, init: Path | None) -> str:
    """Identity of a stage's computation: scratch checkpoints of another one are stale."""
    h = hashlib.sha256()
    h.update(config_text.encode())
    h.update(json.dumps(plan, sort_keys=True).encode())
    h.update(stage.encode())
    if init is not None:
        h.update((init / layout.MANIFEST_FILE).read_bytes())
    return h.hexdigest()


class Checkpointer:
    def __init__(self, parts, strategy, d: Dist, *, scratch: Path, out: Path, stage: str,
                 fingerprint: str, config_text: str, global_batch: int, cfg, hooks):
        """`parts`: the stage's `pipeline.train.parts.TrainingParts`; `cfg`: the trainer's CheckpointConfig
        (save_every, keep_last, async_save)."""
        self.parts, self.strategy, self.d = parts, strategy, d
        self.scratch, self.out, self.stage = Path(scratch), Path(out), stage
        self.fingerprint, self.config_text, self.cfg, self.hooks = fingerprint, config_text, cfg, hooks
        self.global_batch = global_batch
        self.writer = ckpt_io.AsyncWriter(enabled=cfg.async_save)
        self.last_save = -1
        self.on_commit = None  # called with the step after each checkpoint is committed (on the writer thread)
        # Names the FSDP staging dir, which every rank writes and rank 0 commits.
        self._pid0 = gather_objects(d, os.getpid())[0]

    # --- where the stage starts -------------------------------------------------------

    def resume_point(self) -> Path | None:
        """The newest valid scratch checkpoint of this very computation.

        Rank 0 reads and checks the candidates (every file against its sha256) and
        tells the others: all ranks resume from the same one, and a checkpoint is
        hashed once, not once per rank.
        """
        def accept(manifest: dict) -> str | None:
            if manifest.get("fingerprint") != self.fingerprint:
                return "written for another config, plan or input checkpoint"
            return None

        found = ckpt_io.latest_valid(self.scratch, accept) if self.d.is_main else None
        return broadcast_object(self.d, found)

    def restore(self, source: Path) -> tuple[dict, dict | None]:
        """Load `source` into the parts; returns (its progress, this rank's RNG state or None)."""
        ckpt = open_checkpoint(source)
        if ckpt.sharded != self.strategy.sharded:
            raise UserError(f"{source} was written {'with' if ckpt.sharded else 'without'} FSDP sharding; "
                            f"this stage runs {'with' if self.strategy.sharded else 'without'} it "
                            f"(distributed.strategy, world size {self.d.world_size})")
        self.strategy.restore(self.parts, ckpt)
        state = ckpt.training_state(self.d.rank)
        self.parts.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.parts.scaler.load_state_dict(state["scaler"])
        return state["progress"], state["rng"]

    # --- saving --------------------------------------------------------------------------

    def save(self, state, *, wait: bool = False) -> None:
        """Checkpoint the stage after update `state.step` (a `LoopState`); `wait`: until it is on disk.

        Rank 0 writes the checkpoint; under FSDP every rank writes its own shards
        and, once they are on disk, their checksums for rank 0's MANIFEST.
        """
        step = state.step
        snap = self._snapshot(step, state.progress(stage=self.stage, samples_seen=step * self.global_batch,
                                                   world_size=self.d.world_size))
        if self.d.is_main:
            self.writer.submit(lambda: self._write(snap))
        elif snap.trained.sharded_dir is not None:
            self.writer.submit(lambda: self._hash_own_shards(snap))
        if wait:
            self.writer.wait()
            barrier(self.d)
        self.last_save = step

    def periodic_due(self, step: int, end: int) -> bool:
        every = self.cfg.save_every
        return bool(every) and step % every == 0 and step < end

    def overlapped(self, step: int) -> bool:
        """Did a checkpoint write compete with update `step` for the CPU and the disk?"""
        return self.last_save == step - 1 or self.writer.busy

    def save_preempted(self, state) -> int:
        """The save a SIGTERM / SIGUSR1 asked for; returns the exit code that makes a retry resume."""
        self.save(state, wait=True)
        self.close()
        print0(self.d, f"[{self.stage}] preempted at update {state.step}: checkpoint saved, exiting "
                       f"with code {layout.EXIT_PREEMPTED} so a retry resumes")
        return layout.EXIT_PREEMPTED

    def save_best(self, kind: str, record: dict) -> None:
        """Write the live trained weights (EMA ones: called with them swapped in) as the best `kind`."""
        tensors = self.strategy.gather_trained(self.parts)  # collective under FSDP
        if not self.d.is_main:
            return
        meta = {**record, "fingerprint": self.fingerprint}
        with publish.staged_dir(layout.best_dir(self.scratch, kind, record["step"])) as tmp:
            self._write_weights(tensors, tmp)
            (tmp / layout.BEST_META).write_text(json.dumps(meta, indent=1) + "\n")

    def close(self) -> None:
        """Wait for the write in flight (re-raising its failure). Not collective."""
        self.writer.wait()

    # --- the stage's output -----------------------------------------------------------

    def publish(self, step: int, best: dict) -> None:
        """Rank 0: the final checkpoint, metrics and best weights become the output dir, at once."""
        if not self.d.is_main:
            return
        final = layout.step_dir(self.scratch, step)
        ok, reason = ckpt_io.verify(final)
        if not ok:
            raise RuntimeError(f"final checkpoint failed verification: {reason}")
        with publish.staged_dir(self.out) as tmp:
            # Moved, not copied (a rename on one file system): a sharded checkpoint can be large.
            shutil.move(final, tmp / layout.STAGE_CHECKPOINT)
            for name in (layout.SCRATCH_METRICS, layout.ALERTS_FILE):
                if (self.scratch / name).is_file():
                    shutil.copy2(self.scratch / name, tmp / name)
            for name in (layout.TENSORBOARD_DIR, layout.PROFILE_DIR):
                if (self.scratch / name).is_dir():
                    shutil.copytree(self.scratch / name, tmp / name)
            self._copy_best(tmp, best)
        # The stage is complete: its scratch checkpoints are no longer needed.
        shutil.rmtree(self.scratch, ignore_errors=True)

    # --- internals -------------------------------------------------------------------------

    def _snapshot(self, step: int, progress: dict) -> Snapshot:
        """CPU copies of all loop state after `step` updates (all ranks call this)."""
        rngs = gather_objects(self.d, capture_rng())
        staging = None
        if self.strategy.sharded:
            self.writer.wait()  # a previous write of the same step may still be moving its staging dir
            staging = ckpt_io.staging_dir(layout.step_dir(self.scratch, step), layout.DCP_DIR, self._pid0)
        trained = self.strategy.capture(self.parts, staging)
        parts = self.parts
        return Snapshot(
            step=step,
            trained=trained,
            peft_config=parts.model.peft_config["default"] if parts.lora else None,
            model_config_json=None if parts.lora else parts.model.config.to_json_string(),
            # the lambdas are code, rebuilt from the config; LambdaLR skips None entries on load
            scheduler={**parts.scheduler.state_dict(), "lr_lambdas": [None] * len(parts.optimizer.param_groups)},
            scaler=parts.scaler.state_dict() if parts.scaler.is_enabled() else {},
            progress={**progress, **trained.progress},
            rng=rngs,
            config_yaml=self.config_text,
            manifest_extra={"fingerprint": self.fingerprint, "stage": self.stage},
        )

    def _write(self, snap: Snapshot) -> None:
        """On the writer thread (rank 0): the checkpoint dir, LATEST, pruning."""
        target = layout.step_dir(self.scratch, snap.step)
        known = self._sharded_entries(snap) if snap.trained.sharded_dir is not None else None

        def files(tmp: Path) -> None:
            write_snapshot(snap, tmp)
            self.hooks.checkpoint_written(snap.step)  # files written, MANIFEST not yet

        ckpt_io.write_checkpoint(target, snap.step, files, snap.manifest_extra, known=known)
        ckpt_io.update_latest(self.scratch, target)
        ckpt_io.prune(self.scratch, self.cfg.keep_last)
        if self.on_commit is not None:  # the resume point moved: what lies before it is durable
            self.on_commit(snap.step)

    def _hash_own_shards(self, snap: Snapshot) -> None:
        """On the writer thread of a rank > 0: once its DCP files are written, their checksums."""
        staging = snap.trained.sharded_dir
        snap.trained.pending.result()
        entries = ckpt_io.file_entries(sorted(staging.glob(_rank_files(self.d.rank))), staging)
        publish.write_json(staging / _HASHES.format(rank=self.d.rank), entries)

    def _sharded_entries(self, snap: Snapshot) -> dict[str, dict]:
        """Rank 0: MANIFEST entries of the dcp/ files, each rank's hashed by that rank (waits for them)."""
        staging = snap.trained.sharded_dir
        snap.trained.pending.result()  # every rank's files and the .metadata are written
        own = sorted(staging.glob(_rank_files(0))) + [staging / ".metadata"]
        entries = ckpt_io.file_entries(own, staging)
        deadline = time.monotonic() + _HASH_WAIT_S
        for rank in range(1, self.d.world_size):
            path = staging / _HASHES.format(rank=rank)
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank} never reported the checksums of its shards in {staging}")
                time.sleep(0.05)
            entries.update(json.loads(path.read_text()))
            path.unlink()
        return {f"{layout.DCP_DIR}/{rel}": entry for rel, entry in entries.items()}

    def _write_weights(self, tensors: dict, root: Path) -> None:
        model = self.parts.model
        write_weights(root, tensors, model.peft_config["default"] if self.parts.lora else None,
                      None if self.parts.lora else model.config.to_json_string())

    def _copy_best(self, out: Path, best: dict) -> None:
        """The best weights this stage found (if the run's record still names them)."""
        for kind in layout.BEST_KINDS:
            record = best.get(kind)
            if not record or record["stage"] != self.stage:
                continue
            src = layout.best_dir(self.scratch, kind, record["step"])
            if not (src / layout.BEST_META).is_file():
                raise RuntimeError(f"{src} is missing: the best {kind} weights of update {record['step']} were not saved")
            shutil.copytree(src, out / layout.BEST_DIR / kind)
