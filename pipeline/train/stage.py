"""Train one stage: global updates [start, end) of the run's plan.

    torchrun --standalone --nproc-per-node N -m pipeline train \
        --plan plan.json --config train_config.yaml --stage chunk01 \
        --init results/<run>/stages/pilot/checkpoint --scratch work/<run>/chunk01 \
        --out results/<run>/stages/chunk01

Where a stage starts from, in order:
  1. the newest valid checkpoint in its scratch dir written for the same
     (config, plan, stage, input checkpoint) -- a resumed attempt;
  2. the previous stage's final checkpoint (`--init`);
  3. nothing: a fresh adapter (the pilot).
Every piece of loop state is restored (weights, EMA shadows, optimizer,
scheduler, scaler, per-rank RNG, data position), so stages chained, stopped and
resumed compute what one uninterrupted run computes.

The declared output dir appears only at the very end, by rename; intra-stage
checkpoints live in the undeclared scratch dir, which Snakemake does not delete
when an attempt fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from pipeline import config as train_config
from pipeline import layout
from pipeline.checkpoint import io as ckpt_io
from pipeline.checkpoint import state as ckpt_state
from pipeline.errors import UserError
from pipeline.schedule import lr_factor, read_plan, stage_from_plan
from pipeline.train import distributed, faults, fsdp, precision as prec
from pipeline.train import model as model_setup
from pipeline.train.batches import RunSampler, collate, supervised_counts, token_loss_sum
from pipeline.train.ema import EMA
from pipeline.train.evals import StageEvaluator, publish_best
from pipeline.train.gradcheck import check_gradients_flow
from pipeline.train.monitor import Alerts, MetricsLog, Progress

log = logging.getLogger("pipeline.train")


class _Preemption:
    """SIGTERM / SIGUSR1 set a flag; the loop acts on it at the next step boundary."""

    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
        log.warning("received %s: will checkpoint and exit at the next step boundary", signal.Signals(signum).name)


def _fingerprint(cfg_text: str, plan: dict, stage: str, init: Path | None) -> str:
    """Identity of a stage's computation: scratch checkpoints of another one are stale."""
    h = hashlib.sha256()
    h.update(cfg_text.encode())
    h.update(json.dumps(plan, sort_keys=True).encode())
    h.update(stage.encode())
    if init is not None:
        h.update((init / layout.MANIFEST_FILE).read_bytes())
    return h.hexdigest()


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_stage(args: argparse.Namespace) -> int:
    d = None
    try:
        cfg = train_config.load(args.config)
        d = distributed.setup(cfg.distributed.backend, cfg.distributed.timeout_s)
        return _run(args, cfg, d)
    finally:
        distributed.teardown()


