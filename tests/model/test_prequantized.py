"""A base stored quantized. GPT-OSS as OpenAI publishes it keeps its experts in MXFP4 (config.json
`quantization_config.quant_method: mxfp4`; each fused expert weight as `<name>_blocks` + `<name>_scales`):
the stages loaded it with `quantization_config=None`, which made transformers load none of the experts
(initialised at random, silently), and the merge refused the base after training. Block-scaled FP8 releases
(`quant_method: fp8`; e4m3 codes + `<name>_scale_inv`) were refused at plan. Now both load dequantized, train,
merge into a model of numbers and verify; any other stored method is refused at plan.

The bases here are tiny models from the stock classes whose weights are then written in those formats (GPT-OSS's
experts with random codes and exponents; Qwen3's Linear weights quantized per 16 x 16 tile): transformers' own
loader (its dequantization) is the judge of what the numbers are.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.errors import UserError

# the contraction dims (hidden, the experts' width) are blocks of 32 codes
HIDDEN, EXPERT_WIDTH, EXPERTS = 32, 32, 4
# as GPT-OSS's config.json has it
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _save_mxfp4_gpt_oss(path) -> None:
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from pipeline.demo.text import build_tokenizer

    tokenizer = build_tokenizer()
    config = tf.GptOssConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128, tie_word_embeddings=False,
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
        intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0})
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(key).shape
        tensors[key + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator,
                                                 dtype=torch.uint8)
        # exponents 2**-4 .. 2**-1: weights up to 3 (e2m1 tops at 6), a model whose logits stay finite
        tensors[key + "_scales"] = torch.randint(123, 127, (experts, outputs, inputs // 32), generator=generator,
                                                 dtype=torch.uint8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    stored = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**stored, "quantization_config": QUANTIZATION}, indent=2))


FP8_BLOCK = 16  # the tiny model's weights are 32 / 64 wide: two or four blocks each way


def _save_fp8_qwen3(path, *, block: int = FP8_BLOCK) -> None:
    """A tiny Qwen3 from the stock class (bf16, as the FP8 releases' other tensors are), its decoder layers'
    Linear weights then stored as FP8 releases store them: float8 e4m3 codes under the weight's name, one
    float32 factor per block x block tile in `<name>_scale_inv` (amax / 448, e4m3's largest value)."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    from pipeline.demo.text import build_tokenizer

    tokenizer = build_tokenizer()
    config = tf.Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                            tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for key in [k for k in tensors if ".layers." in k and k.endswith("proj.weight")]:
        weight = tensors[key].float()
        rows, columns = weight.shape
        factors = weight.reshape(rows // block, block, columns // block, block).abs().amax(dim=(1, 3)) / 448.0
        tiles = factors.repeat_interleave(block, 0).repeat_interleave(block, 1)
        tensors[key], tensors[key + "_scale_inv"] = (weight / tiles).to(torch.float8_e4m3fn), factors
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    stored = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**stored, "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [block, block]}}))


def _fp8_by_transformers(path) -> dict[str, torch.Tensor]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=tf.FineGrainedFP8Config(dequantize=True,
                                                                               weight_block_size=(FP8_BLOCK, FP8_BLOCK)))
    return {name: p.detach() for name, p in model.named_parameters()}


def test_fp8_pairs_read_as_transformers_dequantizes_them(tmp_path):
    from pipeline.storage import hf_dir, packed as stored

    _save_fp8_qwen3(tmp_path / "base")
    packed = stored.packed_if_stored(hf_dir.find_weights(tmp_path / "base", "base"))
    assert len(packed.pairs) == 2 * 7 and packed.block == (FP8_BLOCK, FP8_BLOCK)
    theirs = _fp8_by_transformers(tmp_path / "base")
    for file, specs in packed.specs.items():
        for spec in specs:
            assert torch.equal(packed.read(file, spec.name), theirs[spec.name]), spec.name
    # an FSDP rank's rows that start and end inside a block of 16: each row still takes its own block's factor
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(packed.rows(name, 5, 21), theirs[name][5:21])


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_base_stored_in_fp8_trains_merges_and_verifies(tmp_path, capsys):
    """Refused at plan before (its codes' scales a float load leaves unapplied); now the stages train on the
    numbers, and the merge writes them with the adapter in, as a bf16 model without quantization_config."""
    import transformers as tf
    from kits.train import make_run, merge_and_verify, train_and_export
    from safetensors.torch import load_file

    base = tmp_path / "base"
    _save_fp8_qwen3(base)
    run = make_run(tmp_path / "run", {"model": base, **_caches(base, tmp_path)}, total=2, fraction=0.5, chunks=1,
                   single_stage=True, overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]",
                                                 "lora.dropout=0"])
    assert "base stored in FP8: its quantized weights load dequantized" in capsys.readouterr().out
    export = tmp_path / "export"
    report = merge_and_verify(base, train_and_export(run, base, export), export, run.config)
    merged = load_file(export / "merged" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert merged[name].dtype == torch.bfloat16 and not any(key.endswith("_scale_inv") for key in merged)
    assert "quantization_config" not in json.loads((export / "merged" / "config.json").read_text())
    _, info = tf.AutoModelForCausalLM.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info
    assert report["passed"], report


def _caches(base, tmp_path) -> dict:
    """Train and val token caches of the demo task, tokenized by `base`'s tokenizer."""
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint
    from pipeline.demo import text as demo

    paths = demo.build_dataset(tmp_path / "data", n_train=32, n_val=8, n_test=4)
    caches = {split: tmp_path / f"{split}.safetensors" for split in ("train", "val")}
    for split, cache in caches.items():
        tokenize_file(paths[split], load_tokenizer(base), out_path=cache, max_length=64, too_long="error",
                      fingerprint=tokenizer_fingerprint(base), split=split)
    return caches


def _dequantized_by_transformers(path) -> dict[str, torch.Tensor]:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                    quantization_config=tf.Mxfp4Config(dequantize=True))
    return {name: p.detach() for name, p in model.named_parameters()}


