"""A quantized base (model.quantization, QLoRA through bitsandbytes): the settings' errors, the
memory estimate against what bitsandbytes stores, and the model the trainer builds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from kits.train import resolved_config

from pipeline import config as train_config
from pipeline.errors import UserError
from pipeline.model import loading, memory
from pipeline.model.precision import Precision
from pipeline.planning import checks, plan

CONF = Path(__file__).resolve().parents[2] / "config" / "train"
BASE = ["model.path=/m", "tokens.train_cache=/t.safetensors", "ema.rates=[0.9]"]
LLAMA_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}


def _model_dir(tmp_path, config: dict) -> Path:
    """A model dir with its config.json only: the plan's checks and estimate read nothing else."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _plan(tmp_path, *overrides: str, max_length: int = 4096) -> int:
    args = ["--total-updates", "20", "--pilot-fraction", "0.1", "--num-chunks", "2", *resolved_config([*BASE, *overrides]),
            "--export-weights", "raw", "--max-length", str(max_length),
            "--out-plan", str(tmp_path / "plan.json"), "--out-config", str(tmp_path / "train_config.yaml")]
    return plan.main(args)


# --- settings -------------------------------------------------------------------------------------

def test_a_quantized_base_with_full_finetuning_is_refused_naming_both_keys():
    with pytest.raises(UserError) as err:
        train_config.resolve(CONF, "config", [*BASE, "model.quantization=nf4", "lora=full"])
    assert "model.quantization=nf4" in str(err.value) and "lora.enabled=false" in str(err.value)


def test_an_unknown_quantization_names_the_key_and_the_choices():
    with pytest.raises(UserError) as err:
        train_config.resolve(CONF, "config", [*BASE, "model.quantization=int4"])
    assert "model.quantization" in str(err.value) and "nf4" in str(err.value)


def test_a_quantized_base_with_fsdp_is_refused_at_plan_naming_both_keys():
    cfg = train_config.resolve(CONF, "config", [*BASE, "model.quantization=nf4", "distributed=fsdp"])
    problems = checks.cross_check(cfg, export_weights="raw", export_ema_rate=None, world=2)
    assert len(problems) == 1 and "model.quantization=nf4" in problems[0] and "distributed.strategy=fsdp" in problems[0]
    # One process trains unsharded whatever the strategy says: nothing to refuse there.
    assert checks.cross_check(cfg, export_weights="raw", export_ema_rate=None, world=1) == []


