"""Vision-language families of 2026 beyond LLaVA and Qwen2-VL: Qwen2.5-VL, Qwen3-VL, Qwen3.5 (dense and
mixture of experts: its checkpoints are all this composite class), Qwen3-VL-MoE, Gemma 3, Gemma 4 (dense and
with experts), Mistral Small 3 (Pixtral's processor), SmolVLM2, Idefics3, InternVL3, LLaVA-NeXT, LLaVA-OneVision,
GLM-4.1V, GLM-4.5V, Aya Vision and Granite Vision (their composites take no logit scale of their Cohere 2 /
Granite text models: the loss's head check finds that), Llama 3.2 Vision (images read by cross-attention layers
under the processor's `cross_attention_mask`), LFM3-VL (Qwen2-VL's PIL image processor); and
(`tests/kits/vlm_more.py`) Granite 4 Vision (its projector two lists of Q-Formers), HunyuanOCR, Hy4-VL
(experts), MiniCPM-V 4.6 and 4.7 (each image's id in its record written as the processor writes it),
LightOnOCR, Ovis2, Cohere Compass and Cosmos 3 Edge, each also batched as its processor batches. Mistral Large 4
trains and merges, but stock peft does not load its adapter's mixture-of-experts layers, which verify-merge
reports. Refused at tokenize time, each in one line: LFM2-VL, Command A Vision (cohere2_vision), Kimi K2.5,
PerceptionLM, MiniMax-M3-VL, Gemma 4 Unified, Molmo2, Step 3.7, Apertus 1.5 and Nemotron-H Omni without
torchvision (their image processors exist only for it); PaliGemma, a prefix-LM; Idefics2, whose processor
expands image tokens in its own call. Refused at plan time in one line: Gemma 3n, whose vision tower needs
timm (not installed here).
The families new in Transformers 5.24 (`tests/kits/vlm_grid.py`): GLM-4.6V, EXAONE 4.5, HyperCLOVA X Vision v2,
PaddleOCR-VL, and with experts Qwen4-Exp, GLM-5 Next, dots3-note (experts in its tower too) and ERNIE 4.5 VL
(`moe_mm_token_type_ids` route its image tokens to its vision experts); their batches are compared with their
processors' (`test_grid_batches_are_what_the_processor_gives`).
The OCR families (`tests/kits/vlm_ocr.py`): GLM-OCR (GLM-4.6V's processor), Qianfan-OCR (its template writes the
processor's placeholder `<image>`, not the token the features replace), DeepSeek-VL and DeepSeek-VL hybrid (its
SAM path on a high-resolution view part of the tower), each batched as its processor batches
(`test_ocr_batches_are_what_the_processor_gives`); DeepSeek-OCR 2 (SAM and Qwen2-style encoders, 144 learned
queries an image or tile, a DeepSeek text model with experts) batches as its processor does, an image larger than
a tile cropped with its tiles' `pixel_values_local`, trains with its experts adapted and merges, but stock peft
misnames its adapter's keys (its checkpoint conversion's `layers.` renaming matches inside `language_model.layers.`),
which verify-merge reports. Refused at tokenize time without torchvision, each in one line: MiniCPM-OCR and
Unlimited-OCR.

Each family's tiny random model, built from its stock transformers class with
a real processor (`tests/kits/vlm.py`), is taken through what the workflow's
rules call: the demo's colour questions tokenized with its processor, a stage of
two updates, the adapter consolidated, the streaming merge into the base's own
layout, `verify-merge` (merged logits == stock base + adapter logits, with
images) and stock loading of the merged dir. For Gemma 3, whose processor runs
without torchvision here, a batch is also compared with what its processor
gives for the same conversation: the same tokens (`<start_of_image>`, which the
template writes, expanded to the soft tokens), pixels and `token_type_ids`
(Gemma 3's attention is bidirectional within an image only with them); likewise for
Mistral Small 3, whose Pixtral processor rows the `[IMG]`s with `[IMG_BREAK]`s and
pads each image to whole tokens of the tower's patch x the merge.

Without torchvision (here and in CI) the processors of Gemma 4 (a video half) and
Pixtral cannot be built by `AutoProcessor`; their classes are built for images only
(`pipeline.data.processors._image_only`, `processor_class`). Llama 4 is refused at plan time (its composite
has no decoder body the loss can run apart from the head) and, without torchvision,
at tokenize time (its image processor exists only for torchvision); its adapter on the
fused experts is merged and stock-loaded.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle
import sys
from pathlib import Path

import pytest
import torch
from kits.train import make_run
from kits.vlm import (GEMMA3_TEMPLATE, make_vlm_data, save_aya_vision, save_gemma3, save_gemma4, save_glm4v,
                      save_internvl, save_llama4, save_llava_next, save_llava_onevision, save_lfm3_vl, save_mistral3,
                      save_mllama, save_qwen_vl, save_smolvlm)
from kits.vlm_grid import GRID_SAVERS
from kits.vlm_more import MORE_SAVERS
from kits.vlm_ocr import OCR_SAVERS

SAVERS = {
    "qwen2_5_vl": lambda path: save_qwen_vl(path, "qwen2_5_vl"),
    "qwen3_vl": lambda path: save_qwen_vl(path, "qwen3_vl"),
    "qwen3_vl_moe": lambda path: save_qwen_vl(path, "qwen3_vl_moe"),
    "qwen3_5": lambda path: save_qwen_vl(path, "qwen3_5"),
    "qwen3_5_moe": lambda path: save_qwen_vl(path, "qwen3_5_moe"),
    "gemma3": save_gemma3,
    "gemma4": save_gemma4,
    "gemma4_moe": lambda path: save_gemma4(path, moe=True),
    "mistral3": save_mistral3,
    "smolvlm": save_smolvlm,
    "idefics3": lambda path: save_smolvlm(path, family="idefics3"),
    "internvl": save_internvl,
    "llava_next": save_llava_next,
    "llava_onevision": save_llava_onevision,
    "glm4v": save_glm4v,
    "glm4v_moe": lambda path: save_glm4v(path, moe=True),
    "aya_vision": save_aya_vision,
    "granite_vision": lambda path: save_llava_next(path, granite=True),
    "mllama": save_mllama,
    "lfm3_vl": save_lfm3_vl,
    **GRID_SAVERS,
    **MORE_SAVERS,
    **OCR_SAVERS,
}
# Tokens a record may take beyond the default 96: Gemma 4's image is at least 64 soft tokens, DeepSeek-OCR 2's 145,
# Qwen2.5-VL's template writes its default system prompt
MAX_LENGTH = {"gemma4": 160, "gemma4_moe": 160, "deepseek_ocr2_moe": 240, "qwen2_5_vl": 160}
# Families whose processor under an older transformers (the floors env's 5.17, what GPU machines carry) is a form
# the pipeline refuses at tokenize time, and what the one line says: DeepSeek-OCR 2's expands its image tokens in
# its own call, over the whole text, before 5.24
OLDER_FORM_REFUSED = {"deepseek_ocr2_moe": "expands the image tokens inside its own call"}

pytestmark = pytest.mark.usefixtures("own_signal_handlers")


class _Families(dict):
    """Each family's model dir and token caches, made when a test first asks for it (and kept). The kits build
    their models from transformers 5.24's classes: under an older transformers (the floors env's 5.17, what GPU
    machines carry) a family it lacks, or has in an older form, is skipped; its tokenization never is."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, family):
        import transformers
        from packaging.version import Version

        try:
            model = SAVERS[family](self.factory.mktemp(family) / "model")
        except Exception as err:
            if Version(transformers.__version__) >= Version("5.24"):
                raise
            pytest.skip(f"transformers {transformers.__version__} cannot build the kit's {family}: "
                        f"{type(err).__name__}: {' '.join(str(err).split())[:120]}")
        if family in OLDER_FORM_REFUSED and Version(transformers.__version__) < Version("5.24"):
            pytest.skip(f"transformers {transformers.__version__}'s processor of {family} is an older form, refused "
                        "at tokenize time (test_an_older_processor_form_is_refused_in_one_line)")
        self[family] = make_vlm_data(self.factory.mktemp(family), model, max_length=MAX_LENGTH.get(family, 96))
        return self[family]


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    return _Families(tmp_path_factory)


