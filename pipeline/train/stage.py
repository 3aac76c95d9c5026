"""Train one stage: global updates [start, end) of the run's plan.

    torchrun --standalone --nproc-per-node N -m pipeline train \\
        --plan plan.json --config train_config.yaml --stage chunk01 \\
        --init results/<run>/stages/pilot/checkpoint --scratch work/<run>/chunk01 \\
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

Reading order: `train_stage` sets up the process group; `run` builds the parts
in a fixed order (the model and adapter draw from the seeded RNG), restores
them, and runs the update loop. The parts: `TokenLoss` (the model as the loop
calls it: a batch in, the summed loss out), `strategy` (how it is spread over
ranks), `Checkpointer` (start point, saves, output), `Updater` (one optimizer
update), `Evaluator` (in-stage evals, best weights), `Monitor` (metrics,
alerts, progress). Activation checkpointing is decided before the model is
built, from the memory estimate (`pipeline.model.memory`).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pipeline import config as train_config
from pipeline import distributed, layout, watch
from pipeline.checkpoint import io as ckpt_io
from pipeline.checkpoint.checkpointer import Checkpointer, fingerprint
from pipeline.checkpoint.state import restore_rng
from pipeline.data.cache import TokenCache
from pipeline.data import run_tokenizer
from pipeline.data.mix import ConcatCache, Mix, from_config as mix_from_config
from pipeline.errors import UserError
from pipeline.model import base, loading, memory, packed_attention, precision as prec
from pipeline.model.batch import Collator, validation_collator
from pipeline.model.loss import hf_model
from pipeline.planning.packing import Packing, decide as decide_packing, recurrent_layers
from pipeline.planning.schedule import lr_factor, read_plan, stage_from_plan
from pipeline.train.parts import TrainingParts
from pipeline.train.batches import TrainBatches
from pipeline.train.ema import EMA
from pipeline.train.evals import Evaluator
from pipeline.train.faults import Hooks, InjectedFailure
from pipeline.train.monitor import Monitor
from pipeline.train.optimizer import adamw
from pipeline.train.profiling import StageProfiler
from pipeline.train.strategy import choose as choose_strategy
from pipeline.train.update import LoopState, Updater

log = logging.getLogger("pipeline.train")


def train_stage(args: argparse.Namespace) -> int:
    cfg = train_config.load(args.config)
    if cfg.deterministic:
        _deterministic()
    with watch.session(cfg.distributed.backend, cfg.distributed.timeout_s) as d:
        try:
            return run(args, cfg, d)
        except InjectedFailure as err:
            log.error("[%s] %s", args.stage, err)
            return 1


def run(args, cfg: train_config.TrainConfig, d: distributed.Dist) -> int:
    # --- what to compute ------------------------------------------------------
    plan, stage, init = _inputs(args, d)
    total = plan["total_updates"]
    config_text = Path(args.config).read_text()
    micro, accum = train_config.batch_split(cfg, d.world_size)
    precision = prec.choose(cfg.precision.mode, d.device, init_scale=cfg.precision.init_scale)
    prec.use_tf32(d.device, cfg.precision.tf32)
    strategy = choose_strategy(cfg, d)
    hooks = Hooks.from_env(stage.name)
    train_cache, mix = train_data(cfg.tokens, cfg.seed)
    checkpointed, estimate, micro_note = memory.for_stage(cfg, device=d.device, world=d.world_size,
                                                          sharded=strategy.sharded, precision=precision.name,
                                                          length=int(train_cache.lengths.max()))

    # --- model, EMA, optimizer (construction consumes RNG: seed first) --------
    _seed_all(cfg.seed)
    # The loop calls a TokenLoss (batch in, summed loss out): DDP wraps it, FSDP shards it (in
    # place); its .lm is what the optimizer, the EMA and the checkpoints see, sharded or not.
    model = strategy.build_model(cfg, precision, checkpointed=checkpointed)
    loss_model = strategy.unwrap(model)  # without DDP's wrapper: what evaluation calls
    raw_model = loss_model.lm
    # In the optimizer's param-group order (LoRA+ splits them): every saved state is keyed by it.
    named, optimizer = adamw(loading.trainable(raw_model), cfg.optim, d.device)
    ema = EMA(strategy.ema_view(named), cfg.ema.rates, cfg.ema.every)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, cfg.optim.warmup_fraction, cfg.optim.min_lr_ratio))
    parts = TrainingParts(raw_model, named, ema, optimizer, scheduler, precision.scaler())

    # --- restore -----------------------------------------------------------------
    checkpointer = Checkpointer(
        parts, strategy, d, scratch=Path(args.scratch), out=Path(args.out), stage=stage.name,
        fingerprint=fingerprint(config_text, plan, stage.name, init), config_text=config_text,
        global_batch=cfg.optim.global_batch, cfg=cfg.checkpoint, hooks=hooks,
    )
    resume = checkpointer.resume_point()
    source = resume or init
    _announce(d, f"[{stage.name}] updates {stage.start}..{stage.end} of {total}; start from "
                 f"{source or 'a fresh adapter'}; world {d.world_size}, micro-batch {micro} x {accum}, "
                 f"precision {precision.name}, ", checkpointed, estimate, micro_note)
    state = _restored(checkpointer, stage, source, resumed=resume is not None, seed=cfg.seed, rank=d.rank)

    # --- data, evaluation, reporting ------------------------------------------------
    train_collator, val, packing = _collators(cfg, d, train_cache, hf_model(raw_model), precision.dtype)
    train = _train_batches(cfg, d, train_collator, micro, mix)
    _announce_packing(d, stage.name, packing, micro, train.capacity)
    monitor = Monitor(cfg, args.scratch, stage, total, is_main=d.is_main, resume_step=state.step, hooks=hooks,
                      device=d.device)
    tracking = _tracking(args, plan, stage, state.step) if d.is_main else None
    checkpointer.on_commit = tracking  # rank 0 catches the tracker up with each committed checkpoint
    preemption = distributed.Preemption(d)
    evaluator = Evaluator(cfg.validation, val, loss_model, parts, strategy, precision, monitor=monitor,
                          checkpointer=checkpointer, stop=preemption, hooks=hooks, stage=stage.name)
    update = Updater(model, parts, strategy, precision, train, grad_clip=cfg.optim.grad_clip, hooks=hooks,
                     stage=stage.name, preemption=preemption, restored_from=source)
    profiler = StageProfiler(cfg.profile, args.scratch, stage.name, state.step, stage.start, is_main=d.is_main,
                             device=d.device, data=train, ema=parts.ema)

    # --- the loop ------------------------------------------------------------------
    if state.eval_pending and _redo_pending_eval(state, evaluator, preemption):
        return checkpointer.save_preempted(state)
    model.train()
    train.prefetch(state.step, stage.end)  # images decode in loader workers (vision-language models only)
    held = None  # several ranks: this rank's alert, agreed on in the next update's all-reduce
    while state.step < stage.end:
        profiler.before(state.step)
        started = time.perf_counter()
        # update number state.step; state.step counts it done afterwards
        result = update(state, alerted=held is not None)
        summary = profiler.after(state.step)
        if summary is not None:
            distributed.print0(d, summary)
        alert = monitor.after_update(state, result, started, epoch=train.epoch_of(state.step),
                                     saving=checkpointer.overlapped(state.step))
        if state.consecutive_nonfinite >= cfg.precision.max_consecutive_nonfinite:
            checkpointer.save(state, wait=True)
            raise _diverged(stage.name, state, cfg.precision.max_consecutive_nonfinite, args.scratch)
        due = evaluator.due(state.step, total)
        reason, held = _agreed_alert(d, alert, held, result, last=state.step == stage.end)
        if reason:  # on any rank: evaluate and checkpoint now
            evaluator.run(state, "full" if due == "full" else "quick", reason)
            checkpointer.save(state)
        elif due:
            evaluator.run(state, due, "end of the run" if state.step == total else f"every {due}")
        # SIGTERM / SIGUSR1 on any rank; agreed in the update, or anew after an evaluation (which
        # a signal may have cut short)
        if preemption.requested(None if reason or due else result.signalled):
            return checkpointer.save_preempted(state)
        if checkpointer.periodic_due(state.step, stage.end):
            checkpointer.save(state)

    # --- stage output: final checkpoint + metrics, made visible by one rename ------------
    _closing_events(monitor, d, stage, strategy, named, mix, train)
    monitor.close()
    checkpointer.save(state, wait=True)
    checkpointer.close()
    if tracking is not None:
        tracking(stage.end, final=True)
    checkpointer.publish(stage.end, state.best)
    distributed.barrier(d)
    return 0


def _inputs(args, d: distributed.Dist) -> tuple[dict, object, Path | None]:
    """(the run's plan, this stage of it, the checkpoint it starts from: the previous stage's, or
    None for the pilot). The input checkpoint is checked once, by rank 0 (it hashes every file), for
    every rank: a bad one stops the stage before anything is built."""
    plan = read_plan(args.plan)
    stage, _ = stage_from_plan(plan, args.stage)
    init = Path(args.init) if args.init else None
    if init is not None:
        ok, reason = distributed.broadcast_object(d, ckpt_io.verify(init) if d.is_main else None)
        if not ok:
            raise UserError(f"input checkpoint of stage {stage.name} is not usable: {reason}")
    return plan, stage, init


def _train_batches(cfg: train_config.TrainConfig, d: distributed.Dist, collator: Collator, micro: int,
                   mix: Mix | None) -> TrainBatches:
    """This rank's share of every update, in micro-batches of `micro` (a vision-language model's
    images decoded by `vision.loader_workers` loader processes)."""
    return TrainBatches(collator, global_batch=cfg.optim.global_batch, micro_batch=micro, seed=cfg.seed,
                        rank=d.rank, world=d.world_size, group_by_length=cfg.tokens.group_by_length,
                        workers=cfg.vision.loader_workers if collator.images is not None else 0, mix=mix)


def _redo_pending_eval(state: LoopState, evaluator: Evaluator, preemption: distributed.Preemption) -> bool:
    """The previous attempt was preempted during an evaluation: run it again first. True when a
    signal came (again) meanwhile: the stage saves and exits."""
    kind, reason = state.eval_pending
    evaluator.run(state, kind, f"{reason}, redone after preemption")
    return preemption.requested()


def _announce_packing(d: distributed.Dist, stage: str, packing, micro: int, capacity: int) -> None:
    """Rank 0 prints the stage's micro-batch layout: packed (rows and their width) or padded, and why."""
    distributed.print0(d, f"[{stage}] {packing.text()}" + (
        f"; micro-batches of at most {micro} rows of at most {capacity} tokens" if packing.on else ""))


