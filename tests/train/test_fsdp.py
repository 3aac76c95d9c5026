"""FSDP2 (distributed.strategy=fsdp) on 2 gloo ranks: chunked, killed and resumed runs compute
exactly what one run computes, and the final sharded checkpoint consolidates to HF dirs. On
`tiny_mixed`, whose records pack several to a row: every rank runs as many packed micro-batches."""

from __future__ import annotations

import json

import pytest
import torch
from kits.train import make_run, stage_names, step_losses

from pipeline import cli, layout

pytestmark = pytest.mark.distributed

TOTAL = 9  # pilot 2 + chunk01 3 + chunk02 3 + tail 1 at fraction 0.25
# Global batch 8 = 2 ranks x 2 micro-batches of 2: every update accumulates (no gradient sync on the first).
MICRO = ["optim.micro_batch=2"]
FSDP = ["distributed=fsdp", *MICRO]


def dcp_contents(ckpt) -> dict:
    """Every entry of `<ckpt>/dcp/`, unsharded, flattened: model.*, ema.<tag>.*, optim.state.*, optim.param_groups."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.parent.name}-dcp.pt"
    dcp_to_torch_save(ckpt / layout.DCP_DIR, out)
    nested = torch.load(out, weights_only=False)
    out.unlink()
    flat = {f"model.{k}": v for k, v in nested["model"].items()}
    flat.update({f"ema.{tag}.{k}": v for tag, sd in nested["ema"].items() for k, v in sd.items()})
    flat.update({f"optim.state.{p}.{k}": v for p, st in nested["optim"]["state"].items() for k, v in st.items()})
    flat["optim.param_groups"] = nested["optim"]["param_groups"]
    return flat


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def load_dir_tensors(root) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(root.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def chain_logged(run, names: list[str]) -> dict[str, str]:
    """Run the stages in order on 2 ranks; returns each stage's stderr."""
    logs, prev = {}, None
    for name in names:
        logs[name] = run.train(name, prev, nproc=2).stderr
        prev = name
    return logs


@pytest.fixture(scope="module")
def lora_reference(tiny_mixed, tmp_path_factory):
    """One uninterrupted 2-rank FSDP run over all updates."""
    run = make_run(tmp_path_factory.mktemp("fsdp_reference"), tiny_mixed, total=TOTAL, fraction=0.25,
                   overrides=FSDP, single_stage=True)
    run.train("all", nproc=2)
    return run


def _final(run, stage="all"):
    return run.stage_dir(stage) / layout.STAGE_CHECKPOINT


def test_fsdp_lora_chunked_equals_one_run(tiny_mixed, tmp_path, lora_reference):
    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, overrides=FSDP)
    names = stage_names(run)
    assert names == ["pilot", "chunk01", "chunk02", "tail"]
    logs = chain_logged(run, names)
    ckpt = _final(run, "tail")
    # sharded layout: dcp/ replaces adapter/, ema/ and the optimizer files; the MANIFEST covers the shards
    assert not (ckpt / layout.ADAPTER_DIR).exists() and not (ckpt / layout.EMA_DIR).exists()
    assert (ckpt / layout.DCP_DIR / layout.PEFT_CONFIG).is_file()
    files = json.loads((ckpt / layout.MANIFEST_FILE).read_text())["files"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/adapter_config.json",
            "training_state/rng_rank001.json", "training_state/scheduler.json"} <= set(files)
    # adapter, both EMA shadows, AdamW moments and steps, param groups: bit for bit
    got = dcp_contents(ckpt)
    assert sum(k.startswith("ema.0.99.") for k in got) == 28 and sum(k.endswith(".exp_avg_sq") for k in got) == 28
    assert_bitwise_equal(got, dcp_contents(_final(lora_reference)))
    assert step_losses([run.stage_dir(s) for s in names]) == step_losses([lora_reference.stage_dir("all")])
    # the best weights (full eval after the last update) are gathered from the shards and saved whole
    for kind in ("raw", "ema"):
        best = run.stage_dir("tail") / "best" / kind / layout.PEFT_WEIGHTS
        assert best.read_bytes() == (lora_reference.stage_dir("all") / "best" / kind / layout.PEFT_WEIGHTS).read_bytes()
    # every restore is followed by the gradient check, and both LoRA halves get a gradient
    for name in names[1:]:
        line = next(x for x in logs[name].splitlines() if "gradient check after restoring" in x)
        halves = dict(part.split() for part in line.split("(")[-1].rstrip(")").split(", "))
        assert float(halves["lora_A"]) > 0 and float(halves["lora_B"]) > 0, line