def _needs(*names: str) -> None:
    """Skip where the installed transformers lacks these classes (the floors env's 5.17 predates some families)."""
    import transformers

    missing = [n for n in names if not hasattr(transformers, n)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)}")


def vlms_parts(model_dir):
    """The language model, tower and projector names of the model at `model_dir` (built on the meta device)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForImageTextToText

    from pipeline.model.vision import find_parts

    with init_empty_weights():
        return find_parts(AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir)))


# families stock peft loads no adapter of as saved (its key conversion misnames them): trained and merged, and
# verify-merge's failure checked, by tests of their own
STOCK_PEFT_MISLOADS = {"deepseek_ocr2_moe"}


def _two_updates_consolidated(data: dict, tmp_path, *, moe: bool) -> tuple[Path, Path]:
    """A stage of two updates of LoRA on `data`'s model (`moe`: without dropout, which peft's ParamWrapper, adapting
    fused experts, does not take), consolidated: (the stage's output dir, the export dir holding adapter/)."""
    from pipeline.export.consolidate import consolidate
    from pipeline.train import stage

    run = make_run(tmp_path / "run", data, total=2, fraction=0.5, chunks=1, single_stage=True,
                   overrides=["optim.lr=1e-2", "optim.warmup_fraction=0", "ema.rates=[]",
                              *(["lora.dropout=0"] if moe else [])])
    out = run.stage_dir("all")
    assert stage.main(["--plan", str(run.plan), "--config", str(run.config), "--stage", "all",
                       "--scratch", str(run.scratch("all")), "--out", str(out)]) == 0
    export = tmp_path / "export"
    consolidate(out / "checkpoint", data["model"], out_adapter=export / "adapter", models="main")
    return out, export


@pytest.mark.parametrize("family", [f for f in SAVERS if f not in STOCK_PEFT_MISLOADS])
def test_family_trains_merges_and_verifies(family, vlms, tmp_path):
    from transformers import AutoModelForImageTextToText

    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import verify
    from safetensors.torch import load_file

    data = vlms[family]
    out, export = _two_updates_consolidated(data, tmp_path, moe=family.endswith("_moe"))
    updates = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(updates) == 2 and all(math.isfinite(r["loss"]) for r in updates)

    # LoRA only inside the language model: never the tower (without vision.train_tower) nor the projector
    parts = vlms_parts(data["model"])
    adapted = {k.removeprefix("base_model.model.") for k in load_file(export / "adapter" / "adapter_model.safetensors")}
    outside = sorted(k for k in adapted if not k.startswith(parts.language + "."))
    assert adapted and not outside, outside[:6]
    if family == "mllama":  # its cross-attention layers (text queries, image keys and values) are adapted too
        assert {"cross_attn.q_proj", "cross_attn.k_proj", "cross_attn.v_proj", "cross_attn.o_proj"} <= {
            ".".join(k.split(".lora_")[0].split(".")[-2:]) for k in adapted}, sorted(adapted)
    if family.endswith("_moe"):  # the experts are trained, not only attention (named in full where a tower has some)
        adapted = json.loads((export / "adapter" / "adapter_config.json").read_text())["target_parameters"]
        assert {"experts.gate_up_proj", "experts.down_proj"} <= {".".join(n.split(".")[-2:]) for n in adapted}, adapted
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


def test_mistral3_batches_are_what_its_processor_gives(vlms):
    """Pixtral's processor passes its image processor the tower's patch x the merge (16 pixels): a 32x32 image
    scaled to 24x24 is padded to 32x32, 2 rows of 2 `[IMG]`s, the rows ended by `[IMG_BREAK]`, the last by
    `[IMG_END]` (the image processor alone, with its 8-pixel patch, would keep 24x24: 1 token, 3x3 patches)."""
    from pipeline.data.cache import TokenCache
    from pipeline.data.formats import load_records
    from pipeline.data.images import open_rgb
    from pipeline.data.tokenize import load_chat
    from pipeline.data.processors import processor_class
    from pipeline.model import loading
    from pipeline.model.batch import Collator

    data = vlms["mistral3"]
    _, images = load_chat(data["model"])
    assert images.image_token == "[IMG]" and images.token_types is None
    record = load_records(data["data"] / "val.jsonl")[0]
    processor = processor_class("PixtralProcessor").from_pretrained(data["model"])
    text = processor.apply_chat_template(images.conversation(record.messages), tokenize=False)
    theirs = processor(text=[text], images=[[open_rgb(p) for p in record.images]], return_tensors="pt")
    ours = Collator(TokenCache(data["val"]), loading.pad_token_id(data["model"]), images=images)([0]).inputs
    assert bool(theirs.pop("attention_mask").all())
    assert set(theirs) <= set(ours), (sorted(theirs), sorted(ours))
    tokens = processor.tokenizer.convert_ids_to_tokens(theirs["input_ids"][0])
    assert "[IMG][IMG][IMG_BREAK][IMG][IMG][IMG_END]" in "".join(tokens)
    assert theirs["image_sizes"].tolist() == [[32, 32]]
    for key, value in theirs.items():
        same = torch.allclose(ours[key].float(), value.float()) if key == "pixel_values" else torch.equal(ours[key], value)
        assert same, key
    again = pickle.loads(pickle.dumps(images))  # as a loader worker started fresh gets it
    assert again.inputs(ours["input_ids"], [record.images])["image_sizes"].tolist() == [[32, 32]]


def test_gemma4_image_half_gives_its_inputs(vlms):
    """Gemma 4's processor reads its image tokens off the tokenizer and keeps `num_soft_tokens_per_image` (which
    only its token expansion reads) from the model; its modality ids mark the soft tokens, which its attention
    sees both ways; its logits are soft-capped as its text config says."""
    from transformers import AutoConfig

    from pipeline.data.cache import TokenCache
    from pipeline.data.formats import load_records
    from pipeline.data.tokenize import load_chat
    from pipeline.model import loading
    from pipeline.model.batch import Collator
    from pipeline.model.loss import logit_map

    data = vlms["gemma4"]
    tokenizer, images = load_chat(data["model"])
    assert images.image_token == "<|image|>" and images.token_types == "mm_token_type_ids"
    assert images.pixel_names == ("pixel_values", "image_position_ids")
    batch = Collator(TokenCache(data["val"]), loading.pad_token_id(data["model"]), images=images)([0]).inputs
    assert set(images.pixel_names) <= set(batch)
    text = "".join(tokenizer.convert_ids_to_tokens(batch["input_ids"][0]))
    assert "<|image>" + "<|image|>" * 64 + "<image|>" in text
    assert int(batch["mm_token_type_ids"].sum()) == 64
    assert logit_map(AutoConfig.from_pretrained(data["model"])).cap == 30.0
    path = load_records(data["data"] / "val.jsonl")[0].images[0]
    again = pickle.loads(pickle.dumps(images))  # as a loader worker started fresh gets it
    assert again.expansion(path) == images.expansion(path) and again.pixel_names == images.pixel_names


def test_llama4_without_torchvision_is_refused_clearly(tmp_path):
    """Llama 4's image processor (its tiles) is written for torchvision only: without it, tokenizing names it."""
    import importlib.util

    from pipeline.data.tokenize import load_chat
    from pipeline.errors import UserError

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: Llama 4's processor loads")
    with pytest.raises(UserError, match="(?i)torchvision"):
        load_chat(save_llama4(tmp_path / "model"))


def test_llama4_is_refused_at_plan_time_for_want_of_a_decoder_body(tmp_path):
    """Llama 4's composite merges the image features in its own forward, then runs its language model, a causal
    LM with its head (no module gives the merged hidden states, which the loss needs before the head): the plan
    says so, naming the model."""
    import dataclasses

    from pipeline.config import TrainConfig
    from pipeline.errors import UserError
    from pipeline.model.loading import plan_model

    base = save_llama4(tmp_path / "model")
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(base)),
                              lora=dataclasses.replace(cfg.lora, dropout=0.0))
    with pytest.raises(UserError, match=r"model cannot be trained here: .*Llama4ForConditionalGeneration: no decoder"):
        plan_model(cfg, world=1)