def _announce(d: distributed.Dist, line: str, checkpointed: int, estimate, larger_micro_batch: str | None) -> None:
    """Rank 0 prints the stage's line (`line`, then its activation checkpointing) and, with a
    memory estimate, its table and whether a larger micro-batch would fit (`memory.larger_micro_batch`)."""
    distributed.print0(d, line + (memory.checkpointing_text(checkpointed, estimate.layers) if estimate is not None
                                  else f"activation checkpointing {'every layer' if checkpointed else 'off'}"))
    if estimate is not None:
        distributed.print0(d, estimate.table())
    if larger_micro_batch:
        distributed.print0(d, f"{line.split(' ', 1)[0]} {larger_micro_batch}")


def _restored(checkpointer: Checkpointer, stage, source: Path | None, *, resumed: bool, seed: int,
              rank: int) -> LoopState:
    """The loop state the stage starts from: `source`'s (this stage's last in-stage checkpoint when
    `resumed`, else the previous stage's final one), or a fresh one at the stage's first update.
    The RNG is restored (or seeded, per rank) last: building the parts above may draw from it,
    and must not shift the run's stream."""
    state, rng = LoopState(step=stage.start), None
    if source is not None:
        progress, rng = checkpointer.restore(source)
        state = LoopState.from_progress(progress)
        expected = range(stage.start, stage.end + 1) if resumed else [stage.start]
        if state.step not in expected:
            raise UserError(f"{source} ends at update {state.step}, but stage {stage.name} starts at {stage.start}")
    if rng is not None:
        restore_rng(rng)
    else:
        _seed_all(seed * 7919 + rank + 1)  # fresh start (or a rank new to this run)
    return state


