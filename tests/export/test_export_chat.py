"""`python -m pipeline chat` on tiny exports: a merged dir and the adapter it was merged from answer alike,
greedily as the smoke test decodes; stdin, system turns, sampling, refusals."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from export_helpers import save_adapter, save_base

QUESTIONS = ["repeat: abc", "repeat: hello", "repeat: xyz"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """base/, tokenizer/ (the run's, with the demo's chat template), adapter/ (an export: the run's
    tokenizer carried) and merged/ (merged from it, as merge_lora does)."""
    from pipeline.data.prepare import prepare
    from pipeline.export.merge import merge_dirs
    from pipeline.export.tokenizer import carry_tokenizer

    root = tmp_path_factory.mktemp("chat")
    model = save_base(root / "base", shard=None)
    save_adapter(model, root / "adapter")
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(root / "base")
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    prepare(root / "base", root / "tokenizer", None)
    carry_tokenizer(root / "adapter", root / "tokenizer")
    merge_dirs(root / "base", root / "adapter", root / "merged")
    return root


def reference_answers(root, questions, max_new_tokens=6):
    """Greedy answers of the in-memory base + adapter, decoded by the smoke test's code."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.evaluate.metrics import HeldOut, exact_match
    from pipeline.model.prompts import Prompts

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapter").eval()
    prompts = Prompts(AutoTokenizer.from_pretrained(root / "adapter"))
    examples = [HeldOut([{"role": "user", "content": q}], "", []) for q in questions]
    result = exact_match(model, prompts, examples, device=torch.device("cpu"), max_new_tokens=max_new_tokens,
                         keep=len(examples))
    return [s["answer"] for s in result["samples"]]


def test_merged_and_adapter_answer_as_the_smoke_test_decodes(exports):
    from pipeline.export.chat import answer, load

    expected = reference_answers(exports, QUESTIONS)
    for name in ("merged", "adapter"):
        model, prompts = load(exports / name)
        assert answer(model, prompts, QUESTIONS, max_new_tokens=6) == expected, name


def test_cli_prompt_stdin_and_each_line(exports, capsys, monkeypatch):
    from pipeline.cli import main

    expected = reference_answers(exports, QUESTIONS)
    assert main(["chat", str(exports / "merged"), "--prompt", QUESTIONS[0], "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected[0] + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(QUESTIONS) + "\n\n"))
    assert main(["chat", str(exports / "adapter"), "--each-line", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.splitlines() == [a.replace("\n", "\\n") for a in expected]
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTIONS[1] + "\n"))
    assert main(["chat", str(exports / "merged"), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected[1] + "\n"


def test_system_turn_and_seeded_sampling(exports):
    from pipeline.export.chat import answer, load

    model, prompts = load(exports / "merged")
    # the system turn is rendered by the template (the demo template keeps it): another prompt
    enc = prompts.encode([[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]], [[]])
    assert "be brief" in prompts.tokenizer.decode(enc["input_ids"][0])
    assert answer(model, prompts, QUESTIONS, system="be brief", max_new_tokens=4)
    first = answer(model, prompts, QUESTIONS, sample=True, temperature=1.5, top_p=0.9, seed=3, max_new_tokens=6)
    again = answer(model, prompts, QUESTIONS, sample=True, temperature=1.5, top_p=0.9, seed=3, max_new_tokens=6)
    assert first == again


def test_refusals(exports, tmp_path, capsys):
    from pipeline.cli import main

    assert main(["chat", str(tmp_path / "missing"), "--prompt", "x"]) != 0
    assert "is not a directory" in capsys.readouterr().err
    assert main(["chat", str(exports / "base"), "--prompt", "x", "--seed", "1"]) != 0
    assert "--sample" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["chat", str(tmp_path / "empty"), "--prompt", "x"]) != 0
    assert "neither a model dir" in capsys.readouterr().err


def test_vision_language_export_is_refused_clearly(tmp_path, capsys):
    from kits.vlm import save_llava

    from pipeline.cli import main

    save_llava(tmp_path / "llava")
    assert main(["chat", str(tmp_path / "llava"), "--prompt", "what colour?"]) != 0
    assert "vision-language" in capsys.readouterr().err