def test_mxfp4_pairs_read_as_transformers_dequantizes_them(tmp_path):
    from pipeline.storage import hf_dir, packed as stored

    _save_mxfp4_gpt_oss(tmp_path / "base")
    weights = hf_dir.find_weights(tmp_path / "base", "base")
    packed = stored.packed_if_stored(weights)
    assert sorted(packed.pairs) == [f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                    for p in ("down_proj", "gate_up_proj")]
    theirs = _dequantized_by_transformers(tmp_path / "base")
    for file, specs in packed.specs.items():
        for spec in specs:
            ours = packed.read(file, spec.name)
            assert tuple(ours.shape) == tuple(spec.shape) == tuple(theirs[spec.name].shape), spec
            assert torch.equal(ours.float(), theirs[spec.name]), spec.name
    # an FSDP rank's experts: the same numbers, from slices of the packed pair
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(packed.rows(name, 1, 3).float(), theirs[name][1:3])


@pytest.mark.usefixtures("own_signal_handlers")
def test_gpt_oss_stored_in_mxfp4_trains_its_experts_merges_and_verifies(tiny, tmp_path, capsys):
    """The run trains on the experts' numbers (the stages' base equals transformers' dequantized load, not a
    random init), the merge writes them as numbers with the adapter in (no quantization_config; stock loading
    reads every tensor), and the merged logits equal stock base + adapter."""
    import transformers as tf
    from kits.train import make_run, merge_and_verify, train_and_export
    from safetensors.torch import load_file

    from pipeline import config as train_config
    from pipeline.model import base as base_model

    base = tmp_path / "base"
    _save_mxfp4_gpt_oss(base)
    run = make_run(tmp_path / "run", {"model": base, **_caches(base, tmp_path)}, total=2, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]", "lora.dropout=0"])
    assert "base stored in MXFP4: its quantized weights load dequantized" in capsys.readouterr().out
    cfg = train_config.load(run.config)
    theirs = _dequantized_by_transformers(base)
    loaded = dict(base_model.load_base(cfg.model, torch.float32, torch.device("cpu")).named_parameters())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    # in the run's dtype (transformers 5.17 dequantizes into bf16 whatever the dtype asked)
    assert torch.equal(loaded[name], theirs[name].float()) and loaded[name].dtype == torch.float32

    export = tmp_path / "export"
    adapter = train_and_export(run, base, export)
    trained = load_file(adapter / "adapter_model.safetensors")
    assert any(".mlp.experts." in key for key in trained), sorted(trained)  # the experts trained too
    report = merge_and_verify(base, adapter, export, run.config)
    merged = load_file(export / "merged" / "model.safetensors")
    assert name in merged and not any(key.endswith(("_blocks", "_scales")) for key in merged)
    assert not torch.equal(merged[name].float(), theirs[name])  # the experts' delta is in
    assert "quantization_config" not in json.loads((export / "merged" / "config.json").read_text())
    _, info = tf.AutoModelForCausalLM.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report


