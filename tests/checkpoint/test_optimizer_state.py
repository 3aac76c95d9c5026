"""A checkpoint restores the optimizer's state and hyperparameters, never its implementation flags.

A run saved with one AdamW kernel (foreach on a CPU) and resumed with another (fused on a GPU)
keeps the kernel its process chose: restoring the saved `fused`/`foreach` made fp16's
`GradScaler.step` hand `found_inf` to a non-fused AdamW (AssertionError) and silently dropped
the fused kernel under bf16. Fused AdamW runs on a CPU too, so both directions are shown here,
for the replicated checkpoints and for FSDP's DCP ones (one gloo rank, in a subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from kits.train import pipeline_env

from pipeline.checkpoint.state import load_optimizer_state, optimizer_state


def _adamw(lr: float, betas: tuple, **flags) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    return p, torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=0.1, **flags)


def _trained(**flags) -> tuple[dict, dict]:
    p, opt = _adamw(1e-2, (0.8, 0.9), **flags)
    for _ in range(2):
        p.grad = torch.randn(4, 3)
        opt.step()
    return optimizer_state(opt, ["w"])


@pytest.mark.parametrize("saved, live", [({"foreach": True}, {"fused": True}),
                                         ({"fused": True}, {"foreach": True})])
def test_the_live_kernel_survives_while_hyperparameters_and_state_are_restored(saved, live):
    tensors, meta = _trained(**saved)
    p, opt = _adamw(0.5, (0.1, 0.2), **live)
    load_optimizer_state(opt, ["w"], tensors, meta)
    group = opt.param_groups[0]
    assert {k: bool(group[k]) for k in ("fused", "foreach")} == {k: bool(live.get(k)) for k in ("fused", "foreach")}
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-2, (0.8, 0.9), 0.1)  # the checkpoint's
    state = opt.state[p]
    assert torch.equal(state["exp_avg"], tensors["w::exp_avg"]) and torch.equal(state["exp_avg_sq"], tensors["w::exp_avg_sq"])
    assert float(state["step"]) == 2.0


def test_fp16_grad_scaler_steps_a_fused_adamw_resumed_from_a_foreach_checkpoint():
    tensors, meta = _trained(foreach=True)
    p, opt = _adamw(1e-2, (0.8, 0.9), fused=True)
    load_optimizer_state(opt, ["w"], tensors, meta)
    before = p.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale((p * p).sum()).backward()
    scaler.step(opt)  # the fused kernel takes found_inf itself; a foreach one raised AssertionError here
    scaler.update()
    assert not torch.equal(p.detach(), before) and float(opt.state[p]["step"]) == 3.0


_FSDP = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from pathlib import Path
    from transformers import LlamaConfig, LlamaForCausalLM
    from pipeline.distributed import Dist
    from pipeline.train import fsdp
    from pipeline.train.ema import EMA

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    d = Dist(0, 0, 1, torch.device("cpu"))

    def build(lr, **flags):
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, vocab_size=64)
        model = fsdp._shard(LlamaForCausalLM(cfg), fsdp._mesh(d, False), None)
        ema = EMA([(n, p.to_local()) for n, p in model.named_parameters()], [0.9])
        opt = torch.optim.AdamW(model.parameters(), lr=lr, **flags)
        return model, [n for n, _ in model.named_parameters()], ema, opt

    model, names, ema, opt = build(1e-2, foreach=True)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    fsdp._save_sharded(d, model, names, ema, opt, Path(sys.argv[1]), None).result()
    model, names, ema, fused = build(0.5, fused=True)
    fsdp._load_sharded(d, model, names, ema, fused, Path(sys.argv[1]))
    group = fused.param_groups[0]
    print(bool(group["fused"]), bool(group["foreach"]), group["lr"], float(next(iter(fused.state.values()))["step"]))
    dist.destroy_process_group()
""")


def test_an_fsdp_checkpoint_keeps_the_live_kernel_too(tmp_path):
    from torch.distributed.elastic.utils.distributed import get_free_port

    out = subprocess.run([sys.executable, "-c", _FSDP, str(tmp_path / "dcp"), str(get_free_port())],
                         env=pipeline_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "False", "0.01", "1.0"]  # fused kept; lr and step from the checkpoint