def _run(args, cfg: train_config.TrainConfig, d: distributed.Dist) -> int:
    from pipeline.data.cache import TokenCache

    # --- what to compute ------------------------------------------------------
    plan = read_plan(args.plan)
    stage, _ = stage_from_plan(plan, args.stage)
    total = plan["total_updates"]
    cfg_text = Path(args.config).read_text()
    accum = train_config.grad_accum_steps(cfg, d.world_size)
    precision = prec.choose(cfg.precision.mode, d.device)
    fault = faults.from_env(stage.name)
    init = Path(args.init) if args.init else None
    if init is not None:
        ok, reason = ckpt_io.verify(init)
        if not ok:
            raise UserError(f"input checkpoint of stage {stage.name} is not usable: {reason}")
    fingerprint = _fingerprint(cfg_text, plan, stage.name, init)
    scratch, out = Path(args.scratch), Path(args.out)

    def accept(manifest: dict) -> str | None:
        if manifest.get("fingerprint") != fingerprint:
            return "written for another config, plan or input checkpoint"
        return None

    resume = ckpt_io.latest_valid(scratch, accept)
    source = resume or init
    distributed.print0(d, f"[{stage.name}] updates {stage.start}..{stage.end} of {total}; "
                          f"start from {source or 'a fresh adapter'}; world {d.world_size}, "
                          f"accum {accum}, precision {precision.name}")

    # --- model, EMA, optimizer (construction consumes RNG: seed first) --------
    _seed_all(cfg.seed)
    dtype = prec.weights_dtype(cfg.model.dtype, precision) if cfg.lora.enabled else torch.float32
    sharded = fsdp.enabled(cfg.distributed.strategy, d)
    model = model_setup.build(cfg, dtype, fsdp.build_device(d, sharded))
    if sharded:
        # Shards are cut from each rank's own copy: those must agree before, as
        # the optimizer and EMA must see the sharded (DTensor) parameters after.
        fsdp.check_consistent_unsharded(d, [p for _, p in model_setup.trainable(model)])
        model = fsdp.shard(model, d)
    named = model_setup.trainable(model)
    names = [n for n, _ in named]
    params = [p for _, p in named]
    ema = EMA(fsdp.local_named(named) if sharded else named, cfg.ema.rates, cfg.ema.every)
    optimizer = torch.optim.AdamW(
        params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay, foreach=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, cfg.optim.warmup_fraction, cfg.optim.min_lr_ratio)
    )
    scaler = precision.scaler()

    # --- restore ---------------------------------------------------------------
    step = stage.start
    # (also the run's best eval losses, and an eval a preemption interrupted: see pipeline.train.evals)
    counters = {"tokens_seen": 0, "skipped_updates": 0, "consecutive_nonfinite": 0, "best": {}, "eval_pending": None}
    rng = None
    if source is not None:
        if ckpt_state.is_sharded(source) != sharded:
            raise UserError(f"{source} was written {'with' if ckpt_state.is_sharded(source) else 'without'} "
                            f"FSDP sharding; this stage runs {'with' if sharded else 'without'} it "
                            f"(distributed.strategy={cfg.distributed.strategy}, world {d.world_size})")
        ts = ckpt_state.read_training_state(source, d.rank)
        if sharded:  # weights, EMA shadows and optimizer state, each rank its shards
            fsdp.load_sharded(d, model, names, ema, optimizer, source / layout.DCP_DIR)
            fsdp.check_restored(d, params, ts["progress"].get("weights_checksum"), source)
        else:
            weights_dir = source / (layout.ADAPTER_DIR if cfg.lora.enabled else layout.MODEL_DIR)
            model_setup.load_trained(model, names, ckpt_state.read_weights(weights_dir), str(weights_dir))
            for rate, tag in zip(ema.rates, ema.tags):
                saved = ckpt_state.read_weights(source / layout.EMA_DIR / tag)
                ema.load(rate, model_setup.named_to_param_names(model, names, saved))
            ckpt_state.load_optimizer_state(optimizer, names, ts["optimizer_tensors"], ts["optimizer_meta"])
        scheduler.load_state_dict(ts["scheduler"])
        if ts["scaler"]:
            scaler.load_state_dict(ts["scaler"])
        step = ts["progress"]["step"]
        counters.update({k: ts["progress"][k] for k in counters if k in ts["progress"]})
        rng = ts["rng"]
        expected = range(stage.start, stage.end + 1) if resume else [stage.start]
        if step not in expected:
            raise UserError(f"{source} ends at update {step}, but stage {stage.name} starts at {stage.start}")
    if d.enabled and not sharded:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[d.local_rank] if d.device.type == "cuda" else None
        )
        distributed.check_consistent(d, params, "trained weights after restore")
    # RNG last: everything above may draw from it, and must not shift the run's stream.
    if rng is not None:
        ckpt_state.restore_rng(rng)
    else:
        _seed_all(cfg.seed * 7919 + d.rank + 1)  # fresh start (or a rank new to this run)

    # --- data ------------------------------------------------------------------
    train_cache = TokenCache(cfg.data.train)
    val_cache = TokenCache(cfg.data.val) if cfg.data.val else None
    sampler = RunSampler(len(train_cache), cfg.optim.global_batch, cfg.seed)
    counts = supervised_counts(train_cache)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    # --- bookkeeping -------------------------------------------------------------
    metrics = MetricsLog(scratch / layout.SCRATCH_METRICS, enabled=d.is_main, truncate_from=step,
                         tensorboard_dir=scratch / layout.TENSORBOARD_DIR if cfg.tensorboard else None)
    alerts = Alerts(cfg.alerts, scratch / "alerts.jsonl", enabled=d.is_main, truncate_from=step)
    progress = Progress(stage.name, stage.start, stage.end, total, enabled=d.is_main)
    writer = ckpt_io.AsyncWriter(enabled=cfg.checkpoint.async_save)
    preempt = _Preemption()
    raw_model = model.module if d.enabled and not sharded else model
    pid0 = distributed.gather_objects(d, os.getpid())[0]  # names the FSDP staging dir (rank 0 commits it)

    def snapshot(at_step: int) -> ckpt_state.Snapshot:
        """CPU copies of all loop state after `at_step` updates (all ranks call this).

        Under FSDP the sharded part (weights, EMA shadows, optimizer) is not
        copied: all ranks write it here, into a staging dir the snapshot names.
        """
        rngs = distributed.gather_objects(d, ckpt_state.capture_rng())
        staging, extra = None, {}
        if sharded:
            writer.wait()  # a previous write of the same step may still be moving its staging dir
            staging = ckpt_io.staging_dir(layout.step_dir(scratch, at_step), layout.DCP_DIR, pid0)
            fsdp.save_sharded(d, raw_model, names, ema, optimizer, staging)
            weights, ema_state, (opt_tensors, opt_meta) = None, {}, (None, None)
            extra = {"weights_checksum": fsdp.checksum(d, params)}
        else:
            weights = model_setup.trained_state(raw_model, names)
            ema_state = {tag: model_setup.to_saved_keys(raw_model, ema.state(rate))
                         for rate, tag in zip(ema.rates, ema.tags)}
            opt_tensors, opt_meta = ckpt_state.optimizer_state(optimizer, names)
        return ckpt_state.Snapshot(
            step=at_step,
            weights=weights,
            peft_config=raw_model.peft_config["default"] if cfg.lora.enabled else None,
            model_config_json=None if cfg.lora.enabled else raw_model.config.to_json_string(),
            ema=ema_state,
            optimizer_tensors=opt_tensors,
            optimizer_meta=opt_meta,
            # the lambdas are code, rebuilt from the config; LambdaLR skips None entries on load
            scheduler={**scheduler.state_dict(), "lr_lambdas": [None] * len(optimizer.param_groups)},
            scaler=scaler.state_dict() if scaler.is_enabled() else {},
            progress={"step": at_step, "stage": stage.name, "samples_seen": at_step * cfg.optim.global_batch,
                      "world_size": d.world_size, **counters, **extra},
            rng=rngs,
            config_yaml=cfg_text,
            manifest_extra={"fingerprint": fingerprint, "stage": stage.name},
            sharded_dir=staging,
        )

    def save(at_step: int, wait: bool = False) -> None:
        snap = snapshot(at_step)
        if d.is_main:
            def write():
                target = layout.step_dir(scratch, at_step)
                def files(tmp: Path) -> None:
                    ckpt_state.write_snapshot(snap, tmp)
                    if fault.sigkill_in_save_at == at_step:
                        os.kill(os.getpid(), signal.SIGKILL)  # files written, MANIFEST not yet

                ckpt_io.write_checkpoint(target, at_step, files, snap.manifest_extra)
                ckpt_io.update_latest(scratch, target)
                ckpt_io.prune(scratch, cfg.checkpoint.keep_last)
            writer.submit(write)
            if wait:
                writer.wait()
        if wait:
            distributed.barrier(d)

    def best_weights(kind: str, rate: float | None) -> dict:
        """The trained weights as saved (EMA ones: called with them swapped in)."""
        if not sharded:
            return model_setup.trained_state(raw_model, names)
        live = dict(raw_model.named_parameters())  # shards: every rank gathers the full tensors
        return {key: fsdp.replicated(live[n].detach()).to("cpu", copy=True).contiguous()
                for key, n in model_setup.saved_key_map(raw_model, names).items()}

    def write_weights(tensors: dict, root: Path) -> None:
        ckpt_state.write_weights(root, tensors, raw_model.peft_config["default"] if cfg.lora.enabled else None,
                                 None if cfg.lora.enabled else raw_model.config.to_json_string())

    evaluator = StageEvaluator(
        model=raw_model, ema=ema, val_cache=val_cache, pad_id=pad_id, eval_cfg=cfg.eval, device=d.device,
        autocast=precision.autocast, stage=stage.name,
        # rank 0 alone, but under FSDP every rank (each holds a shard the forward gathers)
        participate=d.is_main or sharded, is_main=d.is_main, metrics=metrics, scratch=scratch,
        best=counters["best"], fingerprint=fingerprint,
        weights=best_weights, write_weights=write_weights, collective_weights=sharded,
        # a preemption signal abandons an eval; under FSDP all ranks must agree to
        should_stop=(lambda: distributed.any_rank(d, preempt.signal is not None)) if sharded
        else (lambda: preempt.signal is not None),
    )

    def evaluate(kind: str, reason: str) -> None:
        if fault.usr1_in_eval_at == step and not counters["eval_pending"]:
            os.kill(os.getpid(), signal.SIGUSR1)
        if evaluator.run(step, kind, reason):
            counters["eval_pending"] = None
        else:  # preempted: the checkpoint about to be written asks the next attempt to redo it
            counters["eval_pending"] = [kind, reason]

    def preempted() -> bool:
        if not distributed.any_rank(d, preempt.signal is not None):
            return False
        save(step, wait=True)
        writer.wait()
        distributed.print0(d, f"[{stage.name}] preempted at update {step}: checkpoint saved, exiting "
                              f"with code {layout.EXIT_PREEMPTED} so a retry resumes")
        return True

    # --- the loop ------------------------------------------------------------------
    unchecked_restore = source  # checked once, on the first update after a restore
    if counters["eval_pending"]:  # the previous attempt was preempted during this eval
        kind, reason = counters["eval_pending"]
        evaluate(kind, f"{reason}, redone after preemption")
        if preempted():
            return layout.EXIT_PREEMPTED
    last_save = -1
    model.train()
    while step < stage.end:
        t0 = time.perf_counter()
        if fault.fail_at_step == step:
            log.error("[%s] injected failure at update %d (SFT_FAULTS)", stage.name, step)
            writer.wait()
            return 1
        micro_batches = sampler.rank_micro_batches(step, d.rank, d.world_size, cfg.optim.micro_batch)
        assert len(micro_batches) == accum
        n_sup = int(counts[sampler.global_indices(step)].sum())  # whole global batch: same on every rank
        loss_sum = torch.zeros((), device=d.device)
        tokens = 0
        for i, mb in enumerate(micro_batches):
            batch = {k: v.to(d.device) for k, v in collate(train_cache, mb, pad_id).items()}
            tokens += int(batch["attention_mask"].sum())
            # DDP all-reduces gradients on every backward unless told not to:
            # only the last micro-batch of the update needs to synchronize.
            # (FSDP2: the same, as a flag on the model instead of a context.)
            sync = i == accum - 1
            if sharded:
                sync_ctx = fsdp.gradient_sync(model, sync)
            else:
                sync_ctx = model.no_sync() if d.enabled and not sync else nullcontext()
            with sync_ctx:
                with precision.autocast():
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                mb_loss = token_loss_sum(logits, batch["labels"])
                # Normalize by the supervised tokens of the whole global batch (not
                # the micro-batch): the gradient is then independent of how the
                # batch is split over micro-batches and ranks. DDP (and FSDP's
                # reduce-scatter) averages over ranks, hence the world_size factor.
                scaler.scale(mb_loss * (d.world_size / max(n_sup, 1))).backward()
            loss_sum += mb_loss.detach()
        if step in fault.nan_grad_steps:
            params[0].grad.fill_(float("nan"))
        if step in fault.zero_grad_steps:
            torch._foreach_zero_([p.grad for p in params if p.grad is not None])

        # --- update (skipped when the gradient is not finite) --------------------
        scaler.unscale_(optimizer)
        # Under FSDP the grads are DTensor shards and the norm is the full, cross-shard one.
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf)
        grad_norm = fsdp.replicated(grad_norm)
        if unchecked_restore is not None:  # first update after a restore: do gradients reach the weights?
            check_gradients_flow(named, float(grad_norm), str(unchecked_restore), log_it=d.is_main)
            unchecked_restore = None
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            scaler.step(optimizer)
            ema.update(step)
            counters["consecutive_nonfinite"] = 0
        else:
            counters["skipped_updates"] += 1
            counters["consecutive_nonfinite"] += 1
            log.warning("[%s] update %d skipped: non-finite gradient (norm %s); %d in a row, %d in total",
                        stage.name, step, grad_norm.item(), counters["consecutive_nonfinite"], counters["skipped_updates"])
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step += 1

        # --- bookkeeping ---------------------------------------------------------
        if d.enabled:
            torch.distributed.all_reduce(loss_sum)
            tokens_all = tokens * d.world_size
        else:
            tokens_all = tokens
        counters["tokens_seen"] += tokens_all
        loss = float(loss_sum) / max(n_sup, 1)
        if step - 1 in fault.loss_spike_steps:
            loss *= 10.0  # injected: the reported loss spikes, training itself is unchanged
        if fault.sleep_per_step:
            time.sleep(fault.sleep_per_step)
        dt = time.perf_counter() - t0
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm), "tokens": tokens_all,
                  "tokens_per_s": tokens_all / dt, "step_time_s": dt, "skipped": not finite,
                  "skipped_total": counters["skipped_updates"], "mem_mb": _memory_mb(d.device),
                  "epoch": sampler.epoch_of(step)}
        if step % cfg.log_every == 0 or step == stage.end:
            metrics.write(record)
        progress.update(step, loss)

        if counters["consecutive_nonfinite"] >= cfg.precision.max_consecutive_nonfinite:
            save(step, wait=True)
            raise UserError(
                f"[{stage.name}] {counters['consecutive_nonfinite']} non-finite updates in a row at update {step} "
                f"(precision.max_consecutive_nonfinite={cfg.precision.max_consecutive_nonfinite}); "
                f"checkpoint saved in {layout.step_dir(scratch, step)}. Lower optim.lr, check the data, "
                "or use precision.mode=bf16/fp32."
            )
        # An update that ran while a checkpoint was being written is slow for a known reason.
        saving = last_save == step - 1 or writer.busy
        alert = alerts.check(step, loss, record["tokens_per_s"], saving=saving) if finite else None
        due = evaluator.due(step, total)
        if distributed.any_rank(d, alert is not None):
            evaluate("full" if due == "full" else "quick", f"alert: {alert}" if alert else "alert on another rank")
            save(step)
            last_save = step
        elif due:
            evaluate(due, "end of the run" if step == total else f"every {due}")
        if preempted():
            return layout.EXIT_PREEMPTED
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < stage.end:
            save(step)
            last_save = step
    progress.close()
    # Cheap cross-rank check the pilot gate reports (DDP ranks must hold the same weights).
    if d.enabled and not sharded:
        distributed.check_consistent(d, params, f"trained weights at the end of {stage.name}")
    metrics.write({"step": stage.end, "event": "ranks_consistent", "world_size": d.world_size,
                   "method": "sharded (FSDP)" if sharded else "weight checksums" if d.enabled else "single process"})
    metrics.close()

    # --- stage output: final checkpoint + metrics, made visible by one rename --------
    save(stage.end, wait=True)
    writer.wait()
    if d.is_main:
        _publish(scratch, out, stage.end, counters["best"], stage.name)
    distributed.barrier(d)
    return 0