def test_llama4_adapter_on_its_fused_experts_merges_into_its_layout(tmp_path):
    """What can run of Llama 4 without its image processor: LoRA as a run attaches it (the experts' fused
    weights under the composite model, lora.dropout=0), the streaming merge == peft's merge_and_unload saved
    by transformers, tensor by tensor, and the merged dir loads stock and gives the adapted model's logits."""
    import dataclasses

    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from pipeline.config import TrainConfig
    from pipeline.export.merge import merge_dirs
    from pipeline.model.adapter import attach_lora

    base = save_llama4(tmp_path / "base")
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(base)),
                              lora=dataclasses.replace(cfg.lora, dropout=0.0))
    peft = attach_lora(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), cfg)
    assert peft.peft_config["default"].target_parameters == ["experts.down_proj", "experts.gate_up_proj"]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:  # B randomized (not the zero init)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    peft.save_pretrained(tmp_path / "adapter")
    merge_dirs(base, tmp_path / "adapter", tmp_path / "merged")
    ids = torch.randint(0, 50, (1, 12), generator=generator)
    with torch.no_grad():  # (the composite's forward without pixels fails in transformers 5.24: its text model's)
        want = peft.base_model.model.language_model(input_ids=ids).logits
    peft.merge_and_unload().save_pretrained(tmp_path / "reference")
    ours, theirs, before = (load_file(tmp_path / d / "model.safetensors") for d in ("merged", "reference", "base"))
    assert set(ours) == set(theirs) == set(before)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=key)
    assert {k.rsplit(".", 1)[-1] for k in ours if "experts" in k and not torch.equal(ours[k], before[k])} == {
        "gate_up_proj", "down_proj"}
    merged, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(merged.language_model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_a_processor_whose_module_imports_a_torchvision_helper_is_the_real_class():
    """Pixtral's processor module imports a helper of its torchvision image processor; the class comes back
    real (its own `replace_image_token`) with or without torchvision, and no module is left standing in."""
    from transformers.utils.import_utils import DummyObject

    from pipeline.data.processors import processor_class

    before = dict(sys.modules)
    cls = processor_class("PixtralProcessor")
    assert cls is not None and not isinstance(cls, DummyObject)
    assert cls.__name__ == "PixtralProcessor" and "replace_image_token" in vars(cls)
    name = "transformers.models.pixtral.image_processing_pixtral"
    assert sys.modules.get(name) is before.get(name) or sys.modules[name].__name__ == name
    assert processor_class("NoSuchProcessor") is None


def _processor_batch(data, images, processor, **asked) -> tuple[dict, dict]:
    """(what `processor` gives for the first validation record's conversation (`asked`: more call kwargs),
    our collated batch of it)."""
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
                       **({"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}), **asked)
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
    "llava_onevision": 4 + 4 * 4 + 4,  # anyres (max 9 tiles): the whole image, a 2x2 grid of tiles, a newline a row
    "glm4v": 4,  # with image_grid_thw, and mm_token_type_ids for its 3-D RoPE
    "aya_vision": 4,  # one tile: <|START_OF_IMG|>, TILE_GLOBAL, 4 <|IMG_PATCH|>, <|END_OF_IMG|>
    "lfm3_vl": 4,  # Qwen2-VL's image processor: with image_grid_thw
}


# their processors hold a video processor needing torchvision
TORCHVISION_VIDEO = {"smolvlm", "internvl", "glm4v", "llava_onevision", "lfm3_vl"}


@pytest.mark.parametrize("family", list(IMAGE_TOKENS))
def test_batches_are_what_the_processor_gives(family, vlms):
    """Our batch of a record == what the family's processor class gives for the same conversation: tokens
    (each image expanded as its size and settings say), pixels and every other image input (SmolVLM's
    `pixel_attention_mask`, LLaVA-NeXT's `image_sizes`, GLM-4.1V's `image_grid_thw` and modality ids).
    LLaVA-NeXT's processor is stock `AutoProcessor`; the others' are their own class built for images only
    (their video processors need torchvision). Pickled first, as a loader worker started by spawn gets it."""
    from pipeline.data.tokenize import load_chat
    from pipeline.data.processors import build_processor as _processor
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


# Families whose kit holds the template the model ships (sources in tests/kits/vlm.py and
# tests/data/chat_templates/README.md): (what the model writes before an answer, what it ends a turn with)
SHIPPED_TEMPLATE_TURNS = {"qwen2_5_vl": ("", "<|im_end|>"), "qwen3_vl": ("", "<|im_end|>"),
                          "llava_next": (" ", "</s>"), "idefics3": (" ", "<end_of_utterance>"),
                          "smolvlm": (" ", "<end_of_utterance>")}


@pytest.mark.parametrize("family", list(SHIPPED_TEMPLATE_TURNS))
def test_shipped_templates_train_each_answer_and_its_end_of_turn_only(family, vlms):
    """By the generation-prompt principle, under each family's shipped template: what the model writes after the
    generation prompt (LLaVA-NeXT's has none: after `[/INST]`), through the token it stops on, in every assistant
    turn; never the image tokens, the user's turns or Qwen2.5-VL's default system prompt."""
    from pipeline.data import tokenize as tk
    from pipeline.data.formats import Record
    from pipeline.data.labels import supervised_runs

    data = vlms[family]
    tokenizer, images = tk.load_chat(data["model"])
    image = str(data["data"] / "images" / "train-00000.png")
    messages = [{"role": "user", "content": "<image>\nwhat color is it?"}, {"role": "assistant", "content": "red"},
                {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "still red"}]
    enc = tk.encode_records([Record(id="v", messages=messages, images=[image], index=0, line=1)], tokenizer,
                            max_length=512, too_long="error", source="mem", images=images)
    lead, stop = SHIPPED_TEMPLATE_TURNS[family]
    trained = enc.labels != -100
    assert (enc.labels[trained] == enc.input_ids[trained]).all()
    assert supervised_runs(tokenizer, enc.input_ids, enc.labels) == [f"{lead}red{stop}", f"{lead}still red{stop}"]
    is_image = enc.input_ids == images.image_token_id
    assert is_image.any() and (enc.labels[is_image] == -100).all()


def refusal_line(model) -> str:
    """The UserError tokenizing for `model` stops with: one line naming the model."""
    from pipeline.data.tokenize import load_chat
    from pipeline.errors import UserError

    with pytest.raises(UserError) as refused:
        load_chat(model)
    message = str(refused.value)
    assert str(model) in message and "\n" not in message, message
    return message


@pytest.mark.parametrize("family", list(OLDER_FORM_REFUSED))
def test_an_older_processor_form_is_refused_in_one_line(family, tmp_path):
    """Under a transformers older than 5.24, a family in OLDER_FORM_REFUSED builds, and tokenizing for it stops
    with one line naming the model and why (from 5.24 the family's own tests run instead)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.24"):
        pytest.skip(f"transformers {transformers.__version__}: {family} tokenizes (its own tests)")
    assert OLDER_FORM_REFUSED[family] in refusal_line(SAVERS[family](tmp_path / "model"))


@pytest.mark.parametrize("family", ["lfm2_vl", "cohere2_vision", "kimi_k25", "perception_lm"])
def test_torchvision_only_image_processor_is_refused_in_one_line(family, tmp_path):
    """The image processors of LFM2-VL, Command A Vision, Kimi K2.5 and PerceptionLM exist only for torchvision
    (transformers has no PIL backend for them): without torchvision, tokenizing for one stops with one line
    naming the model and the missing package (PerceptionLM's timm tower is refused at plan time even with it)."""
    from kits import vlm

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: this is the refusal without it")
    model = getattr(vlm, f"save_{family}")(tmp_path / family)
    assert "torchvision" in refusal_line(model)


def test_glm4v_moe_lora_reaches_neither_the_projector_nor_an_untrained_tower(vlms):
    """peft's conversion of GLM-4.5V's fused experts would reduce the scoped target regex to bare names (the
    tower's `proj` then names the projector's too) and match `gate_proj.weight` (the dense MLP, adapted through
    its weight) in the tower's MLP and the projector: LoRA stays in the language model, and the tower with
    vision.train_tower, never in the projector."""
    import dataclasses

    from transformers import AutoModelForImageTextToText

    from pipeline.config import TrainConfig
    from pipeline.model.adapter import attach_lora
    from pipeline.model.vision import find_parts

    base = vlms["glm4v_moe"]["model"]
    for tower in (False, True):
        cfg = TrainConfig()
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(base)),
                                  lora=dataclasses.replace(cfg.lora, dropout=0.0),
                                  vision=dataclasses.replace(cfg.vision, train_tower=tower))
        model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
        parts = find_parts(model)
        peft = attach_lora(model, cfg)
        adapted = {n.removeprefix("base_model.model.").split(".lora_")[0] for n, _ in peft.named_parameters()
                   if ".lora_" in n}
        scopes = (parts.language, parts.tower) if tower else (parts.language,)
        outside = sorted(n for n in adapted if n.startswith(parts.projector + ".")
                         or not n.startswith(tuple(s + "." for s in scopes)))
        assert not outside, (tower, outside)
        assert any(n.startswith(parts.language + ".") for n in adapted)
        assert tower == any(n.startswith(parts.tower + ".") for n in adapted), tower


def test_paligemma_a_prefix_lm_is_refused_at_tokenize_time_in_one_line(tmp_path):
    """PaliGemma (2) attends its prompt (image and text, token_type_ids 0) both ways and its answer (the
    processor's `suffix`) causally; chat records trained causally are not that, with a chat template or
    without: tokenizing for it stops with one line naming the model and why."""
    from kits.vlm import save_paligemma

    model = save_paligemma(tmp_path / "paligemma")
    (model / "chat_template.jinja").write_text(GEMMA3_TEMPLATE.replace("<start_of_image>", "<image>"))  # a fine-tune's
    assert "prefix-LM" in refusal_line(model)


def test_idefics2_processor_expanding_in_its_own_call_is_refused_in_one_line(tmp_path):
    """Idefics2's processor has no `replace_image_token` of its own (the base class's raises): it expands the
    image tokens over the whole text in its `__call__` (merging the fake tokens of adjacent images); tokenizing
    for it stops with one line naming the model, not a bare NotImplementedError mid-file."""
    from kits.vlm import save_idefics2

    model = save_idefics2(tmp_path / "idefics2")
    assert "replace_image_token" in refusal_line(model)


def test_llava_onevision_record_of_two_images_is_what_its_processor_gives(vlms, tmp_path):
    """LLaVA-OneVision lays out an image of a record of several without its anyres tiles (the whole image's
    features and a newline: 5 tokens here, not 24) and tells the model how many images each record holds
    (`batch_num_images`): a micro-batch of a two-image record and a one-image record, tokenized and collated,
    is what its processor gives for the two conversations."""
    from pipeline.data.cache import TokenCache
    from pipeline.data.formats import load_records
    from pipeline.data.images import open_rgb
    from pipeline.data.tokenize import load_chat, tokenize_file, tokenizer_fingerprint
    from pipeline.data.processors import build_processor as _processor
    from pipeline.model import loading
    from pipeline.model.batch import Collator

    data = vlms["llava_onevision"]
    tokenizer, images = load_chat(data["model"])
    first, second = load_records(data["data"] / "val.jsonl")[:2]
    pair = [first.images[0], second.images[0]]
    rows = [{"messages": [{"role": "user", "content": "<image><image>\nsame colour?"},
                          {"role": "assistant", "content": "no"}], "images": pair},
            {"messages": [{"role": "user", "content": "<image>\ncolour?"}, {"role": "assistant", "content": "red"}],
             "images": pair[:1]}]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenize_file(tmp_path / "two.jsonl", tokenizer, out_path=tmp_path / "two.safetensors", max_length=96,
                  too_long="error", fingerprint=tokenizer_fingerprint(data["model"]), split="train", images=images)
    cache = TokenCache(tmp_path / "two.safetensors")
    again = pickle.loads(pickle.dumps(images))  # as a loader worker started fresh gets it
    ours = Collator(cache, loading.pad_token_id(data["model"]), images=again)([0, 1]).inputs
    processor = _processor(data["model"], False)
    for k, row in enumerate(rows):
        text = processor.tokenizer.apply_chat_template(images.conversation(row["messages"]), tokenize=False,
                                                       chat_template=images.chat_template)
        theirs = processor(text=[text], images=[[open_rgb(p) for p in row["images"]]], return_tensors="pt")
        length = theirs["input_ids"].shape[1]
        assert torch.equal(ours["input_ids"][k, :length], theirs["input_ids"][0]), k
        assert int((theirs["input_ids"] == images.image_token_id).sum()) == (2 * 5 if k == 0 else 24)
    both = processor(text=["<image><image>", "<image>"], images=[[open_rgb(p) for p in pair], [open_rgb(pair[0])]],
                     return_tensors="pt", padding=True)
    assert ours["batch_num_images"].tolist() == both["batch_num_images"].tolist() == [2, 1]
    for key in ("pixel_values", "image_sizes"):
        assert torch.equal(ours[key], both[key]), key


def test_mllama_micro_batch_is_what_its_processor_gives(vlms, tmp_path):
    """Llama 3.2 Vision keeps each image one `<|image|>` and reads it through cross-attention: a micro-batch of a
    two-image record (a 32x32 image, 1 tile; a 32x16 one, 2 tiles), a one-image record and a record without
    images, tokenized and collated, is what `MllamaProcessor` gives for the three conversations: the tokens, the
    pixels, aspect ratio ids and mask nested per record (the imageless record an empty slot) and the
    `cross_attention_mask` (which tokens attend which tiles of which image). Prompts for generation (left-padded)
    likewise, and verify-merge's probes carry the mask too."""
    from PIL import Image

    from pipeline.data.cache import TokenCache
    from pipeline.data.formats import load_records
    from pipeline.data.images import open_rgb
    from pipeline.data.tokenize import load_chat, tokenize_file, tokenizer_fingerprint
    from pipeline.data.processors import build_processor as _processor
    from pipeline.export.verify import image_probes
    from pipeline.model import loading
    from pipeline.model.batch import Collator
    from pipeline.model.prompts import Prompts

    data = vlms["mllama"]
    tokenizer, images = load_chat(data["model"])
    square = load_records(data["data"] / "val.jsonl")[0].images[0]
    Image.new("RGB", (32, 16), (0, 128, 255)).save(tmp_path / "wide.png")
    rows = [{"messages": [{"role": "user", "content": "<image>one, <image>two: same colour?"},
                          {"role": "assistant", "content": "no"}], "images": [square, str(tmp_path / "wide.png")]},
            {"messages": [{"role": "user", "content": "<image>\ncolour?"}, {"role": "assistant", "content": "red"}],
             "images": [square]},
            {"messages": [{"role": "user", "content": "red?"}, {"role": "assistant", "content": "yes"}]}]
    (tmp_path / "three.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenize_file(tmp_path / "three.jsonl", tokenizer, out_path=tmp_path / "three.safetensors", max_length=96,
                  too_long="error", fingerprint=tokenizer_fingerprint(data["model"]), split="train", images=images)
    again = pickle.loads(pickle.dumps(images))  # as a loader worker started fresh gets it
    ours = Collator(TokenCache(tmp_path / "three.safetensors"), loading.pad_token_id(data["model"]),
                    images=again)([0, 1, 2]).inputs
    processor = _processor(data["model"], False)
    pictures = [[open_rgb(p) for p in row.get("images", [])] for row in rows]

    def rendered(messages, **kwargs):
        return processor.tokenizer.apply_chat_template(images.conversation(messages), tokenize=False,
                                                       chat_template=images.chat_template, **kwargs)

    texts = [rendered(row["messages"]) for row in rows]
    assert all(t.startswith(processor.tokenizer.bos_token) for t in texts)  # so the processor adds no other
    try:
        theirs = processor(text=texts, images=pictures, padding=True, add_special_tokens=False, return_tensors="pt")
    except ValueError as err:  # transformers 5.17's processor: "... or at least one image per sample"
        if "one image per sample" not in str(err):
            raise
        pytest.skip(f"this transformers' mllama processor takes no batch with a record without images: {err}")
    assert set(theirs) == set(ours) | {"attention_mask"} - set(ours), (sorted(theirs), sorted(ours))
    assert int((theirs["input_ids"] == images.image_token_id).sum()) == 3  # an image stays one token
    assert theirs["pixel_values"].shape[:3] == (3, 2, 2) and theirs["aspect_ratio_ids"].tolist() == [[1, 2], [1, 0],
                                                                                                      [0, 0]]
    mask = theirs["cross_attention_mask"]
    assert mask[0, :, 1].sum(0).tolist()[1] > 0 and mask[1, :, 0, 1].sum() == 0 and mask[2].sum() == 0
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key

    prompts = [row["messages"][:1] for row in rows]
    encoded = Prompts(images.tokenizer, images).encode(prompts, [row.get("images", []) for row in rows])
    texts = [rendered(m, add_generation_prompt=True) for m in prompts]
    theirs = processor(text=texts, images=pictures, padding=True, padding_side="left", add_special_tokens=False,
                       return_tensors="pt")
    assert set(theirs) == set(encoded), (sorted(theirs), sorted(encoded))
    for key, value in theirs.items():
        assert torch.equal(encoded[key], value), key
    from transformers import AutoConfig, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(data["model"], dtype=torch.float32).eval()
    with torch.no_grad():  # greedy generation continues from the prompts' own logits
        first = model(**encoded).logits[:, -1].argmax(-1)
        out = model.generate(**encoded, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (3, encoded["input_ids"].shape[1] + 3)
    assert torch.equal(out[:, encoded["input_ids"].shape[1]], first)

    probes = image_probes(data["model"], AutoConfig.from_pretrained(data["model"]), 2, 5, 0, tmp_path)
    head = int((probes["input_ids"][0] == images.image_token_id).nonzero()[0, 0])
    width = probes["input_ids"].shape[1]
    assert probes["cross_attention_mask"].shape[:3] == (2, width, 1)
    assert probes["cross_attention_mask"][:, :, 0, 0].tolist() == [[0] * head + [1] * (width - head)] * 2


def test_gemma3n_without_timm_is_refused_at_plan_time_in_one_line(tmp_path):
    """Gemma 3n's vision tower is a timm model (`TimmWrapperModel`): without timm its composite cannot be built,
    and planning for it stops with one line naming the model and timm, not a bare ImportError."""
    import dataclasses

    from kits.vlm import save_gemma3n

    from pipeline.config import TrainConfig
    from pipeline.errors import UserError
    from pipeline.model.loading import plan_model

    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed: this is the refusal without it")
    model = save_gemma3n(tmp_path / "gemma3n")
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model)))
    with pytest.raises(UserError) as refused:
        plan_model(cfg, world=1)
    message = str(refused.value)
    assert str(model) in message and "timm" in message and "\n" not in message, message


