"""The run's plan: its stages, its resolved trainer config, and the checks that need the model.

    python -m pipeline plan --total-updates 300 --pilot-fraction 0.05 --num-chunks 2 \\
        --resolved-config "$(cat train_config.yaml)" \\
        --export-weights ema --export-ema-rate 0.98 [--world-size 8] --max-length 2048 \\
        --out-plan results/<run>/plan.json --out-config results/<run>/train_config.yaml

The trainer config is resolved once, when the workflow loads
(`pipeline.planning.run_config`): the `plan` rule hands over its text, which
the plan checks again (`pipeline.config.to_typed`, `pipeline.planning.checks.cross_check`)
and writes as it is, so its sha256 is the `config_id` the workflow keyed the
plan on. Tests and benchmarks hand over `pipeline.config.to_yaml` of a
`pipeline.config.resolve` the same way.

A base model given by hub id is recorded as `model: {repo_id, revision}`, the
commit the `fetch_model` job pinned (model.path is then its model.json), and
read from the Hugging Face cache like a local dir.

With the base model at hand (a local dir), `plan` also builds its skeleton on
the meta device (`pipeline.model.loading.plan_model`: no weight read) and
prints the attention kernel `model.attn_implementation` resolves to and why,
what LoRA adapts per module kind with the parameter counts (attention, experts,
router, ...; `pipeline.model.targets`) and the router loss of a mixture of
experts. A `lora.target_modules` that matches nothing, a target peft would
refuse, a `lora.dropout` its fused-expert wrapper cannot take, an attention
kernel the model does not support, FSDP on a mixture of experts: each fails
here, naming the setting, not in the pilot.

Memory: from the model's config.json alone (`pipeline.model.memory`), the
plan estimates what one GPU holds during training (weights, gradients,
optimizer, EMA shadows, activations of the largest micro-batch, the loss's
logits) and fails, before any GPU work, when that exceeds what the allocator
can use of a GPU of `model.gpu_memory_gb` or, when that is not set, of the GPUs
it finds (`memory.budget`); the error shows the estimate and what each knob
(activation checkpointing, micro-batch, FSDP, a 4-bit base) would make of it. Under
`model.activation_checkpointing=auto` it prints the choice (k of n layers), the
one the stage makes (`memory.decide`). Without either (a CPU run) the estimate
is only printed.
A run that fits only because its base is quantized (`model.quantization`) is
told so, with what a float base would need.

Packing (`pipeline.planning.packing`): the plan prints whether the run's
micro-batches are packed, by which attention path, and the padding fraction of
the tokens computed with padded micro-batches and with packed ones, over the
run's own order (its first `REPORT_UPDATES` updates); plan.json keeps them.

A quantized base is checked here too: bitsandbytes installed and a base stored
unquantized (`pipeline.model.quantization.check_quantization`).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from pipeline import config as train_config
from pipeline.errors import UserError
from pipeline.data.mix import from_config as mix_from_config
from pipeline.model import memory
from pipeline.planning import packing
from pipeline.planning.checks import EXPORT_WEIGHTS, cross_check
from pipeline.planning.schedule import plan_stages
from pipeline.storage import hub
from pipeline.storage.publish import write_text


def gpu_count_problem(world: int | None) -> str | None:
    """Why this machine cannot give each of a local run's `world` ranks a GPU of its own, or None.

    A local run starts every rank on this machine (one torchrun per node, all
    here, without SLURM), on the GPUs this process sees (the launcher hands out
    the same ones). Under SLURM the plan runs in a job of its own, without the
    training job's GPUs: `pipeline.distributed.setup` checks there.
    """
    if world is None or os.environ.get("SLURM_JOB_ID"):
        return None
    count, _ = memory.gpus_found()
    if count == 0 or world <= count:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible}"
    return (f"train.nproc / train.nodes x train.gpus_per_node start {world} training processes, but this machine "
            f"has {count} visible GPU(s){shown}: each process needs a GPU of its own. Lower train.nproc to at most "
            f"{count} (or auto: one per GPU); to train on the CPU instead, hide the GPUs (CUDA_VISIBLE_DEVICES=)")


def memory_check(cfg: train_config.TrainConfig, *, world: int | None, max_length: int | None) -> str | None:
    """Print the memory estimate; return why the run cannot fit its GPUs, or None.

    GPUs: `world` of them (None: as many as this process sees), each with
    `model.gpu_memory_gb` or, unset, the smallest memory among those seen.
    """
    shapes = memory.model_shapes(cfg)
    caches = [m.cache for m in cfg.tokens.mix] or [cfg.tokens.train_cache]
    length = max_length or max((memory.longest_record(c) or 0 for c in caches), default=0) or None
    if shapes is None or length is None:
        print("memory: no estimate (" + ("no model config" if shapes is None else "no data.max_length") + ")")
        return None
    count, found = memory.gpus_found()
    world = world or max(count, 1)
    limit = memory.gpu_budget(cfg.model, found, world)
    run = memory.decide(cfg, shapes, world=world, sharded=cfg.distributed.strategy == "fsdp" and world > 1,
                        precision=memory.gpu_precision(cfg.precision.mode), length=length, limit=limit,
                        attention=memory.resolved_attention(cfg.model))
    if shapes.experts:
        print(f"parameters: {shapes.params:,} in all (the memory estimate holds every expert), "
              f"{shapes.active_params:,} active per token ({shapes.top_k} of {shapes.experts} experts: throughput "
              "and MFU count these)")
    if limit is None:
        print(memory.estimate(cfg, shapes, run).table())
        print("memory: no GPU found and no model.gpu_memory_gb: not checked")
        return None
    gpu = (f"model.gpu_memory_gb={cfg.model.gpu_memory_gb:g}" if cfg.model.gpu_memory_gb is not None
           else f"the smallest of the {count} GPUs found")
    where = f"usable on {gpu} (less the CUDA context, NCCL buffers and fragmentation: pipeline.model.memory.budget)"
    if cfg.model.activation_checkpointing == "auto":
        print(f"memory: model.activation_checkpointing=auto: "
              f"{memory.checkpointing_text(run.checkpointed, shapes.layers)} (the fewest that fit)")
    print(memory.estimate(cfg, shapes, run).table())
    for note in (memory.quantization_note(cfg, shapes, run, limit), memory.larger_micro_batch(cfg, shapes, run, limit)):
        if note:
            print(note)
    return memory.does_not_fit(cfg, shapes, run, limit, where)


def mix_plan(cfg: train_config.TrainConfig, total_updates: int) -> list[dict]:
    """Per dataset of a mixed run (`tokens.mix`): its records, weight or records asked, records per
    mixed epoch and records drawn over the whole run (`pipeline.data.mix`, the trainer's own order)."""
    from pipeline.data.cache import TokenCache
    from pipeline.data.mix import from_config

    mix = from_config(cfg.tokens.mix, [len(TokenCache(m.cache)) for m in cfg.tokens.mix], cfg.seed)
    table = mix.table(total_updates * cfg.optim.global_batch)
    for row in table:
        print(f"mix: {row['name']}: {row['records']} records, {row['per_epoch']} per mixed epoch "
              f"(weight {row['weight']}, records {row['records_asked']}), {row['drawn']} drawn in the run")
    return table


def packing_plan(cfg: train_config.TrainConfig, total_updates: int, *, world: int | None) -> dict | None:
    """Print and return how the run's training micro-batches are laid out (`pipeline.planning.packing`):
    packed or not and why, and the padding fraction before (padded micro-batches) and after (packed)
    over the run's first updates. None (and a line saying so) while the model config or the token
    caches are not there yet: the stage decides then."""
    from pipeline.data.cache import TokenCache
    from pipeline.data.vision import config_is_vision_language
    import torch

    from pipeline.model import packed_attention
    from pipeline.planning.order import RunSampler

    config = _model_config(cfg)
    caches = [m.cache for m in cfg.tokens.mix] or [cfg.tokens.train_cache]
    if config is None or not all(c and Path(c).is_file() for c in caches):
        print("packing: decided when the stage starts (no model config or token cache here yet)")
        return None
    world = world or 1
    micro, _ = train_config.batch_split(cfg, world)
    counts = [len(TokenCache(c)) for c in caches]
    lengths = np.concatenate([TokenCache(c).lengths for c in caches])
    capacity = packing.row_capacity(lengths)
    longest = max(capacity, memory.longest_record(cfg.tokens.val_cache) or 0)  # validation runs the same attention
    # The plan does not know which device the stages get (under SLURM it runs without their GPUs):
    # it says what each would do where they differ (SDPA: record by record on a CPU).
    # Each with the kernel `model.attn_implementation` resolves to there (auto: flash-attention on a GPU
    # where the flash-attn package is importable here too). A GPU computes in half precision unless
    # precision.mode is fp32 (bf16 or fp16: the same to torch's varlen kernel).
    gpu_compute = torch.float32 if str(cfg.precision.mode) == "fp32" else torch.bfloat16
    gpu, cpu = (packing.decide(cfg.tokens.packing, implementation=memory.resolved_attention(cfg.model, device)
                               or "sdpa", model_type=config.model_type,
                               vision_language=config_is_vision_language(config), device=device,
                               per_record=packed_attention.runs_per_record(config, longest), where=cfg.model.path,
                               recurrent=packing.recurrent_layers(config), varlen=cfg.tokens.torch_varlen,
                               varlen_unfit=packed_attention.varlen_fits(config, gpu_compute))
                for device in ("cuda", "cpu"))
    mix = mix_from_config(cfg.tokens.mix, counts, cfg.seed) if cfg.tokens.mix else None
    sampler = RunSampler(len(lengths), cfg.optim.global_batch, cfg.seed,
                         lengths if cfg.tokens.group_by_length else None, mix)
    steps = range(min(total_updates, packing.REPORT_UPDATES))
    report = packing.padding_report(sampler, lengths, steps, capacity=capacity, world=world, micro=micro,
                                    layout="rows")
    shape = f"; rows of up to {capacity} tokens, at most {micro} rows per micro-batch" if gpu.on else ""
    print(gpu.text() + shape if gpu == cpu else f"{gpu.text()} (on a GPU); on a CPU: {cpu.why}{shape}")
    layouts = {gpu.layout, cpu.layout}
    after = ([f"{report['after']:.1%} in packed rows"] if "rows" in layouts or not gpu.on else []) + (
        ["none in one flat row per micro-batch"] if layouts & {"flat", "records"} else [])
    print(f"padding: {report['before']:.1%} of the tokens computed in padded micro-batches, "
          + ("packed: " if gpu.on else "would be if packed: ") + ", ".join(after)
          + f" (over updates 0..{len(steps) - 1} of {total_updates}, {world} rank(s))")
    return {"layout": {"gpu": gpu.layout or "padded", "cpu": cpu.layout or "padded"},
            "why": {"gpu": gpu.why, "cpu": cpu.why}, "row_tokens": capacity,
            "padding_before": round(report["before"], 6), "padding_rows": round(report["after"], 6),
            "updates_counted": len(steps), "world": world}


def _model_config(cfg: train_config.TrainConfig):
    """The base model's transformers config, or None where it cannot be read here."""
    from pipeline.model import base

    try:
        return base.hf_config(cfg.model)
    except (OSError, ValueError, KeyError):
        return None


def _parsed(text: str):
    """The resolved config's text read as `pipeline.config.load` reads train_config.yaml (UserError: not a mapping)."""
    from omegaconf import DictConfig, OmegaConf

    try:
        raw = OmegaConf.create(text)
    except Exception as err:  # OmegaConf and its YAML reader raise several types for bad text
        raise UserError(f"--resolved-config is not YAML: {err}") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"--resolved-config is not a trainer config (a mapping of its groups): {text[:80]!r}")
    return raw