def _publish(scratch: Path, out: Path, step: int, best: dict, stage: str) -> None:
    final = layout.step_dir(scratch, step)
    ok, reason = ckpt_io.verify(final)
    if not ok:
        raise RuntimeError(f"final checkpoint failed verification: {reason}")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copytree(final, tmp / layout.STAGE_CHECKPOINT)
    for name in (layout.SCRATCH_METRICS, "alerts.jsonl"):
        if (scratch / name).is_file():
            shutil.copy2(scratch / name, tmp / name)
    if (scratch / layout.TENSORBOARD_DIR).is_dir():
        shutil.copytree(scratch / layout.TENSORBOARD_DIR, tmp / layout.TENSORBOARD_DIR)
    publish_best(scratch, tmp, best, stage)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    # The stage is complete: its scratch checkpoints are no longer needed.
    shutil.rmtree(scratch, ignore_errors=True)


def _memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # pragma: no cover - non-POSIX
        return 0.0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, required=True)
    ap.add_argument("--config", type=Path, required=True, help="resolved trainer config (train_config.yaml)")
    ap.add_argument("--stage", required=True)
    ap.add_argument("--init", type=Path, default=None, help="previous stage's checkpoint dir (none for the pilot)")
    ap.add_argument("--scratch", type=Path, required=True, help="intra-stage checkpoints (undeclared)")
    ap.add_argument("--out", type=Path, required=True, help="stage output dir (appears when complete)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return train_stage(args)