# image tokens a 32x32 image of the demo expands to in the families of `kits.vlm_grid`, each with image_grid_thw
GRID_IMAGE_TOKENS = {"glm46v": 4, "qwen4_exp_moe": 4, "exaone4_5": 4, "ernie4_5_vl_moe": 4, "glm5_next_moe": 4,
                     "dots3_note_moe": 4, "hyperclovax_vision_v2": 4, "paddleocr_vl": 4}


@pytest.mark.parametrize("family", list(GRID_IMAGE_TOKENS))
def test_grid_batches_are_what_the_processor_gives(family, vlms):
    """GLM-4.6V, Qwen4-Exp, EXAONE 4.5, ERNIE 4.5 VL, GLM-5 Next, dots3-note, HyperCLOVA X Vision v2 and
    PaddleOCR-VL: our batch of a record == what the family's processor class (built for images only where its
    video processor needs torchvision; PaddleOCR-VL's is stock `AutoProcessor`) gives for the same conversation:
    tokens, pixels, `image_grid_thw`, the modality ids of the GLMs, ERNIE 4.5 VL and PaddleOCR-VL, and ERNIE's
    `moe_mm_token_type_ids` (image tokens and their start / end token, which its mixture routes to its vision
    experts), which its processor builds from the ids. Pickled first, as a loader worker started by spawn gets
    it."""
    from pipeline.data.processors import build_processor as _processor
    from pipeline.data.tokenize import load_chat

    data = vlms[family]
    _, images = load_chat(data["model"])
    images = pickle.loads(pickle.dumps(images))
    theirs, ours = _processor_batch(data, images, _processor(data["model"], False))
    assert int((theirs["input_ids"] == images.image_token_id).sum()) == GRID_IMAGE_TOKENS[family]
    if family == "ernie4_5_vl_moe":
        assert int(theirs["moe_mm_token_type_ids"].sum()) == GRID_IMAGE_TOKENS[family] + 2
    if family in ("glm46v", "glm5_next_moe"):  # GLM-4.1V's turns end none: the labeller appends the eos to the last
        assert int(ours["input_ids"][0, -1]) == images.tokenizer.eos_token_id
        ours = {k: v[:, :-1] if k in ("input_ids", "mm_token_type_ids") else v for k, v in ours.items()}
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("family, projector", [("ernie4_5_vl_moe", "model.resampler_model"),
                                               ("hyperclovax_vision_v2", "model.projector"),
                                               ("paddleocr_vl", "model.projector")])