def _rate(text: str) -> float | None:
    return None if text in ("", "null", "None") else float(text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-updates", type=int, required=True)
    ap.add_argument("--pilot-fraction", type=float, required=True)
    ap.add_argument("--num-chunks", type=int, required=True)
    ap.add_argument("--resolved-config", required=True,
                    help="the resolved trainer config (pipeline.config.to_yaml) as text: checked, and written as is")
    ap.add_argument("--export-weights", choices=EXPORT_WEIGHTS, required=True, help="workflow export.weights")
    ap.add_argument("--export-ema-rate", type=_rate, default=None, help="workflow export.ema_rate")
    ap.add_argument("--world-size", type=int, default=None, help="ranks per stage, when the workflow fixes it")
    ap.add_argument("--max-length", type=int, default=None,
                    help="workflow data.max_length, for the memory estimate (default: the train cache's longest)")
    ap.add_argument("--out-plan", type=Path, required=True)
    ap.add_argument("--out-config", type=Path, required=True)
    args = ap.parse_args(argv)

    stages = plan_stages(args.total_updates, args.pilot_fraction, args.num_chunks)
    cfg = train_config.to_typed(_parsed(args.resolved_config))  # the workflow's resolution, typed and checked again
    if train_config.to_yaml(cfg) != args.resolved_config:
        # The workflow keyed the plan on this text's sha256: a text that is not the whole config as
        # to_yaml writes it (a partial one, other formatting) would be trained under another id.
        raise UserError("--resolved-config is not a resolved trainer config as pipeline.config.to_yaml writes it "
                        "(every key, in its order): resolve it with pipeline.config.resolve first")
    problems = cross_check(cfg, export_weights=args.export_weights, export_ema_rate=args.export_ema_rate,
                           world=args.world_size)
    if problems:
        raise UserError("the workflow config and the trainer config disagree:\n  " + "\n  ".join(problems))
    too_few = gpu_count_problem(args.world_size)
    if too_few:
        raise UserError(too_few)
    # A hub model (its model.json or hub id) is read from its cached snapshot; the plan records its
    # id and commit. train_config.yaml keeps model.path as given: the config's identity.
    hub_model = hub.describe(cfg.model.path)
    local = replace(cfg, model=replace(cfg.model, path=str(hub.model_dir(cfg.model.path))))
    if Path(local.model.path).is_dir():  # else checked when the pilot loads it
        from pipeline.model.loading import plan_model
        from pipeline.model.quantization import check_quantization

        check_quantization(local.model)
        plan_model(local, world=args.world_size)
    too_big = memory_check(local, world=args.world_size, max_length=args.max_length)
    if too_big:
        raise UserError(too_big)
    plan = {"total_updates": args.total_updates, "stages": [asdict(s) for s in stages]}
    layout = packing_plan(local, args.total_updates, world=args.world_size)
    if layout is not None:
        plan["packing"] = layout
    if cfg.tokens.mix:
        plan["mix"] = mix_plan(cfg, args.total_updates)
    if hub_model is not None:
        plan["model"] = hub_model
    write_text(args.out_plan, json.dumps(plan, indent=2) + "\n")
    write_text(args.out_config, args.resolved_config)
    print(" + ".join(f"{s.name}:{s.updates}" for s in stages), f"= {args.total_updates} updates")
    return 0