def test_fsdp_killed_during_save_resumes_bitwise(tiny_mixed, tmp_path, lora_reference):
    # Quick evaluations (every rank runs the forward, EMA swapped in and out) leave no trace either.
    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, overrides=[*FSDP, "validation.quick_every=3"],
                   single_stage=True)
    scratch = run.scratch("all")
    # rank 0 is SIGKILLed after the checkpoint of update 4 wrote its files, before its MANIFEST
    proc = run.train("all", nproc=2, faults={"sigkill_in_save_at": 4}, check=False)
    assert proc.returncode != 0
    partial = [p for p in scratch.iterdir() if p.name.startswith("step_000004.tmp-")]
    assert partial and not any((p / layout.MANIFEST_FILE).exists() for p in partial)
    proc = run.train("all", nproc=2)
    assert "start from " + str(scratch / "step_000002") in proc.stdout
    assert_bitwise_equal(dcp_contents(_final(run)), dcp_contents(_final(lora_reference)))
    assert step_losses([run.stage_dir("all")]) == step_losses([lora_reference.stage_dir("all")])


def test_fsdp_final_checkpoint_consolidates_to_the_gathered_tensors(tiny_mixed, tmp_path, lora_reference):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = _final(lora_reference)
    gathered = dcp_contents(ckpt)
    rc = cli.main(["consolidate", "--checkpoint", str(ckpt), "--base", str(tiny_mixed["model"]), "--models", "both",
                   "--out-adapter", str(tmp_path / "adapter"), "--out-adapter-ema", str(tmp_path / "ema"),
                   "--ema-rate", "0.99"])
    assert rc == 0
    for out, prefix in [(tmp_path / "adapter", "model."), (tmp_path / "ema", "ema.0.99.")]:
        produced = load_file(str(out / layout.PEFT_WEIGHTS))
        expected = {k[len(prefix):]: v for k, v in gathered.items() if k.startswith(prefix)}
        assert len(produced) == 28 and set(produced) == set(expected)
        assert all(torch.equal(produced[k], expected[k]) for k in expected), out
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_mixed["model"]), tmp_path / "adapter")
    assert torch.isfinite(model(input_ids=torch.arange(12).reshape(2, 6)).logits).all()

    # The same run under DDP (same ranks, so the same data split and dropout streams): not
    # bitwise (other reduction order), but close.
    ddp = make_run(tmp_path / "ddp", tiny_mixed, total=TOTAL, fraction=0.25, overrides=MICRO, single_stage=True)
    ddp.train("all", nproc=2)
    # (This also shows that the sharded EMA and optimizer state track the weights.)
    for fsdp_dir, ddp_dir in [("adapter", layout.ADAPTER_DIR), ("ema", f"{layout.EMA_DIR}/0.99")]:
        unsharded = load_file(str(_final(ddp) / ddp_dir / layout.PEFT_WEIGHTS))
        produced = load_file(str(tmp_path / fsdp_dir / layout.PEFT_WEIGHTS))
        assert max(float((produced[k] - unsharded[k]).abs().max()) for k in unsharded) < 1e-5, fsdp_dir
    ddp_optim = load_file(str(_final(ddp) / layout.TRAINING_STATE_DIR / layout.OPTIMIZER_TENSORS))
    for key, value in ddp_optim.items():
        name, sub = key.rsplit("::", 1)
        assert torch.allclose(gathered[f"optim.state.{name}.{sub}"], value, rtol=1e-3, atol=1e-8), key
    a = [loss for _, loss in step_losses([ddp.stage_dir("all")])]
    b = [loss for _, loss in step_losses([lora_reference.stage_dir("all")])]
    assert a == pytest.approx(b, rel=1e-5)

    # The workflow's readers of a stage checkpoint take the sharded one too: evaluation, pilot gate.
    losses = {}
    for name, r in [("fsdp", lora_reference), ("ddp", ddp)]:
        assert cli.main(["evaluate", "--checkpoint", str(_final(r)), "--stage", "all", "--max-new-tokens", "16",
                         "--out", str(tmp_path / f"eval_{name}.json")]) == 0
        rows = json.loads((tmp_path / f"eval_{name}.json").read_text())["rows"]
        losses[name] = {row["weights"]: row["loss"] for row in rows}
    assert list(losses["fsdp"]) == ["raw", "ema_0.9", "ema_0.99"]
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-5)
    from pipeline.evaluate.gate import run_checks

    gate = run_checks(lora_reference.stage_dir("all"), json.loads(lora_reference.plan.read_text()))
    assert gate["checks"]["grads_flowing"]["ok"]