def test_projector_beside_the_tower_is_found(family, projector, vlms):
    """A projector no known name finds (ERNIE 4.5 VL's `resampler_model`), or found only as the tower's own
    merger (HyperCLOVA X Vision v2's Qwen2.5-VL tower has one; its `projector` maps the tower's output into the
    language model) is the one weighted module beside the tower and the language model: what
    vision.train_projector trains, and full fine-tuning leaves frozen without it."""
    parts = vlms_parts(vlms[family]["model"])
    assert parts.projector == projector and parts.tower != projector, parts


def test_ernie_vl_image_tokens_train_its_vision_experts(vlms):
    """ERNIE 4.5 VL routes a token to its text or its vision experts by `moe_mm_token_type_ids`: in a training
    batch (its image tokens and their start / end marked, as its processor marks them) the loss reaches the
    LoRA of both kinds of experts; without the ids, only the text experts'."""
    import dataclasses

    from transformers import AutoModelForImageTextToText

    from pipeline.config import TrainConfig
    from pipeline.data.cache import TokenCache
    from pipeline.data.tokenize import load_chat
    from pipeline.model import loading
    from pipeline.model.adapter import attach_lora
    from pipeline.model.batch import Collator
    from pipeline.model.loss import TokenLoss

    data = vlms["ernie4_5_vl_moe"]
    _, images = load_chat(data["model"])
    batch = Collator(TokenCache(data["val"]), loading.pad_token_id(data["model"]), images=images)([0, 1])
    assert int(batch.inputs["moe_mm_token_type_ids"].sum()) == 2 * 6  # 4 image tokens, start and end, per record
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(data["model"])),
                              lora=dataclasses.replace(cfg.lora, dropout=0.0))
    torch.manual_seed(0)
    peft = attach_lora(AutoModelForImageTextToText.from_pretrained(data["model"], dtype=torch.float32), cfg)
    loss = TokenLoss(peft)

    def reached(inputs) -> set[str]:
        peft.zero_grad(set_to_none=True)
        loss(dataclasses.replace(batch, inputs=inputs)).backward()
        return {kind for kind in ("text_moe", "vision_moe") for n, p in peft.named_parameters()
                if f"{kind}.experts" in n and "lora_B" in n and p.grad is not None and bool(p.grad.any())}

    assert reached(batch.inputs) == {"text_moe", "vision_moe"}
    assert reached({k: v for k, v in batch.inputs.items() if k != "moe_mm_token_type_ids"}) == {"text_moe"}


