"""Vision-language families of 2026 beyond LLaVA and Qwen2-VL: Qwen2.5-VL, Qwen3-VL, Qwen3.5 (dense and
mixture of experts: its checkpoints are all this composite class), Gemma 3, SmolVLM2, Idefics3, InternVL3,
LLaVA-NeXT, GLM-4.1V (LFM2-VL: refused without torchvision).

Each family's tiny random model, built from its stock transformers class with
a real processor (`tests/kits/vlm.py`), is taken through what the workflow's
rules call: the demo's colour questions tokenized with its processor, a stage of
two updates, the adapter consolidated, the streaming merge into the base's own
layout, `verify-merge` (merged logits == stock base + adapter logits, with
images) and stock loading of the merged dir. For Gemma 3, whose processor runs
without torchvision here, a batch is also compared with what its processor
gives for the same conversation: the same tokens (`<start_of_image>`, which the
template writes, expanded to the soft tokens), pixels and `token_type_ids`
(Gemma 3's attention is bidirectional within an image only with them).
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle

import pytest
import torch
from kits.train import make_run
from kits.vlm import (make_vlm_data, save_gemma3, save_glm4v, save_internvl, save_llava_next, save_qwen_vl,
                      save_smolvlm)

SAVERS = {
    "qwen2_5_vl": lambda path: save_qwen_vl(path, "qwen2_5_vl"),
    "qwen3_vl": lambda path: save_qwen_vl(path, "qwen3_vl"),
    "qwen3_5": lambda path: save_qwen_vl(path, "qwen3_5"),
    "qwen3_5_moe": lambda path: save_qwen_vl(path, "qwen3_5_moe"),
    "gemma3": save_gemma3,
    "smolvlm": save_smolvlm,
    "idefics3": lambda path: save_smolvlm(path, family="idefics3"),
    "internvl": save_internvl,
    "llava_next": save_llava_next,
    "glm4v": save_glm4v,
}

pytestmark = pytest.mark.usefixtures("own_signal_handlers")


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    """Each family's model dir and token caches, made once for the module."""
    return {family: make_vlm_data(tmp_path_factory.mktemp(family), save(tmp_path_factory.mktemp(family) / "model"))
            for family, save in SAVERS.items()}


@pytest.mark.parametrize("family", list(SAVERS))
def test_family_trains_merges_and_verifies(family, vlms, tmp_path):
    from transformers import AutoModelForImageTextToText

    from pipeline.export.consolidate import consolidate
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import verify
    from pipeline.train import stage

    data = vlms[family]
    run = make_run(tmp_path / "run", data, total=2, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]",
                              # peft's ParamWrapper, which adapts fused experts, takes no dropout
                              *(["lora.dropout=0"] if family.endswith("_moe") else [])])
    out = run.stage_dir("all")
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    updates = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(updates) == 2 and all(math.isfinite(r["loss"]) for r in updates)

    export = tmp_path / "export"
    consolidate(out / "checkpoint", data["model"], out_adapter=export / "adapter", models="main")
    if family.endswith("_moe"):  # the experts are trained, not only attention
        adapted = json.loads((export / "adapter" / "adapter_config.json").read_text())["target_parameters"]
        assert {"experts.gate_up_proj", "experts.down_proj"} <= set(adapted), adapted
    merge_dirs(data["model"], export / "adapter", export / "merged")
    report = verify(data["model"], export / "adapter", export / "merged", export / "verification.json", device="cpu")
    assert report["passed"] and report["max_abs_diff"] < 1e-4, report
    merged, info = AutoModelForImageTextToText.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info


def test_gemma3_batches_are_what_its_processor_gives(vlms):
    from transformers import AutoProcessor

    from pipeline.data.cache import TokenCache
    from pipeline.data.formats import load_records
    from pipeline.data.images import open_rgb
    from pipeline.data.tokenize import load_chat
    from pipeline.model import loading
    from pipeline.model.batch import Collator

    data = vlms["gemma3"]
    _, images = load_chat(data["model"])
    assert images.token_types == "token_type_ids" and images.image_token == "<start_of_image>"
    record = load_records(data["data"] / "val.jsonl")[0]
    processor = AutoProcessor.from_pretrained(data["model"])
    text = processor.apply_chat_template(images.conversation(record.messages), tokenize=False)
    theirs = processor(text=[text], images=[[open_rgb(p) for p in record.images]], return_tensors="pt")
    ours = Collator(TokenCache(data["val"]), loading.pad_token_id(data["model"]), images=images)([0]).inputs
    assert bool(theirs.pop("attention_mask").all())  # one record, no padding: ours leaves the mask out
    assert set(theirs) <= set(ours), (sorted(theirs), sorted(ours))
    assert int((theirs["token_type_ids"] == 1).sum()) == 4  # one image, 4 soft tokens
    for key, value in theirs.items():
        same = torch.allclose(ours[key].float(), value.float()) if key == "pixel_values" else torch.equal(ours[key], value)
        assert same, key


