"""The workflow config from the command line and from the README: dry runs of a fresh workflow copy.

- nested `--config` values (`schedule={total_updates: 40}`) get the types a config file gives them,
  and a bad one is named as coming from `--config`;
- every config snippet of README.md (YAML blocks and `--config`/`--configfile` command lines) loads
  and plans, with tiny stand-ins for the user's model and data paths it names;
- none of them warns about `localrules` (a sweep's are declared only where its rules exist).
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from kits.run import REPO, copy_workflow, jobs_in_log, snakemake

from pipeline.workflow_config import EMBEDDED_KINDS

pytestmark = pytest.mark.workflow


def _dry(workdir: Path, *args: str):
    proc = snakemake(workdir, "-n", "--cores", "1", *args, timeout=300)
    return proc, proc.stdout + proc.stderr


def test_nested_config_values_work_and_a_bad_one_names_config(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    proc, shown = _dry(workdir, "--config", "schedule={total_updates: 40, num_chunks: 2}")
    assert proc.returncode == 0, shown[-4000:]
    # 40 updates: pilot 2 + 2 chunks of 19, no tail (the default 300 has one).
    assert [stage for rule, stage in jobs_in_log(shown) if rule == "train_stage"] == ["pilot", "chunk01", "chunk02"]
    assert "localrules" not in shown  # no warning about sweep rules that do not exist
    proc, shown = _dry(workdir, "--config", "schedule={total_updates: many}")
    assert proc.returncode != 0
    assert "(config/config.yaml, --config schedule)" in shown
    assert "schedule.total_updates: 'many' is not of type 'integer' (from --config)" in shown, shown[-4000:]


# --- README.md snippets ---------------------------------------------------------------------------

def _config_args(command: str) -> list[str]:
    """The --config / --configfile arguments of a README command line (the rest is how to run it)."""
    words, args, keep = shlex.split(command, comments=True), [], False
    for word in words[1:]:
        if word.startswith("-"):
            keep = word in ("--config", "--configfile")
        if keep:
            args.append(word)
    return args


def _readme_snippets() -> list[tuple[str, str, str]]:
    """(id, kind, text): each ```yaml block, and each `snakemake` command line with --config or
    --configfile (in a code block or inline), by its line in README.md."""
    text = (REPO / "README.md").read_text()

    def line(pos: int) -> str:
        return f"README.md:{text.count(chr(10), 0, pos) + 1}"

    found = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if block.group(1) == "yaml":
            found.append((line(block.start()), "yaml", block.group(2)))
        elif block.group(1) in ("bash", ""):
            for m in re.finditer(r"^snakemake .*--config.*$", block.group(2), re.M):
                found.append((line(block.start(2) + m.start()), "command", m.group(0)))
    for m in re.finditer(r"`(snakemake [^`\n]*--config[^`\n]*)`", text):
        found.append((line(m.start()), "command", m.group(1)))
    unique, seen = [], set()  # a command with another's config (the same sweep on SLURM) is loaded once
    for where, kind, body in found:
        key = (kind, body if kind == "yaml" else tuple(_config_args(body)))
        if key not in seen:
            seen.add(key)
            unique.append((where, kind, body))
    return unique


SNIPPETS = _readme_snippets()


def test_the_readme_snippets_are_all_found():
    kinds = [kind for _, kind, _ in SNIPPETS]
    assert kinds.count("yaml") >= 5 and kinds.count("command") >= 3, SNIPPETS


def _stand_ins(snippet: dict, workdir: Path, tiny: dict) -> dict:
    """The user's model dir and data files the snippet names, made real: the tiny test model for
    a model path, the demo conversations at each data path (nothing else of the snippet changes)."""
    model = snippet.get("model")
    if model is not None and model not in EMBEDDED_KINDS and not (workdir / model).exists():
        snippet["model"] = str(tiny["model"])
    for split, value in (snippet.get("data") or {}).items():
        # data.train may list several datasets, each with its path
        paths = [entry["path"] for entry in value] if isinstance(value, list) else [value]
        for path in paths if split in ("train", "val", "test") else []:
            if path is not None and path not in EMBEDDED_KINDS:
                (workdir / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(tiny["root"] / "data" / f"{split}.jsonl", workdir / path)
    return snippet


def _unfetched_tasks(snippet: dict) -> list[str]:
    """The lm-eval tasks a snippet names by name: their data is fetched first (README "Standard benchmarks")."""
    tasks = (snippet.get("evaluate") or {}).get("benchmarks", {}).get("tasks", [])
    names = [t if isinstance(t, str) else t["task"] for t in tasks]
    return [t for t in names if t != "embedded" and not t.endswith((".yaml", ".yml"))]


@pytest.mark.parametrize("where, kind, text", SNIPPETS, ids=[where for where, _, _ in SNIPPETS])
def test_readme_snippet_loads_and_plans(where, kind, text, tiny, tmp_path, monkeypatch):
    workdir = copy_workflow(tmp_path / "wf")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hugging Face cache: nothing fetched here
    if kind == "yaml":  # "Edit config/config.yaml": these keys set, the others as they are
        snippet = _stand_ins(yaml.safe_load(text), workdir, tiny)
        (workdir / "snippet.yaml").write_text(yaml.safe_dump(snippet))
        args = ["--configfile", "snippet.yaml"]
        if named := _unfetched_tasks(snippet):
            # Without their data the workflow stops before any job, one line per task saying how to fetch
            # it (the config itself loaded); without those tasks it plans.
            proc, shown = _dry(workdir, *args)
            stops = [line for line in shown.splitlines() if line.startswith("evaluate.benchmarks: ")]
            assert proc.returncode != 0 and not jobs_in_log(shown), shown[-3000:]
            assert [line.split(":")[1] for line in stops] == [f" task {t}" for t in named], shown[-3000:]
            assert all("fetch-benchmarks" in line for line in stops)
            snippet["evaluate"]["benchmarks"]["tasks"] = []
            (workdir / "snippet.yaml").write_text(yaml.safe_dump(snippet))
    else:
        args = _config_args(text)
        assert args, text
    proc, shown = _dry(workdir, *args)
    assert proc.returncode == 0, f"{where}: {text}\n{shown[-4000:]}"
    assert any(rule == "train_stage" for rule, _ in jobs_in_log(shown)), shown[-2000:]
    assert "localrules" not in shown, shown[-2000:]