def _closing_events(monitor: Monitor, d: distributed.Dist, stage, strategy, named, mix, train: TrainBatches) -> None:
    """The stage's last metrics events: its ranks hold the same weights (a cheap cross-rank check the
    pilot gate reports), and, mixing datasets, what it drew from each (the plan's mix says what
    the run will)."""
    strategy.check_ranks([p for _, p in named], f"trained weights at the end of {stage.name}")
    monitor.event({"step": stage.end, "event": "ranks_consistent", "world_size": d.world_size,
                   "method": strategy.consistency})
    if mix is not None:
        monitor.event({"step": stage.end, "event": "mix_drawn", "start": stage.start,
                       "drawn": drawn_per_dataset(train.sampler, mix, range(stage.start, stage.end))})


def _agreed_alert(d: distributed.Dist, alert: str | None, held: str | None, result, *,
                  last: bool) -> tuple[str | None, str | None]:
    """(why all ranks evaluate and checkpoint after this update, or None; the alert to hold for
    the next update).

    One process acts on its own alert at once. Several ranks must act together,
    and an alert is one rank's (its throughput is its own): they agree in the
    next update's all-reduce rather than in a collective of their own each
    update, so the evaluation and checkpoint come one update after the alert.
    After the stage's last update there is no next one: they agree here.
    """
    if not d.enabled:
        return (f"alert: {alert}" if alert else None), None
    acted = result.alerted
    if last:
        acted = distributed.any_rank(d, alert is not None) or acted
        held, alert = held or alert, None
    if not acted:
        return None, alert
    return (f"alert: {held}" if held else "alert on another rank"), alert