def test_fsdp_full_finetuning_chunked_equals_one_run_and_consolidates(tiny_mixed, tmp_path):
    kw = dict(total=6, fraction=0.34, chunks=2, overrides=["lora=full", *FSDP])
    chunked = make_run(tmp_path / "chunked", tiny_mixed, **kw)
    names = stage_names(chunked)
    chain_logged(chunked, names)
    one = make_run(tmp_path / "one", tiny_mixed, **kw, single_stage=True)
    one.train("all", nproc=2)
    got = dcp_contents(_final(chunked, names[-1]))
    assert not (_final(one) / layout.DCP_DIR / layout.PEFT_CONFIG).exists()  # no adapter config: full FT
    assert "model.model.embed_tokens.weight" in got and "ema.0.9.model.layers.1.mlp.up_proj.weight" in got
    assert_bitwise_equal(got, dcp_contents(_final(one)))
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])

    rc = cli.main(["consolidate", "--checkpoint", str(_final(one)), "--base", str(tiny_mixed["model"]),
                   "--out-model", str(tmp_path / "model"), "--out-model-ema", str(tmp_path / "ema"),
                   "--ema-rate", "0.9"])
    assert rc == 0
    for out, prefix in [(tmp_path / "model", "model."), (tmp_path / "ema", "ema.0.9.")]:
        produced = load_dir_tensors(out)
        assert set(produced) == set(load_dir_tensors(tiny_mixed["model"]))
        assert all(torch.equal(v, got[prefix + k]) for k, v in produced.items()), out

    # The end-of-run evaluation ran sharded, on every rank, with each EMA swapped into the shards
    # (embeddings and head included, which the root unit holds): it must see the same weights
    # as an offline evaluation of the checkpoint.
    in_stage = [json.loads(x) for x in (one.stage_dir("all") / "metrics.jsonl").read_text().splitlines()]
    in_stage = [r for r in in_stage if r.get("event") == "eval" and r["step"] == 6]
    assert in_stage
    assert cli.main(["evaluate", "--checkpoint", str(_final(one)), "--stage", "all", "--max-new-tokens", "16",
                     "--out", str(tmp_path / "eval.json")]) == 0
    offline = {row["weights"]: row["loss"] for row in json.loads((tmp_path / "eval.json").read_text())["rows"]}
    assert {k: in_stage[-1][f"val_{k}"] for k in offline} == pytest.approx(offline, rel=1e-5)


def test_fsdp_checkpoint_of_another_lora_config_is_refused_by_name(tiny_mixed, tmp_path, lora_reference):
    import shutil

    other = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, overrides=[*FSDP, "lora.r=8"])
    shutil.copytree(lora_reference.stage_dir("all"), other.stage_dir("all"))
    proc = other.train("chunk01", "all", nproc=2, check=False)
    assert proc.returncode != 0
    assert "does not match the model being trained" in proc.stderr
    assert "Size mismatch between saved torch.Size([4, 32]) and current: torch.Size([8, 32])" in proc.stderr


