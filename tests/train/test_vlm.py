"""Vision-language models keep every guarantee of the trainer: a chunked, killed or distributed run
computes exactly what one run computes, for the adapter, the projector trained in full, every EMA
shadow and the optimizer, in two model families (LLaVA, Qwen2-VL)."""

from __future__ import annotations

import signal

import pytest
from safetensors import safe_open
from kits.train import REPO, chain_and_compare, final_digests, make_run, stage_names, step_losses

PROJECTOR = ["vision.train_projector=true"]


def _keys(path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


@pytest.fixture(scope="module")
def llava_reference(tiny_llava, tmp_path_factory):
    """One uninterrupted process, LoRA on the language model + the projector in full."""
    run = make_run(tmp_path_factory.mktemp("llava_reference"), tiny_llava, total=9, fraction=0.25,
                   overrides=PROJECTOR, single_stage=True)
    run.train("all")
    return run


def test_llava_lora_and_projector_chunked_equals_one_run(tiny_llava, tmp_path, llava_reference):
    run = make_run(tmp_path, tiny_llava, total=9, fraction=0.25, overrides=PROJECTOR)
    chain_and_compare(run, llava_reference)
    # the projector is trained (and averaged) in full; the vision tower is not trained at all
    ckpt = run.stage_dir("tail") / "checkpoint"
    for weights in ("adapter", "ema/0.9", "ema/0.99"):
        keys = _keys(ckpt / weights / "adapter_model.safetensors")
        assert "base_model.model.model.multi_modal_projector.linear_1.weight" in keys
        assert not [k for k in keys if "vision_tower" in k]
        assert all("language_model" in k for k in keys if "lora_" in k)
    optimizer = _keys(ckpt / "training_state" / "optimizer.safetensors")
    assert [k for k in optimizer if "multi_modal_projector" in k and k.endswith("::exp_avg")]


def test_preemption_of_the_process_group_saves_at_a_step_boundary(tiny_llava, tmp_path, llava_reference):
    """SLURM signals the whole group: the loader workers must outlive the signal until the loop has saved."""
    import json
    import os
    import subprocess
    import sys
    import time

    from kits.train import pipeline_env

    from pipeline import layout

    run = make_run(tmp_path, tiny_llava, total=9, fraction=0.25, overrides=PROJECTOR, single_stage=True)
    scratch = run.scratch("all")
    cmd = [sys.executable, "-m", "pipeline", "train", "--plan", str(run.plan), "--config", str(run.config),
           "--stage", "all", "--scratch", str(scratch), "--out", str(run.stage_dir("all"))]
    proc = subprocess.Popen(cmd, env=pipeline_env({"SFT_FAULTS": json.dumps({"sleep_per_step": 0.3})}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = scratch / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and '"step": 3,' in metrics.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)  # the rank and its loader workers, as SLURM does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == layout.EXIT_PREEMPTED, err[-3000:]
    assert "preempted at update" in out and "DataLoader worker" not in err
    run.train("all")
    assert final_digests(run) == final_digests(llava_reference)


@pytest.mark.parametrize("family", ["tiny_llava", "tiny_qwen2_vl"])
def test_family_trains_one_stage_and_resumes_bitwise(family, request, tmp_path):
    data = request.getfixturevalue(family)
    reference = make_run(tmp_path / "one", data, total=6, fraction=0.5, chunks=1, overrides=PROJECTOR,
                         single_stage=True)
    reference.train("all")
    run = make_run(tmp_path / "resumed", data, total=6, fraction=0.5, chunks=1, overrides=PROJECTOR,
                   single_stage=True)
    # SIGKILLed while writing the checkpoint of update 4 (its loader workers still running): that one never loads
    assert run.train("all", faults={"sigkill_in_save_at": 4}, check=False).returncode == -signal.SIGKILL
    proc = run.train("all")
    assert "start from " + str(run.scratch("all") / "step_000002") in proc.stdout
    assert final_digests(run) == final_digests(reference)
    losses = step_losses([run.stage_dir("all")])
    assert losses == step_losses([reference.stage_dir("all")]) and losses[-1][1] < losses[0][1]


@pytest.mark.distributed
def test_llava_ddp_two_ranks_chunked_equals_one_run(tiny_llava, tmp_path):
    chunked = make_run(tmp_path / "chunked", tiny_llava, total=6, fraction=0.34, chunks=1, overrides=PROJECTOR)
    names = stage_names(chunked)
    chunked.chain(names, nproc=2)
    one = make_run(tmp_path / "one", tiny_llava, total=6, fraction=0.34, chunks=1, overrides=PROJECTOR,
                   single_stage=True)
    one.train("all", nproc=2)
    assert final_digests(chunked, names[-1]) == final_digests(one)
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])