def _tracking(args, plan: dict, stage, resume_step: int):
    """Rank 0's tracker hook (None when tracking is off): sends this stage's metrics up to a committed
    checkpoint (`pipeline.tracker`); first catches up what earlier stages and attempts left unsent."""
    from pipeline.tracker import Tracker

    tracker = Tracker(Path(args.out).parent.parent, job=f"train {stage.name}")
    if not tracker.enabled:
        return None
    names = [s["name"] for s in plan["stages"]]
    index = names.index(stage.name)
    tracker.sync_stages(plan["stages"][:index])
    metrics = Path(args.scratch) / layout.SCRATCH_METRICS

    def sync(step: int, final: bool = False) -> None:
        tracker.sync_metrics(stage.name, metrics, upto=step, index=index, start=stage.start, final=final)
        if final:
            tracker.close()

    sync(resume_step)
    return sync


def train_data(tokens: train_config.TokensConfig, seed: int) -> tuple[TokenCache | ConcatCache, Mix | None]:
    """The training cache, and the mix of a run of several datasets (`tokens.mix`): their caches read
    as one, and the seeded order over them, from their record counts and shares."""
    if not tokens.mix:
        return TokenCache(tokens.train_cache), None
    caches = [TokenCache(m.cache) for m in tokens.mix]
    return ConcatCache(caches), mix_from_config(tokens.mix, [len(c) for c in caches], seed)


def drawn_per_dataset(sampler, mix: Mix, steps: range) -> dict[str, int]:
    """Samples of each dataset the updates `steps` train on (all ranks together)."""
    counts = np.zeros(len(mix.sources), dtype=np.int64)
    for step in steps:
        which = np.searchsorted(mix.offsets, sampler.global_indices(step), side="right") - 1
        counts += np.bincount(which, minlength=len(mix.sources))
    return {s.name: int(c) for s, c in zip(mix.sources, counts)}


def _collators(cfg: train_config.TrainConfig, d: distributed.Dist, train_cache: TokenCache,
               hf, compute_dtype) -> tuple[Collator, Collator | None, Packing]:
    """Batch makers of the train and (if any) validation caches, and the training batches' packing
    (`pipeline.planning.packing.decide`, for the model as loaded: its family and the attention
    implementation it runs); a vision-language model's carry images. Validation batches are padded.
    Where packing runs SDPA record by record (a CPU) or through torch's varlen kernel (a GPU,
    `tokens.torch_varlen`, under the autocast `compute_dtype`), switches the transformers model `hf` to
    it (`pipeline.model.packed_attention`).

    Several ranks must all run the vision tower in a forward or none may (FSDP
    gathers its shards in the forward, DDP waits for the gradients of a trained
    projector; validation batches are spread over the ranks too): the records of
    a distributed vision-language run must each have an image.
    """
    images = base.image_text(cfg.model)
    pad_id = loading.pad_token_id(run_tokenizer.path(cfg.model))
    val = validation_collator(cfg, pad_id, images)
    # Validation batches run through the same attention: a sliding window must cover their records too.
    longest = max([int(train_cache.lengths.max())] + ([int(val.cache.lengths.max())] if val is not None else []))
    packing = decide_packing(cfg.tokens.packing, implementation=hf.config._attn_implementation,
                             model_type=hf.config.model_type, vision_language=images is not None,
                             device=d.device.type, per_record=packed_attention.runs_per_record(hf.config, longest),
                             where=cfg.model.path, recurrent=recurrent_layers(hf.config),
                             varlen=cfg.tokens.torch_varlen,
                             varlen_unfit=packed_attention.varlen_fits(hf.config, compute_dtype))
    if packing.per_record:
        packed_attention.use(hf)
    train = Collator(train_cache, pad_id, layout=packing.layout or "padded", images=images)
    if images is not None and d.enabled:
        for split, collator in (("training", train), ("validation", val)):
            without = 0 if collator is None else int((collator.cache.image_counts == 0).sum())
            if without:
                raise UserError(f"{collator.cache.path}: {without} {split} record(s) have no image; a vision-language "
                                f"model trained on {d.world_size} processes needs one in every record")
    return train, val, packing


def _deterministic() -> None:
    # GPU kernels that accumulate with atomics (scatter-adds in backward passes) sum in
    # whatever order the threads finish: two processes then differ in the last bits, and
    # a resumed run drifts from the uninterrupted one. cuBLAS reads its workspace setting
    # when its handle is created, before the first matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _diverged(stage: str, state: LoopState, limit: int, scratch) -> UserError:
    return UserError(
        f"[{stage}] {state.consecutive_nonfinite} non-finite updates in a row at update {state.step} "
        f"(precision.max_consecutive_nonfinite={limit}); checkpoint saved in {layout.step_dir(scratch, state.step)}. "
        "Lower optim.lr, check the data, or use precision.mode=bf16/fp32."
    )


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
