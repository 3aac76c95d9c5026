"""The label view (`python -m pipeline labels`) and the chat counts / warnings of validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.data import labels as lv
from pipeline.data import validate as v
from pipeline.data.cache import TokenCache

GOOD = Path(__file__).resolve().parent / "good"
RECORD_HEADER = re.compile(r"^=== (\w+) record (\d+) of \d+: (\d+) tokens, (\d+) supervised ===$", re.M)


def marked_records(stdout: str) -> dict[tuple[str, int], str]:
    """(split, record) -> its marked text, from the command's plain output."""
    heads = list(RECORD_HEADER.finditer(stdout))
    out = {}
    for m, nxt in zip(heads, heads[1:] + [None]):
        body = stdout[m.end() + 1: nxt.start() - 1 if nxt else len(stdout)]  # less the newline before a header
        out[(m.group(1), int(m.group(2)))] = body.split("\n--- ", 1)[0]  # the counts follow a split's last record
    return out


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, tokenizer_dir, run_pipeline) -> Path:
    out = tmp_path_factory.mktemp("labels")
    proc = run_pipeline("tokenize", "--train", GOOD / "train.jsonl", "--val", GOOD / "val.json",
                        "--tokenizer", tokenizer_dir, "--max-length", 40, "--too-long", "truncate", "--duplicates", "error", "--reasoning", "auto",
                        "--out-train", out / "train.safetensors", "--out-val", out / "val.safetensors",
                        "--out-stats", out / "stats.json")
    assert proc.returncode == 0, proc.stderr
    # tokenize's line says what the label view counts
    assert "end-of-turn trained in" in proc.stdout and "reasoning in 0 (not trained in 0" in proc.stdout
    return out


def test_label_view_marks_exactly_the_supervised_tokens(tokenized, tokenizer, tokenizer_dir, run_pipeline):
    proc = run_pipeline("labels", "--cache", tokenized / "train.safetensors", tokenized / "val.safetensors",
                        "--tokenizer", tokenizer_dir, "-n", 3)
    assert proc.returncode == 0, proc.stderr
    shown = marked_records(proc.stdout)
    assert sorted(shown) == [("train", 0), ("train", 1), ("train", 2), ("val", 0), ("val", 1)]
    assert "\x1b[" not in proc.stdout  # not a terminal: plain marks
    for (split, i), text in shown.items():
        ids, labels = TokenCache(tokenized / f"{split}.safetensors")[i]
        runs = lv.supervised_runs(tokenizer, ids.numpy(), labels.numpy())
        assert runs and re.findall(r"\[\[(.*?)\]\]", text, re.S) == runs, (split, i, text)
        assert text.replace("[[", "").replace("]]", "") == tokenizer.decode(ids.tolist())  # every token shown
        if len(ids) < 40:  # not cut by max_length: every turn's end-of-turn marker is trained
            assert all(run.endswith("<|end|>") for run in runs), runs
    # The split's counts, from stats.json.
    stats = json.loads((tokenized / "stats.json").read_text())["splits"]
    for split in ("train", "val"):
        s = stats[split]
        assert f"--- {split}: counts" in proc.stdout
        assert f"  supervised tokens: {s['supervised_tokens']} (" in proc.stdout
        assert f"  records whose end-of-turn is trained: {s['eot_trained']} of {s['records']}" in proc.stdout
        assert f"  records cut by max_length: {s['truncated']} (max_length 40, too_long=truncate)" in proc.stdout
        assert "  records with reasoning not trained: 0 (0 by data.reasoning=drop, 0 by the chat template)" \
            in proc.stdout
        assert "  records training an unfilled {{name}} placeholder: 0" in proc.stdout
        assert "  records with a stop token written inside a trained reply: 0" in proc.stdout
    assert stats["train"]["truncated"] > 0  # max_length 40 cuts the longer records: counted, and shown cut