def _processor_batch(data, images, processor) -> tuple[dict, dict]:
    """(what `processor` gives for the first validation record's conversation, our collated batch of it)."""
    from pipeline.data.cache import TokenCache
    from pipeline.data.formats import load_records
    from pipeline.data.images import open_rgb
    from pipeline.model import loading
    from pipeline.model.batch import Collator

    record = load_records(data["data"] / "val.jsonl")[0]
    text = processor.tokenizer.apply_chat_template(images.conversation(record.messages), tokenize=False,
                                                   chat_template=images.chat_template)
    # as the processor's apply_chat_template(tokenize=True) calls it: its tokenizer's special tokens too,
    # unless the render opens with the bos
    bos = processor.tokenizer.bos_token
    theirs = processor(text=[text], images=[[open_rgb(p) for p in record.images]], return_tensors="pt",
                       **({"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}))
    ours = Collator(TokenCache(data["val"]), loading.pad_token_id(data["model"]), images=images)([0]).inputs
    assert bool(theirs.pop("attention_mask").all())  # one record, no padding: ours leaves the mask out
    assert set(theirs) == set(ours), (sorted(theirs), sorted(ours))
    return dict(theirs), ours


# image tokens an image of the demo (32x32) expands to, in families whose batches are checked against their processor
IMAGE_TOKENS = {
    "smolvlm": 5 * 4,  # split: 2x2 tiles and the whole image, 4 each, with <fake_token_around_image> and row/col tokens
    "idefics3": 4,  # whole
    "internvl": 4,  # one tile, between <img> and </img>
    "llava_next": 4 + 2 * 2 * 4 + 4,  # anyres: the whole image, a 2x2 grid of tiles unpadded, a newline per row
    "glm4v": 4,  # with image_grid_thw, and mm_token_type_ids for its 3-D RoPE
}


TORCHVISION_VIDEO = {"smolvlm", "internvl", "glm4v"}  # their processors hold a video processor needing torchvision


@pytest.mark.parametrize("family", list(IMAGE_TOKENS))
def test_batches_are_what_the_processor_gives(family, vlms):
    """Our batch of a record == what the family's processor class gives for the same conversation: tokens
    (each image expanded as its size and settings say), pixels and every other image input (SmolVLM's
    `pixel_attention_mask`, LLaVA-NeXT's `image_sizes`, GLM-4.1V's `image_grid_thw` and modality ids).
    LLaVA-NeXT's processor is stock `AutoProcessor`; the others' are their own class built for images only
    (their video processors need torchvision). Pickled first, as a loader worker started by spawn gets it."""
    from pipeline.data.tokenize import load_chat
    from pipeline.data.vision import _processor
    from pipeline.errors import UserError

    data = vlms[family]
    _, images = load_chat(data["model"])
    images = pickle.loads(pickle.dumps(images))
    processor = _processor(data["model"], False)
    if family in TORCHVISION_VIDEO and importlib.util.find_spec("torchvision") is None:  # the stand-in for its video processor refuses any use, saying why
        with pytest.raises(UserError, match="(?i)torchvision"):
            processor.video_processor([])
    theirs, ours = _processor_batch(data, images, processor)
    assert int((theirs["input_ids"] == images.image_token_id).sum()) == IMAGE_TOKENS[family]
    if family == "smolvlm":
        assert images.tokenizer.convert_tokens_to_ids("<row_2_col_2>") in theirs["input_ids"]
    if family == "llava_next":  # its template writes no bos; its processor's tokenization adds Mistral's <s>
        assert int(theirs["input_ids"][0, 0]) == images.tokenizer.bos_token_id
    if family == "glm4v":  # its template ends no turn: the labeller appends the eos, trained, to the last one
        assert int(ours["input_ids"][0, -1]) == images.tokenizer.eos_token_id
        ours = {k: v[:, :-1] if k in ("input_ids", "mm_token_type_ids") else v for k, v in ours.items()}
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_lfm2_vl_without_torchvision_is_refused_in_one_line(tmp_path):
    """LFM2-VL's image processor exists only for torchvision (transformers has no PIL backend for it): without
    torchvision, tokenizing for it stops with one line naming the model and the missing package."""
    from kits.vlm import save_lfm2_vl

    from pipeline.data.tokenize import load_chat
    from pipeline.errors import UserError

    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision is installed: this is the refusal without it")
    except ImportError:
        pass
    model = save_lfm2_vl(tmp_path / "lfm2_vl")
    with pytest.raises(UserError) as refused:
        load_chat(model)
    message = str(refused.value)
    assert str(model) in message and "torchvision" in message and "\n" not in message, message
