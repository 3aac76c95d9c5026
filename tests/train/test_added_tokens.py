"""A base model without a chat template trains with a built-in one: turn markers the vocabulary
lacks are added and their embedding / head rows trained (peft trainable tokens), bitwise
resumable; the exports carry the run's tokenizer and load with stock transformers / peft.

`chatml` on the demo vocabulary adds <|im_start|> and <|im_end|>; `llama3` on a vocabulary that
has its markers adds nothing (tests/kits/token.py builds both bases).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from kits.token import make_base
from kits.train import chain_and_compare, make_run

from pipeline.errors import UserError
from pipeline.export.consolidate import consolidate
from pipeline.export.merge import merge_dirs
from pipeline.export.verify import verify

TOTAL = 7  # pilot 2 + chunk01 2 + chunk02 2 + tail 1 at fraction 0.25
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "repeat: abc"},
            {"role": "assistant", "content": "abc"}]
EMBED = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
HEAD = "base_model.model.lm_head.token_adapter.trainable_tokens_delta"


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("chatml"), "chatml")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return make_base(tmp_path_factory.mktemp("llama3"), "llama3")


def _run(root, base, **kw):
    overrides = [f"model.tokenizer={base['tokenizer']}", *kw.pop("overrides", ())]
    return make_run(root, base, total=kw.pop("total", TOTAL), fraction=0.25, overrides=overrides, **kw)


def _training_render(tokenizer_dir, **kw) -> str:
    """What tokenization renders the conversation as (the run tokenizer through the data code)."""
    from pipeline.data.tokenize import load_tokenizer, render

    texts, errors = render(load_tokenizer(tokenizer_dir), [MESSAGES], add_generation_prompt=False, **kw)
    assert not errors
    return texts[0]


def _check_export_tokenizer(export_dir, base) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(export_dir)
    run_tok = AutoTokenizer.from_pretrained(base["tokenizer"])
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == _training_render(base["tokenizer"])
    prompt = MESSAGES[:2]
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == \
        run_tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert len(tok) == base["chat"]["vocab_size"]
    marker = base["chat"]["end_of_turn"]
    assert tok(marker, add_special_tokens=False)["input_ids"] == [base["chat"]["end_of_turn_id"]]
    eos = json.loads((export_dir / "generation_config.json").read_text())["eos_token_id"]
    assert base["chat"]["end_of_turn_id"] in (eos if isinstance(eos, list) else [eos])


def test_chatml_adds_tokens_trains_their_rows_chunked_equals_one_run_and_exports(chatml, tmp_path):
    chat = chatml["chat"]
    assert chat["added_tokens"] == {"<|im_start|>": 50, "<|im_end|>": 51} and chat["vocab_size"] == 52
    reference = _run(tmp_path / "one", chatml, single_stage=True)
    reference.train("all")
    # adapter, EMA shadows and optimizer state (the token rows among them) byte for byte
    chain_and_compare(_run(tmp_path / "chunked", chatml), reference)

    ckpt = reference.stage_dir("all") / "checkpoint"
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    config = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == {"model.embed_tokens": [50, 51], "lm_head": [50, 51]}
    base = load_file(chatml["model"] / "model.safetensors")
    for key, weight in ((EMBED, "model.embed_tokens.weight"), (HEAD, "lm_head.weight")):
        start = base[weight].mean(dim=0)  # the grown rows' initial value (`vocabulary._grown`)
        assert adapter[key].shape == (2, 32) and adapter[key].dtype == torch.float32
        assert not torch.equal(adapter[key][0], start) and not torch.equal(adapter[key][1], start)
        for rate in ("0.9", "0.99"):
            assert key in load_file(ckpt / "ema" / rate / "adapter_model.safetensors")

    # --- export: adapters and merged model carry the run's tokenizer and the trained rows
    out = tmp_path / "export"
    consolidate(ckpt, chatml["model"], out_adapter=out / "adapter_final", out_adapter_ema=out / "adapter_ema",
                ema_rate="0.99", tokenizer=chatml["tokenizer"])
    merge_dirs(chatml["model"], out / "adapter_final", out / "merged")
    report = verify(chatml["model"], out / "adapter_final", out / "merged", out / "verification.json")
    assert report["passed"] and report["vocab_size"] == 52, report
    for name in ("adapter_final", "adapter_ema", "merged"):
        _check_export_tokenizer(out / name, chatml)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert merged.config.vocab_size == 52
    emb, head = merged.get_input_embeddings().weight, merged.get_output_embeddings().weight
    assert torch.equal(emb[:50], base["model.embed_tokens.weight"]) and torch.equal(head[:50], base["lm_head.weight"])
    assert torch.equal(emb[50:], adapter[EMBED]) and torch.equal(head[50:], adapter[HEAD])

    # the adapter as a user loads it: base, resized to the adapter dir's tokenizer, then peft
    tok = AutoTokenizer.from_pretrained(out / "adapter_final")
    model = AutoModelForCausalLM.from_pretrained(chatml["model"])
    model.resize_token_embeddings(len(tok))
    model = PeftModel.from_pretrained(model, out / "adapter_final").eval()
    ids = tok.apply_chat_template(MESSAGES, return_tensors="pt", return_dict=True)["input_ids"]
    assert 50 in ids and 51 in ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, merged.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_llama3_markers_present_are_used_as_they_are(llama3, tmp_path):
    chat = llama3["chat"]
    assert chat["added_tokens"] == {} and chat["vocab_size"] == chat["base_vocab_size"]
    run = _run(tmp_path / "run", llama3, total=4, single_stage=True)
    run.train("all")
    ckpt = run.stage_dir("all") / "checkpoint"
    assert not json.loads((ckpt / "adapter" / "adapter_config.json").read_text()).get("trainable_token_indices")
    assert not [k for k in load_file(ckpt / "adapter" / "adapter_model.safetensors") if "token_adapter" in k]
    out = tmp_path / "export"
    consolidate(ckpt, llama3["model"], out_adapter=out / "adapter_final", models="main", tokenizer=llama3["tokenizer"])
    merge_dirs(llama3["model"], out / "adapter_final", out / "merged", tokenizer=llama3["tokenizer"])
    assert verify(llama3["model"], out / "adapter_final", out / "merged", out / "v.json")["passed"]
    for name in ("adapter_final", "merged"):
        _check_export_tokenizer(out / name, llama3)


def test_fsdp_with_added_tokens_is_refused_at_plan(chatml, tmp_path):
    with pytest.raises(UserError, match=r"data.chat_template='chatml'.*distributed.strategy=fsdp"):
        _run(tmp_path, chatml, overrides=["distributed.strategy=fsdp"])


def test_full_finetuning_grows_and_exports_the_vocabulary(chatml, tmp_path):
    run = _run(tmp_path / "run", chatml, total=4, single_stage=True, overrides=["lora.enabled=false"])
    run.train("all")
    out = tmp_path / "model"
    consolidate(run.stage_dir("all") / "checkpoint", chatml["model"], out_model=out, models="main",
                tokenizer=chatml["tokenizer"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == 52 and model.get_input_embeddings().weight.shape == (52, 32)
    _check_export_tokenizer(out, chatml)


def test_base_evaluation_runs_on_the_grown_vocabulary(chatml, tmp_path):
    """evaluate_base: the validation data holds the added tokens, so the base is grown as every stage
    starts from it (before the fix, an index error in the embedding)."""
    from pipeline.evaluate.stage import main as evaluate

    run = _run(tmp_path / "run", chatml)
    out = tmp_path / "base.json"
    assert evaluate(["--config", str(run.config), "--stage", "base", "--test", str(chatml["test"]),
                     "--max-new-tokens", "4", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["weights"] == "base" and row["loss"] > 0 and row["n_test"] == 4


def test_tied_embeddings_train_the_shared_rows_and_merge_tied(tmp_path):
    """A tied base (Llama-3.2-1B, Gemma, Qwen3 small): one trained row set serves input and output;
    the merged model stays tied and equals base + adapter."""
    from transformers import AutoModelForCausalLM

    tied = make_base(tmp_path / "base", "chatml", tied=True)
    run = _run(tmp_path / "run", tied, total=4, single_stage=True)
    run.train("all")
    ckpt = run.stage_dir("all") / "checkpoint"
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    rows = [k for k in adapter if "token_adapter" in k]
    assert rows == [EMBED], rows  # no separate head rows: peft ties them to the embedding's
    out = tmp_path / "export"
    consolidate(ckpt, tied["model"], out_adapter=out / "adapter_final", models="main", tokenizer=tied["tokenizer"])
    merge_dirs(tied["model"], out / "adapter_final", out / "merged")
    assert verify(tied["model"], out / "adapter_final", out / "merged", out / "v.json")["passed"]
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    emb = merged.get_input_embeddings().weight
    assert emb.shape[0] == 52 and emb is merged.get_output_embeddings().weight
    assert torch.equal(emb[50:], adapter[EMBED])