@pytest.mark.distributed
def test_llava_fsdp_wraps_vision_and_text_blocks_and_chunked_equals_one_run(tiny_llava, tmp_path):
    """Also: each rank reads only its shards of the base (whose files keep LLaVA's old key layout),
    and that is the same model as every rank loading all of it (distributed.meta_init=false)."""
    from test_fsdp import assert_bitwise_equal, dcp_contents

    overrides = [*PROJECTOR, "distributed=fsdp", "optim.micro_batch=2"]
    chunked = make_run(tmp_path / "chunked", tiny_llava, total=6, fraction=0.34, chunks=1, overrides=overrides)
    names = stage_names(chunked)
    logs = [chunked.train(name, prev, nproc=2).stderr for name, prev in zip(names, [None, *names])]
    assert "fully_shard units: CLIPEncoderLayer x1, CLIPVisionEmbeddings x1, LlamaDecoderLayer x2 + root" in logs[0]
    assert "loads the whole model instead of its shards" not in logs[0]
    one = make_run(tmp_path / "one", tiny_llava, total=6, fraction=0.34, chunks=1, overrides=overrides,
                   single_stage=True)
    one.train("all", nproc=2)
    got = dcp_contents(chunked.stage_dir(names[-1]) / "checkpoint")
    assert "ema.0.99.base_model.model.model.multi_modal_projector.linear_2.weight" in got
    assert_bitwise_equal(got, dcp_contents(one.stage_dir("all") / "checkpoint"))
    assert step_losses([chunked.stage_dir(s) for s in names]) == step_losses([one.stage_dir("all")])
    whole = make_run(tmp_path / "whole", tiny_llava, total=6, fraction=0.34, chunks=1, single_stage=True,
                     overrides=[*overrides, "distributed.meta_init=false"])
    whole.train("all", nproc=2)
    assert_bitwise_equal(dcp_contents(whole.stage_dir("all") / "checkpoint"), got)


@pytest.mark.parametrize("settings", [PROJECTOR, ["lora=full", *PROJECTOR]], ids=["lora+projector", "full"])
@pytest.mark.parametrize("family", ["tiny_llava", "tiny_qwen2_vl"])
def test_sharded_load_reads_the_base_layout_into_the_live_names(family, settings, request):
    """FSDP's skeleton + sharded load (here unsharded: every row) gives the model `from_pretrained` gives,
    though Transformers 5 stores these families under other keys; a projector trained in full
    (PEFT modules_to_save) starts as the base's, read from the files like the frozen weights."""
    import torch

    from pipeline import config
    from pipeline.model import loading, precision
    from pipeline.train import sharded_load

    data = request.getfixturevalue(family)
    cfg = config.resolve(REPO / "config" / "train", overrides=[f"model.path={data['model']}", "tokens.train_cache=x",
                                                                 *settings])
    fp32 = precision.choose("fp32", torch.device("cpu"))
    torch.manual_seed(0)
    skeleton = loading.build(cfg, fp32, None, empty=True)
    keys = sharded_load.StoredKeys(data["model"])
    fresh = {n for n, p in loading.trainable(skeleton) if not keys.holds(n, p.shape)} if cfg.lora.enabled else set()
    assert all(".lora_" in n for n in fresh)
    assert not sharded_load.missing_keys(skeleton, keys, fresh)
    assert keys("base_model.model.model.language_model.layers.0.mlp.up_proj.base_layer.weight") != \
        "model.language_model.layers.0.mlp.up_proj.weight"  # the files' layout is not the live one
    sharded_load.load_shards(skeleton, data["model"], skip=fresh, keys=keys)
    torch.manual_seed(0)
    whole = dict(loading.build(cfg, fp32, torch.device("cpu")).named_parameters())
    # the adapter too: building the skeleton draws nothing from the RNG (CLIP draws in __init__)
    assert [n for n, p in skeleton.named_parameters() if not torch.equal(p, whole[n])] == []