def test_label_view_in_colour_and_as_html(tokenized, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "page" / "labels.html"
    assert lv.main(["--cache", str(tokenized / "train.safetensors"), "--tokenizer", str(tokenizer_dir), "-n", "2",
                    "--color", "always", "--out", str(out), "--title", "Labels <of> run"]) == 0
    stdout = capsys.readouterr().out
    assert "\x1b[1;32m" in stdout and "[[" not in stdout
    page = out.read_text()
    assert "<title>Labels &lt;of&gt; run</title>" in page  # escaped
    assert page.count("<h3>record ") == 2
    # Special tokens are written out (escaped) and boxed; supervised ones highlighted.
    assert re.search(r'<span class="t s( o)? sp"[^>]*>&lt;\|end\|&gt;', page) and "<|end|>" not in page
    assert re.search(r'<span class="t u( o)? sp"[^>]*>&lt;\|assistant\|&gt;', page)
    assert 'class="nl">↵</span>' in page
    cache = TokenCache(tokenized / "train.safetensors")
    assert page.count("supervised\">") == sum(int((cache[i][1] != -100).sum()) for i in range(2))


def test_label_view_refuses_stats_of_another_tokenization(tokenized, tokenizer_dir, tmp_path, run_pipeline):
    stats = json.loads((tokenized / "stats.json").read_text())
    stats["splits"]["train"]["supervised_tokens"] += 1
    (tmp_path / "stats.json").write_text(json.dumps(stats))
    proc = run_pipeline("labels", "--cache", tokenized / "train.safetensors", "--tokenizer", tokenizer_dir,
                        "--stats", tmp_path / "stats.json")
    assert proc.returncode != 0 and "does not describe" in proc.stderr, proc.stderr


def test_token_texts_add_up_to_the_text_with_multibyte_characters():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld ünïcode", "naïve café 日本語 text", "plain ascii words here"] * 20
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|end|>")
    text = "café 日本 wörld 🙂 x<|end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = lv.token_texts(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces) and "" in pieces  # a split character is shown whole, once
    labels = np.full(len(ids), -100)
    labels[-3:] = ids[-3:]
    shown = lv.marked_text(lv.record_tokens(tok, np.array(ids), labels))
    assert shown.endswith("]]") and shown.replace("[[", "").replace("]]", "") == text


def test_long_runs_of_a_special_token_are_collapsed(tokenizer):
    pad = tokenizer.pad_token_id
    ids = np.array([pad] * 12 + tokenizer("ab", add_special_tokens=False)["input_ids"])
    labels = np.full(ids.size, -100)
    labels[-1] = ids[-1]
    assert lv.marked_text(lv.record_tokens(tokenizer, ids, labels)) == "<pad>×12a[[b]]"


# --- validation: the chat counts and warnings -----------------------------------------------------

# The demo template, except that an assistant turn renders only what follows the reasoning.
DROPS_REASONING = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|assistant|>\n' + m['content'].split('</think>')[-1] + '<|end|>\n' }}"
    "{% else %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
NO_END_MARKER = DROPS_REASONING.replace("m['content'].split('</think>')[-1] + '<|end|>\n'", "m['content'] + '\n\n'")


def _tokenizer_with(tokenizer_dir, template: str, dest: Path) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = template
    tok.save_pretrained(dest)
    return dest


def _reasoning_data(path: Path, word: str = "w", turns: int = 1) -> Path:
    """5 records; 0, 2 and 4 with reasoning (inline <think> or reasoning_content); `turns` exchanges each
    (the reasoning in the last)."""
    rows = []
    for i in range(5):
        answer = {"role": "assistant", "content": f"{word}{i}"}
        if i in (0, 4):
            answer["content"] = f"<think>\ncopy it\n</think>\n\n{word}{i}"
        elif i == 2:
            answer["reasoning_content"] = "copy it"
        earlier = [m for t in range(turns - 1) for m in ({"role": "user", "content": f"say {word}{i}x{t}"},
                                                         {"role": "assistant", "content": f"{word}{i}x{t}"})]
        rows.append({"id": f"r{i}", "messages": [*earlier, {"role": "user", "content": f"repeat: {word}{i}"}, answer]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(stats: dict) -> tuple:
    return tuple(stats[k] for k in ("eot_trained", "eot_not_trained", "reasoning_records", "reasoning_dropped",
                                    "reasoning_dropped_by_policy", "reasoning_dropped_by_template"))


def test_a_template_that_drops_reasoning_is_counted_and_warned_about(tmp_path, tokenizer_dir, capsys):
    tok = _tokenizer_with(tokenizer_dir, DROPS_REASONING, tmp_path / "tok")
    train = _reasoning_data(tmp_path / "train.jsonl")
    val = _reasoning_data(tmp_path / "val.jsonl", word="v")
    assert v.main(["--train", str(train), "--val", str(val), "--tokenizer", str(tok), "--max-length", "128",
                   "--too-long", "error", "--duplicates", "warn", "--reasoning", "auto", "--out-json", str(tmp_path / "v.json"),
                   "--out-csv", str(tmp_path / "v.csv")]) == 0
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"]
    for split in ("train", "val"):
        assert _chat(report["files"][split]) == (5, 0, 3, 3, 0, 3)
    warnings = [w for w in report["warnings"] if w["reason"] == "reasoning_not_rendered"]
    assert [w["split"] for w in warnings] == ["train", "val"]
    assert warnings[0]["message"].startswith(
        "3 record(s) of train have reasoning the chat template does not render (it is not trained): "
        "set data.chat_template to a built-in template that renders it (qwen3-thinking, deepseek-r1, gpt-oss) or "
        "a .jinja file that does, to train it, or data.reasoning: drop to silence this (first: ")
    assert f"(first: {train} (JSON Lines) record 0 (line 1, id 'r0'))" in warnings[0]["message"]
    _, err = capsys.readouterr()
    assert f"warning: {warnings[0]['message']}" in err.splitlines()
    assert f"warning: {warnings[1]['message']}" in err.splitlines()

    # data.reasoning: drop silences it; the records are still counted, as dropped by the policy.
    dropped = v.validate_dataset(train, tokenizer_dir=tok, max_length=128, too_long="error", reasoning="drop")
    assert dropped.warnings == []
    assert _chat(dropped.files["train"]) == (5, 0, 3, 3, 3, 0)


def test_a_template_that_renders_reasoning_trains_it_without_a_warning(tmp_path, tokenizer_dir):
    train = _reasoning_data(tmp_path / "train.jsonl")
    report = v.validate_dataset(train, tokenizer_dir=tokenizer_dir, max_length=128, too_long="error")
    assert report.warnings == [] and _chat(report.files["train"]) == (5, 0, 3, 0, 0, 0)


def test_untrained_end_of_turn_is_warned_about(tmp_path, tokenizer_dir, capsys):
    """A template with no stop token after a turn: the last turn of a record is closed by the eos the
    labeller appends (single-turn records are not warned about); an earlier turn stays unclosed, warned."""
    tok = _tokenizer_with(tokenizer_dir, NO_END_MARKER, tmp_path / "tok")
    single = v.validate_dataset(_reasoning_data(tmp_path / "single.jsonl"), tokenizer_dir=tok, max_length=128,
                                too_long="error")
    assert single.warnings == [] and _chat(single.files["train"])[:2] == (5, 0)
    train = _reasoning_data(tmp_path / "train.jsonl", turns=2)
    assert v.main(["--train", str(train), "--tokenizer", str(tok), "--max-length", "128", "--too-long", "error",
                   "--duplicates", "error", "--reasoning", "auto", "--out-json", str(tmp_path / "v.json"), "--out-csv", str(tmp_path / "v.csv")]) == 0
    report = json.loads((tmp_path / "v.json").read_text())
    assert _chat(report["files"]["train"])[:2] == (0, 5)
    [warning] = report["warnings"]
    assert warning["reason"] == "eot_not_trained" and warning["split"] == "train"
    assert warning["message"].startswith("5 record(s) of train have an assistant turn whose end-of-turn marker "
                                         "is not trained")
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"warning: {warning['message']}"]
    assert "end-of-turn not trained in 5" in out


def test_held_out_prompts_are_counted_but_not_warned_about(tmp_path, tokenizer_dir):
    tok = _tokenizer_with(tokenizer_dir, DROPS_REASONING, tmp_path / "tok")
    train = (GOOD / "train.jsonl")
    test = _reasoning_data(tmp_path / "test.jsonl")
    report = v.validate_dataset(train, test=test, tokenizer_dir=tok, max_length=128, too_long="error")
    assert report.warnings == [] and report.files["test"]["reasoning_dropped_by_template"] == 3


EXTERNAL = Path(__file__).resolve().parent / "external"



def _validated(train: Path, tokenizer_dir, out: Path, max_length: int = 128, duplicates: str = "error") -> dict:
    """The validation.json of `train`, validated on the command line (which exits 0: no problem found)."""
    assert v.main(["--train", str(train), "--tokenizer", str(tokenizer_dir), "--max-length", str(max_length),
                   "--too-long", "error", "--duplicates", duplicates, "--reasoning", "auto",
                   "--out-json", str(out / "v.json"), "--out-csv", str(out / "v.csv")]) == 0
    return json.loads((out / "v.json").read_text())

def test_unfilled_placeholders_in_trained_text_are_counted_and_warned_about(tmp_path, tokenizer_dir, tokenizer,
                                                                            capsys):
    """LLaMA-Factory v1's SFT demo as it ships (tests/data/external/README.md) answers "I am {{name}}, an AI
    assistant developed by {{author}}": placeholders its users are told to fill in. Trained as they stand, the
    model learns to call itself {{name}}. Every one of its 12 records is counted and warned about, naming the
    first; a placeholder in a prompt or an untrained turn, or in code (a fenced block, an inline span), and
    LaTeX's double braces are not."""
    from pipeline.data.tokenize import tokenize_file

    def turn(role, text, **extra):
        return {"role": role, "content": [{"type": "text", "value": text}], **extra}
    not_placeholders = [
        [turn("user", "Greet {{name}} for me."), turn("assistant", "Hello there!")],
        [turn("user", "hi"), turn("assistant", "I am {{name}}.", loss_weight=0.0), turn("user", "ok"),
         turn("assistant", "Fine.")],
        [turn("user", "A Jinja loop?"), turn("assistant", "Like this:\n```jinja\n{% for u in users %}{{ u }}"
                                                          "{% endfor %}\n```\nwhere `{{ u }}` prints each.")],
        [turn("user", "Half of a over b?"), turn("assistant", "$\\frac{{a}}{{2b}}$, and x^{{n}} stays x^n; "
                                                             "Handlebars' {{{raw}}} is not escaped.")],
    ]
    demo = (EXTERNAL / "v1_sft_demo_first12.jsonl").read_text()
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": m}) + "\n" for m in not_placeholders) + demo)
    report = _validated(train, tokenizer_dir, tmp_path, max_length=256, duplicates="warn")
    assert report["ok"] and report["files"]["train"]["placeholders_trained"] == 12
    [warning] = [w for w in report["warnings"] if w["reason"] == "placeholders_trained"]
    assert warning["split"] == "train" and warning["message"].startswith(
        "12 record(s) of train train on text holding a template placeholder left unfilled ({{name}} or {{ name }} "
        "outside code), which the model learns to write as it stands: fill it in before training")
    assert warning["message"].endswith("template code meant as written is not counted inside a code fence or "
                                       f"backticks (first: {train} (JSON Lines) record 4 (line 5), holding '{{{{name}}}}')")
    out, err = capsys.readouterr()
    assert f"warning: {warning['message']}" in err.splitlines() and "unfilled placeholders trained in 12" in out
    assert warning["message"] in lv.chat_warnings(tmp_path / "v.json")  # the label page shows it too

    stats = tokenize_file(train, tokenizer, out_path=tmp_path / "train.safetensors", max_length=256,
                          too_long="error", fingerprint="-", split="train", duplicates="warn")
    assert stats["placeholders_trained"] == 12  # tokenization counts what validation did
    rows = dict(lv.count_rows(TokenCache(tmp_path / "train.safetensors"), stats, {}))
    assert rows["records training an unfilled {{name}} placeholder"] == "12"

    clean = v.validate_dataset(GOOD / "train.jsonl", tokenizer_dir=tokenizer_dir, max_length=256, too_long="error")
    assert clean.warnings == [] and clean.files["train"]["placeholders_trained"] == 0

    # LLaMA-Factory's own identity.json (Alpaca), whole: 85 of its 91 answers.
    identity = v.validate_dataset(EXTERNAL / "identity.json", tokenizer_dir=tokenizer_dir, max_length=512,
                                  too_long="error", duplicates="warn")
    assert identity.files["train"]["records"] == 91 and identity.files["train"]["placeholders_trained"] == 85
    assert [w.reason for _, w in identity.warnings] == ["placeholders_trained"]


def test_a_stop_token_inside_a_reply_is_counted_and_warned_about(tmp_path, tokenizer_dir, capsys):
    """The demo template ends a turn with <|end|>: a reply that holds it as text is warned about, naming the
    first such record, and counted; the other records are not."""
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"repeat: w{i}"},
                                          {"role": "assistant", "content": f"w{i}" + ("<|end|> and more" if i % 2 else "")}]}
            for i in range(6)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = _validated(train, tokenizer_dir, tmp_path)
    assert report["files"]["train"]["stop_tokens_inside"] == 3
    [warning] = report["warnings"]
    assert warning["reason"] == "stop_tokens_inside" and warning["message"].startswith(
        "3 record(s) of train have a trained reply whose text holds a token generation stops on")
    assert warning["message"].endswith(f"(first: {train} (JSON Lines) record 1 (line 2, id 'r1'), holding '<|end|>')")
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"warning: {warning['message']}"] and "stop tokens inside replies in 3" in out
    assert lv.chat_warnings(tmp_path / "v.json") == [warning["message"]]


