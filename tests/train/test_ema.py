"""EMA against a direct float64 reference; swapping leaves nothing behind; LoRA keeps the base frozen."""

from __future__ import annotations

import torch

from pipeline.train.ema import EMA


def test_ema_matches_direct_computation_for_several_rates_and_every():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    rates, every = [0.5, 0.9, 0.99], 2
    ema = EMA([("a", params[0]), ("b", params[1])], rates, every)
    ref = {r: [p.detach().double().clone() for p in params] for r in rates}
    for step in range(9):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))
        averaged = ema.update(step)
        assert averaged == ((step + 1) % every == 0)
        if averaged:
            for r in rates:
                beta = r**every
                ref[r] = [beta * s + (1 - beta) * p.detach().double() for s, p in zip(ref[r], params)]
    for r in rates:
        for got, want in zip(ema.shadows[r], ref[r]):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_ema_shadow_is_fp32_for_half_precision_params_and_swap_restores_exactly():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, dtype=torch.bfloat16))
    ema = EMA([("p", p)], [0.9], 1)
    assert ema.shadows[0.9][0].dtype == torch.float32
    with torch.no_grad():
        p.add_(1.0)
    ema.update(0)
    raw = p.detach().clone()
    with ema.swapped_in(0.9):
        assert torch.equal(p.detach(), ema.shadows[0.9][0].to(torch.bfloat16))
    assert torch.equal(p.detach(), raw)


def test_lora_training_leaves_base_weights_bit_identical(tiny, tmp_path, monkeypatch):
    """Run a stage in this process, keep the model it trained, compare its base to the files."""
    from kits.train import make_run
    from transformers import AutoModelForCausalLM

    from pipeline.model import loading as model_setup
    from pipeline.train import stage

    captured = {}
    real_build = model_setup.build

    def build(*args, **kwargs):
        captured["model"] = real_build(*args, **kwargs)
        return captured["model"]

    monkeypatch.setattr(model_setup, "build", build)
    run = make_run(tmp_path, tiny, total=4, fraction=0.5, chunks=1, single_stage=True)
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(run.stage_dir("all"))]) == 0
    trained = captured["model"]
    base = AutoModelForCausalLM.from_pretrained(tiny["model"])
    base_params = dict(base.named_parameters())
    lora_moved = False
    for name, p in trained.named_parameters():
        if "lora_" in name:
            lora_moved |= "lora_B" in name and bool(p.detach().abs().sum() > 0)
            continue
        key = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(p.detach(), base_params[key].detach()), name
    assert lora_moved