@pytest.mark.usefixtures("own_signal_handlers")
def test_full_fine_tuning_of_an_mxfp4_base_writes_a_model_of_numbers(tmp_path):
    """Every weight trains (`lora.enabled=false`, `lora=full`): the consolidated model is in the base's layout
    but for the packed pairs, written as the trained experts (it was refused: "tensor(s) the base does not
    store"), and stock transformers loads it with every tensor read."""
    import transformers as tf
    from kits.train import make_run
    from safetensors.torch import load_file

    from pipeline.export.consolidate import consolidate
    from pipeline.train import stage

    base = tmp_path / "base"
    _save_mxfp4_gpt_oss(base)
    run = make_run(tmp_path / "run", {"model": base, **_caches(base, tmp_path)}, total=2, fraction=0.5, chunks=1,
                   single_stage=True, overrides=["lora=full", "optim.lr=1e-3", "ema.rates=[]"])
    out = run.stage_dir("all")
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    consolidate(out / "checkpoint", base, out_model=tmp_path / "model", models="main")
    written = load_file(tmp_path / "model" / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert name in written and not any(key.endswith(("_blocks", "_scales")) for key in written)
    assert not torch.equal(written[name].float(), _dequantized_by_transformers(base)[name])  # trained
    assert "quantization_config" not in json.loads((tmp_path / "model" / "config.json").read_text())
    _, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not any(info.values()), info


def test_the_fsdp_skeleton_reads_mxfp4_experts_as_numbers(tmp_path):
    from pipeline.config import ModelConfig
    from pipeline.model.base import empty_base
    from pipeline.train.sharded_load import StoredKeys, load_shards, missing_keys

    _save_mxfp4_gpt_oss(tmp_path / "base")
    skeleton = empty_base(ModelConfig(path=str(tmp_path / "base")), torch.float32)
    keys = StoredKeys(tmp_path / "base")
    assert missing_keys(skeleton, keys, set()) == []  # the experts were missing under their live names
    load_shards(skeleton, tmp_path / "base", set(), keys)
    theirs = _dequantized_by_transformers(tmp_path / "base")
    for name, param in skeleton.named_parameters():
        assert torch.equal(param, theirs[name]), name


def test_a_base_stored_in_another_quantized_method_is_refused_at_plan(tiny, tmp_path):
    """GPTQ, AWQ, FP8 with static activation scales: codes the pipeline does not read as numbers; the plan
    refuses the base naming its method."""
    import shutil

    from kits.train import make_run

    for method in ({"quant_method": "gptq", "bits": 4, "group_size": 128},
                   {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}):
        base = tmp_path / method["quant_method"]
        shutil.copytree(tiny["model"], base)
        config = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**config, "quantization_config": method}))
        with pytest.raises(UserError, match=rf"stored quantized .*quant_method={method['quant_method']}.*"
                                            r"unquantized \(bf16\) release"):
            make_run(tmp_path / f"run-{method['quant_method']}", {**tiny, "model": base}, total=10)


def test_a_base_missing_a_weight_is_refused_where_transformers_would_initialise_it(tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.config import ModelConfig
    from pipeline.model.base import load_base

    base = tmp_path / "short"
    shutil.copytree(tiny["model"], base)
    tensors = load_file(base / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"holds no values for 1 parameters .* model\.layers\.1\.mlp\.down_proj"):
        load_base(ModelConfig(path=str(base)), torch.float32, torch.device("cpu"))