# families of tests/kits/vlm_more.py: image tokens a demo image (32x32) expands to, as their processors write them
MORE_IMAGE_TOKENS = {
    "cosmos3_edge": 4,  # Qwen's tokens, image_grid_thw and modality ids (which its processor gives when asked)
    "cohere_compass": 4,  # Qwen3-VL's layout: with image_grid_thw and modality ids
    "granite4_vision": 4 + 2 * 2 + 2,  # anyres: the whole image, one tile unpadded, a newline per row (1/2 downsampled)
    "hunyuan_vl": 2 * (2 + 1) + 2,  # 2 rows of 2 merged patches and a newline, between begin and end features
    "hy_v4_vl_moe": 2 * (2 + 1),  # 2 rows of 2 merged patches and a newline
    "lighton_ocr": 2 * 2,  # Pixtral's image processor, its patch the tower's x the merge: no [IMG_BREAK] rows
    "minicpmv4_6": 4,  # kept whole, between <image> and </image>, after its id in the record
    "minicpmv4_7": 4,  # likewise, with modality ids
    "ovis2": 4,  # visual words between <IMG_START> and <IMG_GRID>, <IMG_END> after
}


@pytest.mark.parametrize("family", list(MORE_IMAGE_TOKENS))
def test_more_batches_are_what_the_processor_gives(family, vlms):
    """Our batch of a record == what the family's processor gives for the same conversation: Cosmos 3 Edge's
    (modality ids asked for: its model needs them, its processor names them among its inputs), HunyuanOCR's
    (`<image>`s expanded between its start and end tokens, `image_grid_thw`, modality ids for its multimodal
    RoPE), Granite 4 Vision's, LightOnOCR's, Ovis2's, Cohere Compass's, Hy4-VL's and MiniCPM-V 4.6's and 4.7's
    (those with a video processor built for images only); MiniCPM-V's `__call__` also writes each image's index in its record
    before it (`<image_id>0</image_id>`), which the pipeline writes too. Pickled first, as a loader worker started
    by spawn gets it."""
    from pipeline.data.processors import build_processor as _processor
    from pipeline.data.tokenize import load_chat

    data = vlms[family]
    _, images = load_chat(data["model"])
    images = pickle.loads(pickle.dumps(images))
    processor = _processor(data["model"], False)
    # Cosmos 3 Edge's model needs the modality ids, which its processor gives when asked
    asked = {"return_mm_token_type_ids": True} if family == "cosmos3_edge" else {}
    theirs, ours = _processor_batch(data, images, processor, **asked)
    assert int((theirs["input_ids"] == images.image_token_id).sum()) == MORE_IMAGE_TOKENS[family]
    if family.startswith("minicpmv"):
        text = "".join(images.tokenizer.convert_ids_to_tokens(theirs["input_ids"][0]))
        assert "<image_id>0</image_id><image>" + "<|image_pad|>" * 4 + "</image>" in text
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_a_stand_in_video_processor_gives_its_saved_settings(vlms):
    """MiniCPM-V 4.6's processor reads its video processor's `slice_mode` when it is built: without torchvision
    the stand-in gives the saved setting, and refuses a setting it was not saved with, naming what is missing."""
    from pipeline.data.processors import build_processor as _processor

    processor = _processor(vlms["minicpmv4_6"]["model"], False)
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the video processor is built")
    assert processor.video_slice_mode is True and processor.video_processor.downsample_mode == "16x"
    with pytest.raises(AttributeError, match="(?i)video_processor.*torchvision.*'no_such_setting'"):
        processor.video_processor.no_such_setting


def test_mistral_large4_trains_and_merges_but_stock_peft_drops_its_moe_adapter(tmp_path):
    """Mistral Large 4 (Pixtral's processor; multi-head latent attention with a sparse-attention indexer; experts
    stored fused; logits soft-capped) trains with its experts adapted, and the streaming merge is base + adapter:
    its logits on verify-merge's probes are those of the base with the adapter's every tensor loaded as saved.
    Stock `PeftModel.from_pretrained` does not load the adapter of its mixture-of-experts layers (peft renames
    the adapter's keys by the family's checkpoint conversion, which maps `mlp.shared_experts` to
    `mlp.mlp.shared_experts`), so verify-merge fails, saying which tensors stock peft left out."""
    _needs("MistralLarge4Config")
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from kits.vlm_more import save_mistral_large4
    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import image_probes, verify

    data = make_vlm_data(tmp_path / "data", save_mistral_large4(tmp_path / "model"))
    _, export = _two_updates_consolidated(data, tmp_path, moe=True)
    settings = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(settings["target_parameters"])
    merge_dirs(data["model"], export / "adapter", export / "merged")

    report = verify(data["model"], export / "adapter", export / "merged", export / "verification.json", device="cpu")
    left_out = report["adapter_not_loaded"]["first"]
    assert not report["passed"] and left_out and all(".layers.1.mlp." in k for k in left_out), report

    # the base with the adapter's tensors put in as saved (no key conversion): the merged model's logits
    base = AutoModelForImageTextToText.from_pretrained(data["model"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**{k: v for k, v in settings.items() if k in (
        "r", "lora_alpha", "target_modules", "target_parameters", "lora_dropout")}))
    saved = load_file(export / "adapter" / "adapter_model.safetensors")
    missing, unexpected = model.load_state_dict(
        {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
         for k, v in saved.items()}, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k], (unexpected, missing)
    probes = image_probes(data["model"], AutoConfig.from_pretrained(data["model"]), 2, 8, 0, tmp_path)
    merged, info = AutoModelForImageTextToText.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(**probes).logits, model.eval()(**probes).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["molmo2", "step3p7"])