def test_llava_full_finetuning_keeps_the_tower_frozen_and_consolidates(tiny_llava, tmp_path):
    """lora=full: the language model and the projector train, the vision tower stays the base's."""
    import torch
    from transformers import AutoModelForImageTextToText

    from pipeline import cli

    kw = dict(total=4, fraction=0.5, chunks=1, overrides=["lora=full", *PROJECTOR])
    chunked = make_run(tmp_path / "chunked", tiny_llava, **kw)
    names = stage_names(chunked)
    chunked.chain(names)
    one = make_run(tmp_path / "one", tiny_llava, **kw, single_stage=True)
    one.train("all")
    digests = final_digests(one)
    assert {"model/model.safetensors", "ema/0.99/model.safetensors"} <= set(digests)
    assert final_digests(chunked, names[-1]) == digests
    trained = _keys(one.stage_dir("all") / "checkpoint" / "model" / "model.safetensors")
    assert "model.multi_modal_projector.linear_1.weight" in trained and "lm_head.weight" in trained
    assert not [k for k in trained if "vision_tower" in k]

    out = tmp_path / "consolidated"
    assert cli.main(["consolidate", "--checkpoint", str(one.stage_dir("all") / "checkpoint"),
                     "--base", str(tiny_llava["model"]), "--out-model", str(out), "--models", "main"]) == 0
    base = AutoModelForImageTextToText.from_pretrained(tiny_llava["model"]).state_dict()
    model = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    tower = [k for k in base if "vision_tower" in k]
    assert tower and all(torch.equal(model[k], base[k]) for k in tower)
    for key in ("model.multi_modal_projector.linear_1.weight", "model.language_model.layers.0.mlp.up_proj.weight"):
        assert not torch.equal(model[key], base[key]), key


@pytest.mark.parametrize(("settings", "trained"), [
    ([], {"language_model": "lora"}),  # lora.target_modules=[all-linear]: the language model's linear layers only
    (PROJECTOR, {"language_model": "lora", "projector": "full"}),
    (["vision.train_tower=true", "lora.target_modules=[q_proj,v_proj,qkv]"],  # CLIP's and Qwen2-VL's names
     {"language_model": "lora", "tower": "lora"}),
    (["vision.train_tower=true"], {"language_model": "lora", "tower": "lora"}),  # all-linear: never the projector
    (["lora=full"], {"language_model": "full"}),
    (["lora=full", *PROJECTOR, "vision.train_tower=true"], {"language_model": "full", "projector": "full",
                                                             "tower": "full"}),
], ids=["lora", "lora+projector", "lora+tower", "all-linear+tower", "full", "full+projector+tower"])
@pytest.mark.parametrize("family", ["tiny_llava", "tiny_qwen2_vl"])
def test_trained_parts_follow_the_lora_and_vision_settings(family, settings, trained, request):
    """Which parameters train, by part: LoRA adapters or every weight; a part not listed is frozen."""
    import torch

    from pipeline import config
    from pipeline.model import loading, precision, vision

    data = request.getfixturevalue(family)
    cfg = config.resolve(REPO / "config" / "train", overrides=[f"model.path={data['model']}", "tokens.train_cache=x",
                                                                 *settings])
    model = loading.build(cfg, precision.choose("fp32", torch.device("cpu")), torch.device("cpu"))
    parts = vision.find_parts(model.get_base_model() if loading.is_peft(model) else model)
    projector_in_tower = parts.projector.startswith(parts.tower + ".")  # Qwen2-VL's merger
    names = [n.replace("base_model.model.", "").replace("modules_to_save.default.", "")
             for n, _ in loading.trainable(model)]

    def kind(part: str) -> str | None:
        prefix = getattr(parts, {"language_model": "language"}.get(part, part)) + "."
        own = [n for n in names if n.startswith(prefix)
               and not (part == "tower" and projector_in_tower and n.startswith(parts.projector + "."))]
        if not own:
            return None
        return "lora" if all(".lora_" in n for n in own) else "full"

    assert {p: kind(p) for p in ("language_model", "projector", "tower")} == {
        p: trained.get(p) for p in ("language_model", "projector", "tower")}


def test_tower_training_with_no_target_in_the_tower_is_refused_by_name(tiny_qwen2_vl):
    import torch

    from pipeline import config
    from pipeline.errors import UserError
    from pipeline.model import loading, precision

    cfg = config.resolve(REPO / "config" / "train", overrides=[f"model.path={tiny_qwen2_vl['model']}",
                                                                 "tokens.train_cache=x", "vision.train_tower=true",
                                                                 "lora.target_modules=[q_proj,v_proj]"])
    with pytest.raises(UserError, match=r"no name of lora.target_modules=.* is a linear layer of the vision tower "
                                        r"model.visual; its linear layers: \['fc1', 'fc2', 'proj', 'qkv'\]"):
        loading.build(cfg, precision.choose("fp32", torch.device("cpu")), torch.device("cpu"))
