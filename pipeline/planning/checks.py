"""The checks that span the two configs: the workflow's (`config/config.yaml`) and the trainer's.

Some settings tie the two together and would otherwise fail only after all
training (consolidate picking an EMA rate that was never kept) or in the first
stage (a global batch the ranks cannot share, a quantized base sharded by FSDP).
`cross_check` names both keys of every such problem at once. The workflow runs
it when it loads (`pipeline.planning.run_config`), so `snakemake` refuses such a
config before any job starts; the `plan` command runs it again on the config it
is handed. Torch-free: the Snakefile imports it at every start.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import config as train_config
from pipeline.data.run_tokenizer import refuse_added_tokens_sharded
from pipeline.errors import UserError
from pipeline.layout import ema_tag

EXPORT_WEIGHTS = ("ema", "raw")  # export.weights: which weights the run merges and smoke-tests
FSDP_QUANTIZED_ERROR = ("model.quantization={quantization} with distributed.strategy=fsdp over {world}: the FSDP "
                        "strategy reads the base into per-rank shards of float tensors (fully_shard of a meta "
                        "skeleton), which bitsandbytes' packed 4-bit / 8-bit weights and their quantization "
                        "constants are not; a quantized base trains with distributed.strategy=ddp (each rank holds "
                        "the whole quantized base: 4-bit makes it about 0.3x of bf16), or use "
                        "model.quantization=none with fsdp")


def world_size(nodes: int, gpus_per_node: int | str, nproc: int | str) -> int | None:
    """Ranks of a training stage when the workflow config fixes them (None: decided by the GPUs found).

    Raises when the config itself asks for more processes per node than GPUs per
    node: each process needs a GPU of its own (CUDA: "invalid device ordinal").
    """
    if nproc != "auto":
        if gpus_per_node != "auto" and 0 < int(gpus_per_node) < int(nproc):
            raise UserError(f"train.nproc={nproc} processes per node but train.gpus_per_node={gpus_per_node}: "
                            f"each process needs a GPU of its own; set train.nproc to at most {gpus_per_node} "
                            "(or auto: one per GPU)")
        return nodes * int(nproc)
    if gpus_per_node != "auto":
        return nodes * max(1, int(gpus_per_node))
    return None


def refuse_quantized_sharded(cfg: train_config.TrainConfig, world: str) -> None:
    """UserError naming both settings when a quantized base would be sharded with FSDP (over `world`)."""
    if cfg.model.quantization != "none" and cfg.distributed.strategy == "fsdp":
        raise UserError(FSDP_QUANTIZED_ERROR.format(quantization=cfg.model.quantization, world=world))


def cross_check(cfg: train_config.TrainConfig, *, export_weights: str, export_ema_rate: float | None,
                world: int | None) -> list[str]:
    """Problems between the workflow config (`export.weights`, `export.ema_rate`, the ranks of a stage:
    `world`, None when the GPUs found decide) and the resolved trainer config, each naming both keys."""
    problems = []
    rates = list(cfg.ema.rates)
    shown = f"ema.rates={rates}"
    if export_ema_rate is not None and ema_tag(export_ema_rate) not in {ema_tag(r) for r in rates}:
        problems.append(f"export.ema_rate={export_ema_rate} is not one of the trainer's {shown}: "
                        "choose a rate the run keeps, or add it to ema.rates (train.overrides)")
    if export_weights == "ema" and not rates:
        problems.append(f"export.weights=ema needs EMA weights, but the trainer keeps none ({shown}): "
                        "set export.weights: raw, or give ema.rates")
    if export_weights == "ema" and export_ema_rate is None and len(rates) > 1:
        problems.append(f"export.weights=ema with several rates ({shown}): set export.ema_rate to the one to export")
    sharded = cfg.distributed.strategy == "fsdp" and world != 1
    refusals = []
    if sharded and cfg.model.tokenizer and Path(cfg.model.tokenizer).is_dir():
        # FSDP reads the base into shards of its stored shapes: no rows for added tokens yet.
        refusals.append(lambda: refuse_added_tokens_sharded(cfg.model))
    if sharded:
        refusals.append(lambda: refuse_quantized_sharded(
            cfg, f"{world} ranks" if world else "the GPUs found (train.nproc=auto)"))
    if world is not None:
        refusals.append(lambda: train_config.batch_split(cfg, world))
    for refuse in refusals:
        try:
            refuse()
        except UserError as err:
            problems.append(str(err))
    return problems