def test_more_torchvision_only_image_processors_are_refused_in_one_line(family, tmp_path):
    """MiniMax-M3-VL, Gemma 4 Unified, Molmo2, Step 3.7, Apertus 1.5 and Nemotron-H Omni have image processors
    for torchvision only (transformers 5.24 has no PIL backend for them): without torchvision, tokenizing for one
    stops with one line naming the model and the package. Two of them stand for all six here."""
    from kits.vlm_more import TORCHVISION_ONLY, save_torchvision_only

    _needs(TORCHVISION_ONLY[family][0])
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: this is the refusal without it")
    assert "torchvision" in refusal_line(save_torchvision_only(tmp_path / family, family))


def test_composites_steps_after_the_head_are_read_off_their_text_configs():
    """Mistral Large 4's composite soft-caps its logits, Granite 4 Vision's divides them by its text model's
    `logits_scaling`, Cohere Compass's multiplies them by its `logit_scale` (their stock forwards): the loss takes
    the same step, read off the text config's type (`mistral_large4_text`, ...). At a tiny model's small logits
    the head probe cannot tell a soft-cap of 30 from none, so the map itself is checked."""
    _needs("CohereCompassConfig", "Granite4VisionConfig", "MistralLarge4Config")
    from transformers import CohereCompassConfig, Granite4VisionConfig, MistralLarge4Config

    from pipeline.model.loss import logit_map

    assert logit_map(MistralLarge4Config(text_config={"final_logit_softcapping": 30.0})).cap == 30.0
    assert logit_map(Granite4VisionConfig(text_config={"logits_scaling": 8.0})).scale == 1 / 8
    assert logit_map(CohereCompassConfig(text_config={"logit_scale": 0.25})).scale == 0.25
    assert not logit_map(CohereCompassConfig(text_config={"logit_scale": None}))


def test_granite4_vision_projector_is_its_q_formers_together(vlms):
    """Granite 4 Vision's projector is two module lists side by side (the deepstack and the spatial Window
    Q-Formers): LoRA reaches neither, vision.train_projector trains both in full (peft modules_to_save), and full
    fine-tuning freezes both unless asked."""
    import dataclasses

    from transformers import AutoModelForImageTextToText

    from pipeline.config import TrainConfig
    from pipeline.model.adapter import attach_lora
    from pipeline.model.vision import find_parts, freeze_for_full_finetuning

    base = vlms["granite4_vision"]["model"]
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    parts = find_parts(model)
    assert parts.projectors == ("model.layerwise_projectors", "model.spatial_projectors"), parts
    freeze_for_full_finetuning(model, parts, train_projector=False, train_tower=False)
    frozen = [n for n, p in model.named_parameters() if n.startswith(parts.projectors) and not p.requires_grad]
    assert frozen and not [n for n, p in model.named_parameters() if n.startswith(parts.projectors) and p.requires_grad]
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(base)),
                              vision=dataclasses.replace(cfg.vision, train_projector=True))
    peft = attach_lora(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), cfg)
    # peft wraps modules, not module lists: each Q-Former is saved whole
    assert {f"{p}.{k}" for p, k in [(parts.projector, 0), *((p, k) for p in parts.more_projectors for k in range(4))]
            } <= set(peft.peft_config["default"].modules_to_save), peft.peft_config["default"].modules_to_save
    trained = {n.split(".modules_to_save.")[0].removeprefix("base_model.model.") for n, p in peft.named_parameters()
               if p.requires_grad and ".modules_to_save." in n}
    assert {n.rsplit(".", 1)[0] for n in trained} == set(parts.projectors), sorted(trained)
    assert not [n for n, _ in peft.named_parameters() if ".lora_" in n and n.split("base_model.model.")[1].startswith(
        parts.projectors)]


def test_more_projectors_are_found_whole(vlms):
    """The projector of each family, as find_parts names it: Cosmos 3 Edge's is its `projector`, HunyuanOCR's and
    Hy4-VL's their tower's patch merger, LightOnOCR's its `vision_projection` (not the patch merger inside it),
    MiniCPM-V 4.6's its merger, Ovis2's its visual embedding table."""
    found = {family: vlms_parts(vlms[family]["model"]).projector
             for family in ("cosmos3_edge", "hunyuan_vl", "hy_v4_vl_moe", "lighton_ocr", "minicpmv4_6", "ovis2")}
    assert found == {"cosmos3_edge": "model.projector", "hunyuan_vl": "model.vision_tower.patch_merger",
                     "hy_v4_vl_moe": "model.vision_tower.patch_merger", "lighton_ocr": "model.vision_projection",
                     "minicpmv4_6": "model.merger", "ovis2": "model.visual_embeddings_table"}, found