def test_a_prompt_rendered_with_the_template_already_is_counted_and_warned_about(tmp_path, tokenizer, tokenizer_dir,
                                                                                 capsys):
    """Prompts written in the model's own chat format (SimpleRL-Zoo's published data puts
    "<|im_start|>system\\n..." in a user turn) are rendered a second time: counted and warned about, naming the
    first record; the prompt's plain text is not."""
    from pipeline.data.tokenize import tokenize_file

    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Think first."}, {"role": "user", "content": "2+2?"}],
        tokenize=False, add_generation_prompt=True)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": rendered if i in (2, 5) else "2+2?"},
                                          {"role": "assistant", "content": f"4, said {i} times"}]}
            for i in range(6)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = _validated(train, tokenizer_dir, tmp_path)
    assert report["files"]["train"]["markers_in_prompts"] == 2 and report["files"]["train"]["stop_tokens_inside"] == 0
    [warning] = report["warnings"]
    assert warning["reason"] == "markers_in_prompts" and warning["message"].startswith(
        "2 record(s) of train have a turn left as prompt (system, user, tool, or a reply marked untrained) whose "
        "text holds the chat template's own turn markers")
    assert "looks rendered with a chat template already" in warning["message"]
    assert warning["message"].endswith(f"(first: {train} (JSON Lines) record 2 (line 3, id 'r2'), holding '<|end|>')")
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"warning: {warning['message']}"] and "turn markers in prompts in 2" in out
    assert lv.chat_warnings(tmp_path / "v.json") == [warning["message"]]

    stats = tokenize_file(train, tokenizer, out_path=tmp_path / "train.safetensors", max_length=128,
                          too_long="error", fingerprint="-", split="train", duplicates="error")
    assert stats["markers_in_prompts"] == 2  # tokenization counts what validation did
    rows = dict(lv.count_rows(TokenCache(tmp_path / "train.safetensors"), stats, {}))
    assert rows["records with the template's turn markers written in a prompt"] == "2"
