"""The label view of the default run (the session fixture `done`): the report page and the command."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pipeline.data.cache import TokenCache
from pipeline.data.labels import supervised_runs

pytestmark = pytest.mark.workflow

RUN = "results/demo"


def test_the_default_run_has_a_label_page_with_the_supervised_tokens_marked(done):
    page = (done / RUN / "report/labels.html").read_text()
    stats = json.loads((done / RUN / "data/stats.json").read_text())["splits"]
    for split in ("train", "val"):
        assert f"<h2>{split}</h2>" in page
        s = stats[split]
        assert f"<td class=\"l\">{s['supervised_tokens']} (" in page
        assert f"<td class=\"l\">{s['eot_trained']} of {s['records']}</td>" in page
    assert page.count("<h3>record ") == 10  # 5 records of each split
    # The supervised tokens of the page's first record are the cache's, in order.
    first = page.split('<pre class="rec">', 1)[1].split("</pre>", 1)[0]
    marked = re.findall(r'<span class="t s[^"]*" title="#(\d+) id (\d+) supervised">', first)
    ids, labels = TokenCache(done / RUN / "data/train/train/train.safetensors")[0]
    supervised = (labels != -100).nonzero().flatten().tolist()
    assert [int(p) for p, _ in marked] == supervised and [int(i) for _, i in marked] == ids[supervised].tolist()
    # The validation report of the default run counts what the page shows, and warns of nothing.
    validation = json.loads((done / RUN / "data/validation.json").read_text())
    assert validation["files"]["train"]["eot_trained"] == validation["files"]["train"]["records"]
    assert validation["files"]["train"]["reasoning_dropped_by_template"] == 0 and validation["warnings"] == []


def test_the_label_command_on_the_default_run_marks_the_supervised_spans(done):
    cache = done / RUN / "data/train/train/train.safetensors"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "labels", "--cache", str(cache),
                           "--tokenizer", str(done / RUN / "tokenizer"), "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(done / RUN / "tokenizer")
    records = proc.stdout.split("\n(supervised tokens are between")[0]  # less the closing legend
    marked = re.findall(r"\[\[(.*?)\]\]", records, re.S)
    expected = [run for i in range(2) for run in supervised_runs(tokenizer, *(t.numpy() for t in TokenCache(cache)[i]))]
    assert marked == expected and all(run.endswith("<|end|>") for run in marked)
    assert "records whose end-of-turn is trained:" in proc.stdout and "records cut by max_length:" in proc.stdout