def test_deepseek_ocr2_trains_and_merges_but_stock_peft_misnames_its_adapter(vlms, tmp_path):
    """DeepSeek-OCR 2 (a SAM-style encoder and a Qwen2-style one with learned queries; a DeepSeek text model, its
    sparse layer a mixture of 4 experts stored fused) trains with its experts adapted, and the streaming merge is
    base + adapter: its logits on verify-merge's probes (images included) are those of the base with the
    adapter's every tensor put in as saved. Stock `PeftModel.from_pretrained` loads none of the adapter's LoRA
    where it belongs: peft renames an adapter's keys by the family's checkpoint conversion, whose unanchored
    `(^|model\\.)layers\\.` -> `\\1language_model.layers.` also matches inside `language_model.layers.` (the
    module names the adapter holds, as peft saves it): `model.language_model.layers.0...` becomes
    `model.language_model.language_model.layers.0...`, no module. So verify-merge fails, saying which tensors
    stock peft left out."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    from pipeline.export.merge import merge_dirs
    from pipeline.export.verify import image_probes, verify

    data = vlms["deepseek_ocr2_moe"]
    _, export = _two_updates_consolidated(data, tmp_path, moe=True)
    settings = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= {
        ".".join(n.split(".")[-2:]) for n in settings["target_parameters"]}, settings["target_parameters"]
    saved = load_file(export / "adapter" / "adapter_model.safetensors")
    assert saved and all(k.startswith("base_model.model.model.language_model.layers.") for k in saved), sorted(saved)
    merge_dirs(data["model"], export / "adapter", export / "merged")

    report = verify(data["model"], export / "adapter", export / "merged", export / "verification.json", device="cpu")
    assert not report["passed"] and report["adapter_not_loaded"]["count"] == len(saved), report

    # the base with the adapter's tensors put in as saved (no key conversion): the merged model's logits
    base = AutoModelForImageTextToText.from_pretrained(data["model"], dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**{k: v for k, v in settings.items() if k in (
        "r", "lora_alpha", "target_modules", "target_parameters", "lora_dropout")}))
    missing, unexpected = model.load_state_dict(
        {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
         for k, v in saved.items()}, strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k], (unexpected, missing)
    probes = image_probes(data["model"], AutoConfig.from_pretrained(data["model"]), 2, 8, 0, tmp_path)
    assert int((probes["input_ids"] == AutoConfig.from_pretrained(data["model"]).image_token_id).sum()) == 2 * 145
    merged, info = AutoModelForImageTextToText.from_pretrained(export / "merged", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(**probes).logits, model.eval()(**probes).logits,
                                   rtol=1e-4, atol=1e-4)


# image tokens a 32x32 image of the demo expands to in the families of `kits.vlm_ocr`, as their processors write them
OCR_IMAGE_TOKENS = {
    "deepseek_ocr2_moe": 12 * 12 + 1,  # not cropped: its global view's 144 queries and the view separator
    "glm_ocr": 4,  # GLM-4.6V's processor: with image_grid_thw and modality ids
    "qianfan_ocr": 4,  # one tile, between <img> and </img>
    "deepseek_vl": 16,  # a feature a patch
    "deepseek_vl_hybrid": 16,  # likewise, with the high-resolution view's pixels
}


@pytest.mark.parametrize("family", list(OCR_IMAGE_TOKENS))
def test_ocr_batches_are_what_the_processor_gives(family, vlms):
    """Our batch of a record == what the family's processor gives for the same conversation: DeepSeek-OCR 2's
    (stock `AutoProcessor`): tokens, its global view's pixels and `num_local_patches`; GLM-OCR's (GLM-4.6V's
    processor built for images only): tokens, pixels, `image_grid_thw` and modality ids; Qianfan-OCR's (stock
    `AutoProcessor`), whose template writes its placeholder `<image>`, not the `<IMG_CONTEXT>` the features
    replace: tokens and pixels. Pickled first, as a loader worker started by spawn gets it."""
    from pipeline.data.processors import build_processor as _processor
    from pipeline.data.tokenize import load_chat

    data = vlms[family]
    _, images = load_chat(data["model"])
    images = pickle.loads(pickle.dumps(images))
    theirs, ours = _processor_batch(data, images, _processor(data["model"], False))
    assert int((theirs["input_ids"] == images.image_token_id).sum()) == OCR_IMAGE_TOKENS[family]
    if family == "glm_ocr":  # GLM-4.1V's turns end none: the labeller appends the eos to the last
        assert int(ours["input_ids"][0, -1]) == images.tokenizer.eos_token_id
        ours = {k: v[:, :-1] if k in ("input_ids", "mm_token_type_ids") else v for k, v in ours.items()}
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("family", ["minicpm_ocr", "unlimited_ocr"])
def test_ocr_torchvision_only_image_processors_are_refused_in_one_line(family, tmp_path):
    """MiniCPM-OCR's and Unlimited-OCR's image processors exist only for torchvision (transformers 5.24 has no PIL
    backend for them): without torchvision, tokenizing for one stops with one line naming the model and the
    package."""
    from kits.vlm_ocr import OCR_TORCHVISION_ONLY, save_ocr_torchvision_only

    _needs(OCR_TORCHVISION_ONLY[family][0])
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: this is the refusal without it")
    assert "torchvision" in refusal_line(save_ocr_torchvision_only(tmp_path / family, family))


def test_deepseek_vl_hybrid_high_resolution_view_is_part_of_its_tower(vlms):
    """DeepSeek-VL's projector is its `aligner`; its hybrid's SAM path on the high-resolution copy of the image
    (an encoder, a neck, a projection and a bare mixing weight beside the SigLIP tower) is part of the tower:
    full fine-tuning freezes it with the tower unless vision.train_tower, and LoRA stays out of it."""
    from transformers import AutoModelForImageTextToText

    from pipeline.model.vision import find_parts, freeze_for_full_finetuning, in_lora_scope

    assert vlms_parts(vlms["deepseek_vl"]["model"]).projector == "model.aligner"
    model = AutoModelForImageTextToText.from_pretrained(vlms["deepseek_vl_hybrid"]["model"], dtype=torch.float32)
    parts = find_parts(model)
    assert parts.tower == "model.vision_model" and parts.projector == "model.aligner", parts
    assert parts.more_towers == ("model.high_res_vision_model", "model.high_res_vision_neck",
                                 "model.high_res_vision_proj", "model.high_res_vision_alpha"), parts
    high_res = [n for n, _ in model.named_parameters() if n.startswith("model.high_res_vision_")]
    assert "model.high_res_vision_alpha" in high_res
    for train_tower in (False, True):
        freeze_for_full_finetuning(model, parts, train_projector=False, train_tower=train_tower)
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trained.isdisjoint(high_res) != train_tower, (train_tower, sorted(trained))
        assert any(n.startswith("model.language_model.") for n in trained)
    assert not in_lora_scope(parts, "model.high_res_vision_model.layers.0.attn.qkv", tower=False)
    assert in_lora_scope(parts, "model.high_res_vision_model.layers.0.attn.qkv", tower=True)


def test_deepseek_ocr2_image_larger_than_a_tile_is_cropped_as_its_processor_crops_it(vlms, tmp_path):
    """DeepSeek-OCR 2 crops an image larger than its tile (48 px here, 768 shipped) into tiles, read by the same
    tower before the global view: a 64x32 image is 2 tiles of 144 queries, the global view's 144 and the view
    separator, the tiles' pixels in `pixel_values_local`, which its image processor gives but does not declare.
    Our batch of such a record == what its processor gives, and the model reads it (features == tokens)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from pipeline.data.cache import TokenCache
    from pipeline.data.images import open_rgb
    from pipeline.data.processors import build_processor as _processor
    from pipeline.data.tokenize import load_chat, tokenize_file, tokenizer_fingerprint
    from pipeline.model import loading
    from pipeline.model.batch import Collator

    data = vlms["deepseek_ocr2_moe"]
    tokenizer, images = load_chat(data["model"])
    Image.new("RGB", (64, 32), (0, 128, 255)).save(tmp_path / "wide.png")
    row = {"messages": [{"role": "user", "content": "<image>\nread it"}, {"role": "assistant", "content": "blue"}],
           "images": [str(tmp_path / "wide.png")]}
    (tmp_path / "wide.jsonl").write_text(json.dumps(row) + "\n")
    tokenize_file(tmp_path / "wide.jsonl", tokenizer, out_path=tmp_path / "wide.safetensors", max_length=480,
                  too_long="error", fingerprint=tokenizer_fingerprint(data["model"]), split="train", images=images)
    again = pickle.loads(pickle.dumps(images))  # as a loader worker started fresh gets it
    ours = Collator(TokenCache(tmp_path / "wide.safetensors"), loading.pad_token_id(data["model"]),
                    images=again)([0]).inputs
    processor = _processor(data["model"], False)
    text = processor.tokenizer.apply_chat_template(images.conversation(row["messages"]), tokenize=False,
                                                   chat_template=images.chat_template)
    theirs = processor(text=[text], images=[[open_rgb(row["images"][0])]], return_tensors="pt")
    assert bool(theirs.pop("attention_mask").all())
    assert set(theirs) == set(ours), (sorted(theirs), sorted(ours))
    assert int((theirs["input_ids"] == images.image_token_id).sum()) == 3 * 144 + 1
    assert theirs["num_local_patches"].tolist() == [2] and tuple(theirs["pixel_values_local"].shape) == (2, 3, 48, 48)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    model = AutoModelForImageTextToText.from_pretrained(data["model"], dtype=torch.float32).eval()
    with torch.no_grad():
        assert model(**ours).logits.shape[1] == ours["input_ids"].shape[1]