def test_sharded_load_computes_what_loading_the_whole_model_does(tiny_mixed, tmp_path, lora_reference):
    """Each rank reading only its shards of the base (the default) is the same model as every rank
    loading all of it (distributed.meta_init=false): the run ends bit for bit the same."""
    whole = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, overrides=[*FSDP, "distributed.meta_init=false"],
                     single_stage=True)
    whole.train("all", nproc=2)
    assert_bitwise_equal(dcp_contents(_final(whole)), dcp_contents(_final(lora_reference)))
    assert step_losses([whole.stage_dir("all")]) == step_losses([lora_reference.stage_dir("all")])


def _launch_stage(run, stage: str, init: str | None, *, nodes: int, nproc: int) -> None:
    """A stage started as the training rule starts it (`pipeline.launch --train`)."""
    import subprocess
    import sys

    from kits.train import pipeline_env

    log = run.root / f"{stage}.log"
    args = ["--plan", run.plan, "--config", run.config, "--stage", stage, "--scratch", run.scratch(stage),
            "--out", run.stage_dir(stage), *(["--init", run.stage_dir(init) / "checkpoint"] if init else [])]
    cmd = [sys.executable, "-m", "pipeline.launch", "--log", str(log), "--train", "--nodes", str(nodes),
           "--nproc", str(nproc), "--", "-m", "pipeline", "train", *map(str, args)]
    proc = subprocess.run(cmd, env=pipeline_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr + log.read_text()[-4000:]


def test_hsdp_over_two_nodes_of_two_ranks_chunked_equals_one_run(tiny_mixed, tmp_path):
    """distributed.hsdp: 2 "nodes" (agents on this host) x 2 ranks, shards replicated across nodes."""
    hsdp = [*FSDP, "distributed.hsdp=true"]
    chunked = make_run(tmp_path / "chunked", tiny_mixed, total=6, fraction=0.34, chunks=1, overrides=hsdp)
    names = stage_names(chunked)
    assert names == ["pilot", "chunk01"]
    _launch_stage(chunked, "pilot", None, nodes=2, nproc=2)
    _launch_stage(chunked, "chunk01", "pilot", nodes=2, nproc=2)
    one = make_run(tmp_path / "one", tiny_mixed, total=6, fraction=0.34, chunks=1, overrides=hsdp, single_stage=True)
    _launch_stage(one, "all", None, nodes=2, nproc=2)
    got = dcp_contents(_final(chunked, "chunk01"))
    assert_bitwise_equal(got, dcp_contents(_final(one)))
    files = json.loads((_final(one) / layout.MANIFEST_FILE).read_text())["files"]
    assert {f"dcp/__{r}_0.distcp" for r in range(4)} <= set(files)  # every rank wrote (and hashed) its part


def test_fsdp_with_activation_checkpointing_and_fp16_equals_the_reference(tiny_mixed, tmp_path, lora_reference):
    # Per-layer checkpointing under fully_shard: the recompute runs inside the layer's FSDP
    # unit (its weights gathered again for the backward) and changes no bit.
    run = make_run(tmp_path, tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True,
                   overrides=[*FSDP, "model.activation_checkpointing=on"])
    run.train("all", nproc=2)
    assert_bitwise_equal(dcp_contents(_final(run)), dcp_contents(_final(lora_reference)))
    # fp16 with a GradScaler whose first scale overflows, sharded (each rank unscales and
    # checks only its own shards): the same calibration skips and scales as under DDP.
    fp16 = ["precision.mode=fp16", "precision.init_scale=2.5e6"]
    sharded = make_run(tmp_path / "fp16", tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True,
                       overrides=[*FSDP, *fp16])
    sharded.train("all", nproc=2)
    ddp = make_run(tmp_path / "fp16_ddp", tiny_mixed, total=TOTAL, fraction=0.25, single_stage=True,
                   overrides=[*MICRO, *fp16])
    ddp.train("all", nproc=2)
    rows = {name: [json.loads(x) for x in (r.stage_dir("all") / "metrics.jsonl").read_text().splitlines()]
            for name, r in [("fsdp", sharded), ("ddp", ddp)]}
    skips = {name: [(x["step"], x["skipped"], x["loss_scale"]) for x in v if "loss" in x] for name, v in rows.items()}
    assert skips["fsdp"] == skips["ddp"] and skips["fsdp"][0][1]
