"""Write two FSDP2 checkpoints in the `<ckpt>/dcp/` layout, from 2 gloo ranks on CPU.

    python tests/export/dcp_writer.py OUT_DIR PORT

OUT_DIR/lora/: a tiny tied Llama + LoRA, `fully_shard` per layer and at the root;
`dcp.save({"model": peft adapter state dict, "ema": {"0.999": ...}})` plus
`dcp/adapter_config.json`. OUT_DIR/full/: the same without LoRA (full
fine-tuning; its state dict lists the tied lm_head alias too). Next to each,
`reference.safetensors` holds the unsharded tensors (`full_tensor()`) under
the keys `model.<name>` / `ema.<tag>.<name>`, for the test to compare with.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WORLD = 2


def _shard(model, layers, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _save(ckpt: Path, main: dict, rank: int) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from pipeline.checkpoint import io as ckpt_io

    # A made-up EMA shadow that differs from the main weights, still sharded (DTensor).
    ema = {name: tensor.detach() * 0.5 + 0.01 for name, tensor in main.items()}
    dcp.save({"model": main, "ema": {"0.999": ema}}, checkpoint_id=str(ckpt / "dcp"))
    # full_tensor() is a collective: every rank gathers, rank 0 writes.
    reference = {f"model.{k}": v.full_tensor() for k, v in main.items()}
    reference.update({f"ema.0.999.{k}": v.full_tensor() for k, v in ema.items()})
    if rank == 0:
        save_file({k: v.contiguous() for k, v in reference.items()}, str(ckpt / "reference.safetensors"))
        ckpt_io.write_manifest(ckpt, step=1)


def _run(rank: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from peft import get_peft_model, get_peft_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from export_helpers import lora_config, tiny_llama

    out_dir = Path(out)
    mesh = init_device_mesh("cpu", (WORLD,))

    model, _ = tiny_llama(tied=True, seed=0)  # same seed on every rank: one logical model
    torch.manual_seed(1)
    peft_model = get_peft_model(model, lora_config())
    _shard(peft_model, peft_model.base_model.model.model.layers, mesh)
    adapter = get_peft_model_state_dict(peft_model)
    assert all(type(v).__name__ == "DTensor" for v in adapter.values())
    _save(out_dir / "lora", adapter, rank)
    if rank == 0:
        peft_model.peft_config["default"].save_pretrained(str(out_dir / "lora" / "dcp"))

    model, _ = tiny_llama(tied=True, seed=2)
    _shard(model, model.model.layers, mesh)
    _save(out_dir / "full", model.state_dict(), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_run, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD, join=True)
