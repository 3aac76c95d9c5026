"""Export of vision-language runs: consolidate, merge (LoRA + the projector saved whole) and verify.

The merged LLaVA must load in a fresh process with stock `AutoModelForImageTextToText` and
`AutoProcessor`, and compute on (image, prompt) inputs what stock peft computes with the base
plus the adapter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from kits.train import make_run, pipeline_env

from pipeline import cli, layout
from pipeline.export.merge import merge_dirs
from pipeline.export.verify import verify
from pipeline.storage import dtypes

# Run in a fresh interpreter: nothing of this test process (no pipeline import) is in it.
STOCK = r"""
import json, sys, torch
from PIL import Image
from peft import PeftModel
from transformers import AutoModelForImageTextToText, AutoProcessor

base, adapter, merged, image = sys.argv[1:5]
processor = AutoProcessor.from_pretrained(merged)
model = AutoModelForImageTextToText.from_pretrained(merged).eval()
conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nwhat color is the shape?"}]}]
prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
inputs = processor(images=[Image.open(image)], text=[prompt], return_tensors="pt")
with torch.no_grad():
    actual = model(**inputs).logits
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id)
    reference = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base), adapter).eval()
    expected = reference(**inputs).logits
print(json.dumps({"max_abs_diff": float((actual - expected).abs().max()), "scale": float(expected.abs().max()),
                  "image_tokens": int((inputs["input_ids"] == model.config.image_token_id).sum()),
                  "new_tokens": generated.shape[1] - inputs["input_ids"].shape[1]}))
"""


@pytest.fixture(scope="module")
def llava_checkpoint(tiny_llava, tmp_path_factory):
    """A trained LLaVA checkpoint: LoRA on the language model, the projector in full, 3 updates."""
    run = make_run(tmp_path_factory.mktemp("llava_export"), tiny_llava, total=3, fraction=0.34, chunks=1,
                   overrides=["vision.train_projector=true", "optim.lr=1e-2"], single_stage=True)
    run.train("all")
    return run.stage_dir("all") / layout.STAGE_CHECKPOINT


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_merged_llava_loads_with_stock_transformers_and_matches_base_plus_adapter(tiny_llava, llava_checkpoint,
                                                                                  tmp_path):
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert cli.main(["consolidate", "--checkpoint", str(llava_checkpoint), "--base", str(tiny_llava["model"]),
                     "--out-adapter", str(adapter), "--models", "main"]) == 0
    config = json.loads((adapter / layout.PEFT_CONFIG).read_text())
    assert config["modules_to_save"] == ["model.multi_modal_projector"]
    merge_dirs(tiny_llava["model"], adapter, merged)
    # the base's key layout (Transformers 5 keeps LLaVA checkpoints in the old one), the projector replaced
    base, out = _tensors(tiny_llava["model"] / "model.safetensors"), _tensors(merged / "model.safetensors")
    assert list(out) == list(base) and "language_model.model.layers.0.self_attn.q_proj.weight" in out
    saved = _tensors(adapter / layout.PEFT_WEIGHTS)
    assert torch.equal(out["multi_modal_projector.linear_1.weight"],
                       saved["base_model.model.model.multi_modal_projector.linear_1.weight"])
    assert not torch.equal(out["multi_modal_projector.linear_1.weight"], base["multi_modal_projector.linear_1.weight"])
    assert not torch.equal(out["language_model.model.layers.1.mlp.up_proj.weight"],
                           base["language_model.model.layers.1.mlp.up_proj.weight"])
    tower = [k for k in base if k.startswith("vision_tower.")]
    assert tower and all(torch.equal(out[k], base[k]) for k in tower)  # frozen in training: the base's own

    image = tiny_llava["data"] / "images" / "test-00000.png"
    proc = subprocess.run([sys.executable, "-c", STOCK, str(tiny_llava["model"]), str(adapter), str(merged), str(image)],
                          capture_output=True, text=True, env=pipeline_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    tolerance = dtypes.relative_logit_tolerance(torch.float32, torch.float32) * max(1.0, got["scale"])
    assert got["image_tokens"] == 16 and got["new_tokens"] > 0
    assert got["max_abs_diff"] <= tolerance, got

    # verify-merge compares on (image, prompt) probes, and tells a wrong merge apart
    report = verify(tiny_llava["model"], adapter, merged, tmp_path / "verification.json")
    assert report["passed"] and report["probe_images"] == 4, report
    unmerged = verify(tiny_llava["model"], adapter, tiny_llava["model"], tmp_path / "unmerged.json")
    assert not unmerged["passed"] and unmerged["max_abs_diff"] > 100 * unmerged["tolerance"]


def test_qwen2_vl_merge_keeps_its_key_layout_and_verifies(tiny_qwen2_vl, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = tiny_qwen2_vl["model"]
    model = AutoModelForImageTextToText.from_pretrained(base)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, modules_to_save=["model.visual.merger"],
                        target_modules=r"(?:model\.language_model)\..*\.(?:q_proj|v_proj|down_proj)")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "modules_to_save" in name:
                param.add_(torch.randn_like(param))
    peft_model.save_pretrained(tmp_path / "adapter")
    merge_dirs(base, tmp_path / "adapter", tmp_path / "merged")
    before, after = _tensors(base / "model.safetensors"), _tensors(tmp_path / "merged" / "model.safetensors")
    assert list(after) == list(before)  # `model.layers.*`, `visual.*`: the layout Qwen2-VL checkpoints keep
    assert not torch.equal(after["visual.merger.mlp.0.weight"], before["visual.merger.mlp.0.weight"])
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    report = verify(base, tmp_path / "adapter", tmp_path / "merged", tmp_path / "verification.json")
    assert report["passed"] and report["probe_images"] == 4, report