def test_without_bitsandbytes_the_plan_names_the_setting_and_the_extra(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    model = _model_dir(tmp_path, LLAMA_8B)
    with pytest.raises(UserError) as err:
        _plan(tmp_path, f"model.path={model}", "model.quantization=nf4")
    assert "model.quantization=nf4" in str(err.value) and '".[quant]"' in str(err.value)
    assert not (tmp_path / "plan.json").exists()


def test_a_base_stored_quantized_is_refused_at_plan(tmp_path):
    model = _model_dir(tmp_path, {**LLAMA_8B, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(UserError) as err:
        _plan(tmp_path, f"model.path={model}", "model.quantization=nf4")
    assert "model.quantization=nf4" in str(err.value) and "quant_method=gptq" in str(err.value)


# --- memory ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, double", [("nf4", True), ("nf4", False), ("fp4", True), ("int8", False)])
def test_quantized_bytes_are_what_bitsandbytes_stores(kind, double):
    """The estimate's bytes for one linear weight against the tensors bitsandbytes keeps for it
    (packed weight, absmax constants, nested constants / row scales), within its small fixed tables."""
    import bitsandbytes as bnb

    rows, cols = 688, 256
    if kind == "int8":
        layer = bnb.nn.Linear8bitLt(cols, rows, bias=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(cols, rows, bias=False, quant_type=kind, compress_statistics=double)
    layer.load_state_dict({"weight": torch.randn(rows, cols)})
    layer = layer.to("cpu")  # quantizes
    stored = sum(t.numel() * t.element_size() for t in layer.state_dict().values() if isinstance(t, torch.Tensor))
    expected = memory.quantized_bytes(kind, rows, cols, double)
    assert expected <= stored <= expected + 2048, (stored, expected)


def _estimate(quantization: str):
    cfg = train_config.resolve(CONF, "config", [*BASE, f"model.quantization={quantization}"])
    shapes = memory.Shapes.from_config(LLAMA_8B)
    run = memory.Run(micro_batch=1, length=2048, world=1, sharded=False, checkpointed=shapes.layers, precision="bf16")
    return memory.estimate(cfg, shapes, run)


def test_a_4bit_base_is_estimated_at_its_packed_size():
    float_base, nf4 = _estimate("none").parts, _estimate("nf4").parts
    bf16 = float_base["weights (bf16)"]
    linear = nf4["weights (nf4 + double quant: linear layers)"]
    rest = nf4["weights (bf16: embeddings, norms, head)"]
    shapes = memory.Shapes.from_config(LLAMA_8B)
    linear_params = shapes.params - rest // 2
    assert linear == pytest.approx(linear_params * (0.5 + 1 / 64 + 4 / (64 * 256)), rel=1e-4)
    assert 0.35 < (linear + rest) / bf16 < 0.36  # 8B: 1.05B of its 8.03B (head, embeddings) stay bf16
    assert _estimate("int8").parts["weights (int8: linear layers)"] == pytest.approx(linear_params, rel=1e-3)


def test_a_run_that_fits_only_with_4_bits_says_so_at_plan(tmp_path, capsys):
    """8B, micro-batch 2 x 4096 tokens on a 22 GiB budget (a 24 GB card): a bf16 base does not fit and
    the plan names model.quantization=nf4 among the knobs; with it the plan passes and says why."""
    model = _model_dir(tmp_path, LLAMA_8B)
    common = [f"model.path={model}", "model.gpu_memory_gb=22", "optim.micro_batch=2", "optim.global_batch=16"]
    with pytest.raises(UserError) as err:
        _plan(tmp_path, *common)
    assert "model.quantization=nf4 (a 4-bit base under LoRA: QLoRA):" in str(err.value)
    assert _plan(tmp_path, *common, "model.quantization=nf4") == 0
    out = capsys.readouterr().out
    assert "weights (nf4 + double quant: linear layers)" in out
    assert "fits only because of model.quantization=nf4" in out and "with a bf16 base it would be" in out


# --- the model the trainer builds ------------------------------------------------------------------

def test_the_quantized_model_trains_adapters_only_and_keeps_one_cpu_kernel(tiny):
    """Every linear layer of the decoder is 4-bit and frozen; only LoRA tensors train; an evaluation
    forward (eval mode, no gradients) does not repack the weights for the inference-only CPU kernel,
    so the training forward after it still sends gradients through the base to every adapter."""
    import bitsandbytes as bnb

    cfg = train_config.resolve(CONF, "config", [f"model.path={tiny['model']}", "tokens.train_cache=/t",
                                                "model.quantization=nf4", "lora.r=4", "lora.dropout=0"])
    model = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7 and all(m.weight.dtype == torch.uint8 for m in quantized)
    names = [n for n, _ in loading.trainable(model)]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in quantized)
    for _, p in loading.trainable(model):  # B starts at zero: give every adapter a non-zero update path
        torch.nn.init.normal_(p, std=0.02)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: float(p.grad.abs().sum()) for n, p in loading.trainable(model)}
    assert all(g > 0 for g in grads.values()), [n for n, g in grads.items() if g == 0][:3]
    assert torch.isfinite(before).all()


_MAPPED = """
import sys, torch
from pipeline import config as train_config
from pipeline.model import loading
cfg = train_config.to_typed({"model": {"path": sys.argv[1], "quantization": "nf4"}, "tokens": {"train_cache": "/t"}})
model = loading.load_base(cfg, torch.float32, torch.device("cpu"))
rss, name = 0, None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if fields and "-" in fields[0] and len(fields) >= 5:
        name = fields[-1] if len(fields) >= 6 else None
    elif line.startswith("Rss:") and name and name.endswith(".safetensors"):
        rss += int(fields[1])
print(rss, sum(p.numel() for p in model.parameters()))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads /proc/self/smaps (Linux)")
def test_a_quantized_base_keeps_no_page_of_its_float_files(tiny):
    """After a quantized load on the CPU no page of the base's safetensors files stays resident: the
    float tensors left (embeddings, norms, head) are copied off the file mapping, which then closes
    (else every float weight read for quantization would stay in host memory)."""
    import subprocess
    import sys

    from kits.train import pipeline_env

    proc = subprocess.run([sys.executable, "-c", _MAPPED, str(tiny["model"])], capture_output=True, text=True,
                          env=pipeline_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mapped_kib, params = map(int, proc.stdout.split()[-2:])
    assert params > 0 and mapped_kib == 0, proc.stdout


@pytest.mark.usefixtures("own_signal_handlers")
def test_a_quantized_gpt2_adapter_merges_into_its_conv1d_weights(tiny, tmp_path):
    """GPT-2 keeps its layers as Conv1D, weights stored [in, out]; quantized, they train as Linear4bit layers,
    whose adapter is a Linear's. The adapter says fan_in_fan_out, as it would trained unquantized: the merge into
    the unquantized base fitted no weight before (c_attn's (32, 96) against a delta of (96, 32)); now it verifies
    against the base + adapter as stock peft loads them."""
    from kits.train import make_run, merge_and_verify, train_and_export
    from test_families import save_family


    base = tmp_path / "gpt2"
    save_family("gpt2", base)
    run = make_run(tmp_path / "run", {"model": base, "train": tiny["train"], "val": tiny["val"]}, total=2,
                   fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]", "lora.dropout=0",
                              "model.quantization=nf4"])
    adapter = train_and_export(run, base, tmp_path / "export")
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    report = merge_and_verify(base, adapter, tmp_path / "export")
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report


def _one_stage_run(config, tokenizer, tiny, tmp_path, quantization: str, *, lr: float):
    """(a random-weight base of `config` with `tokenizer`, a run of one 2-update stage on it with `tiny`'s data)."""
    import transformers as tf
    from kits.train import make_run

    torch.manual_seed(0)
    base = tmp_path / config.model_type
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base, make_run(tmp_path / "run", {"model": base, "train": tiny["train"], "val": tiny["val"]}, total=2,
                          fraction=0.5, chunks=1, single_stage=True,
                          overrides=[f"optim.lr={lr}", "optim.warmup_fraction=0", "ema.rates=[]", "lora.dropout=0",
                                     f"model.quantization={quantization}"])


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("family", ["mamba", "falcon_mamba"])
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_mamba_dt_proj_read_past_its_layer_is_neither_adapted_nor_quantized(family, quantization, tiny, tmp_path):
    """Mamba's forward computes `dt_proj.weight @ x` itself (FalconMamba's too, unless quantized): an adapter on
    dt_proj never trained (its lora_B stayed 0), nf4 Mamba died in its first forward (a 4-bit weight in a
    matmul), and nf4 FalconMamba, which then calls the layer, trained an adapter that stock peft's base +
    adapter leaves out (verify_merge failed). dt_proj is now left out of both; the run trains, merges and
    verifies."""
    import transformers as tf
    from kits.train import merge_and_verify, train_and_export
    from safetensors.torch import load_file

    from pipeline.demo.text import build_tokenizer
    from pipeline.model import quantization as quant
    from pipeline.model import targets

    tokenizer = build_tokenizer()
    config = getattr(tf, "MambaConfig" if family == "mamba" else "FalconMambaConfig")(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, state_size=8, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    base, run = _one_stage_run(config, tokenizer, tiny, tmp_path, quantization, lr=1e-2)
    cfg = train_config.load(run.config)
    found = targets.resolve(tf.AutoModelForCausalLM.from_config(config), cfg.lora, cfg.moe)
    assert "dt_proj" not in found.modules
    assert f"dt_proj (mamba): {family}'s forward reads its weight itself, past the layer" in "\n".join(found.left_out)
    if quantization == "nf4":
        assert quant.quantization_config(cfg.model, torch.float32).llm_int8_skip_modules == ["lm_head", "dt_proj"]
    adapter = train_and_export(run, base, tmp_path / "export")
    adapted = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in load_file(adapter / "adapter_model.safetensors")}
    assert adapted == {"in_proj", "x_proj"}  # peft refuses out_proj and conv1d of Mamba families
    report = merge_and_verify(base, adapter, tmp_path / "export", run.config)
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report


@pytest.mark.usefixtures("own_signal_handlers")
@pytest.mark.parametrize("quantization", ["none", "nf4"])
def test_rwkv_trains_and_verifies_the_function_its_eval_mode_computes(quantization, tiny, tmp_path):
    """RWKV's forward, switched to eval, divides each block's attention `output` and feed-forward `value`
    weights by 2 ** (block // rescale_every) and halves the hidden states every `rescale_every` blocks; the
    LoRA delta beside those weights was not divided, so base + adapter in eval mode (the stages' validation,
    verify_merge's reference) was another model than the one trained, and under nf4 transformers' own
    requantizing step failed ("attribute 'weight' already exists"). The base now loads with the rescaling off:
    train and eval compute one function, and the merged model (which keeps rescale_every, its weights holding
    the delta) verifies against base + adapter."""
    import transformers as tf
    from kits.train import merge_and_verify, train_and_export

    from pipeline.demo.text import build_tokenizer

    tokenizer = build_tokenizer()
    config = tf.RwkvConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, attention_hidden_size=32,
                           intermediate_size=64, context_length=128, rescale_every=2, tie_word_embeddings=False,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id)
    base, run = _one_stage_run(config, tokenizer, tiny, tmp_path, quantization, lr=5e-2)
    cfg = train_config.load(run.config)
    lm = loading.build(cfg, Precision("fp32", "cpu"), torch.device("cpu"))
    with torch.no_grad():  # a trained adapter: every lora_B away from its zero init
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    ids = torch.randint(1, len(tokenizer), (1, 12), generator=torch.Generator().manual_seed(1))
    lm.train()
    trained = lm(input_ids=ids, use_cache=False).logits
    lm.eval()
    evaluated = lm(input_ids=ids, use_cache=False).logits
    assert torch.allclose(trained, evaluated, rtol=1e-4, atol=1e-4), float((trained - evaluated).abs().max())
    del lm
    report = merge_and_verify(base, train_and_export(run, base, tmp_path / "export"), tmp_path / "export", run.config)
    assert tf.AutoConfig.from_pretrained(tmp_path / "export" / "merged").rescale_every == 2
    # the merged model rescales in eval: LayerNorm's eps makes halved hidden states round apart (1.3e-4 seen)
    assert report["passed"] and report["max_abs_diff"] < 1e-3, report


def test_a_model_class_that_cannot_checkpoint_is_never_planned_to(tmp_path, capsys):
    """JetMoe's class has supports_gradient_checkpointing False, and transformers raises when a stage turns
    checkpointing on. JetMoE-8B's shapes at 4 x 4096 tokens on an 80 GB GPU: `auto` chose 11 of 24 layers
    and `on` all of them, both passing the plan to fail in the pilot; now `on` is refused at plan naming the
    setting, and `auto` checkpoints nothing, so the run does not fit and the knobs offered leave checkpointing
    out (a smaller micro-batch fits)."""
    import transformers as tf

    config = tf.JetMoeConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=24, num_key_value_heads=16,
                             kv_channels=128, intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2)
    model = _model_dir(tmp_path, {**config.to_dict(), "architectures": ["JetMoeForCausalLM"]})
    common = [f"model.path={model}", "model.gpu_memory_gb=80", "optim.micro_batch=4", "optim.global_batch=16"]
    with pytest.raises(UserError, match=r"model.activation_checkpointing=on: the model class of .* cannot checkpoint"):
        _plan(tmp_path, *common, "model.activation_checkpointing=on")
    with pytest.raises(UserError) as err:
        _plan(tmp_path, *common, "model.activation_checkpointing=auto")
    message = str(err.value)
    assert "the run does not fit" in message and "activation checkpointing 0 of 24 layers" in message
    assert re.search(r"optim.micro_batch=1 \(accumulation keeps optim.global_batch\): [\d.]+ GiB \(fits\)", message)
    assert "activation_checkpointing=on" not in message and "with activation checkpointing" not in message
