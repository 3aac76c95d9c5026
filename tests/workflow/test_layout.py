"""The results tree is named once, in pipeline/layout.py: the rules take their paths from it.

Two checks. The rule files (Snakefile, workflow/rules/*.smk) spell no results path: no string
literal in them names a part of the tree (`plan.json`, `/stages/`, `logs/...`, `adapter_final`);
the checker is shown to bite on planted lines. And the dry run of the default config and of the
sweep example lists the jobs, inputs, outputs, logs and benchmarks recorded in tests/workflow/dag/
(written from the workflow as it was before the rules took their paths from layout): a changed
path shows up here, as a diff, before a real run.
"""

from __future__ import annotations

import difflib
import io
import re
import tokenize
from pathlib import Path

import pytest
from kits.run import REPO, copy_workflow, snakemake

from pipeline import layout

RULE_FILES = [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]
DAG_DIR = Path(__file__).parent / "dag"

# Every name layout.py gives a file or dir of the results tree, the checkpoint or the scratch dir.
TREE_NAMES = {value for name, value in vars(layout).items()
              if name.isupper() and isinstance(value, str) and re.fullmatch(r"\w[\w.-]*\w", value)}
# Those never used as anything but a path in a rule file: a literal that is one of them is one.
OWN_NAMES = {n for n in TREE_NAMES if "." in n or "_" in n} | {
    layout.RESULTS, layout.WORK, layout.LOGS, layout.BENCHMARKS, layout.STAGES_DIR, layout.VARIANTS_DIR,
    layout.EVAL_DIR, layout.REPORT_DIR}
FILE_NAME = re.compile(r"[\w-]+\.(json|jsonl|yaml|yml|csv|png|html|safetensors|log|tsv)")
# Paths of the workflow's own files (conda envs, captions, schemas, configs, includes), not results.
SOURCE_PREFIXES = ("../", "workflow/", "config/")


def _literals(text: str) -> list[tuple[int, str]]:
    """(line, source) of every string literal (an f-string whole) but docstrings."""
    lines = text.splitlines(keepends=True)
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type not in (tokenize.COMMENT, tokenize.NL)]
    out, i, first, header = [], 0, None, False  # first token of this statement; the last one a def/class line
    while i < len(tokens):
        tok, j = tokens[i], i
        if tok.type == getattr(tokenize, "FSTRING_START", None):  # Python >= 3.12: an f-string in parts
            depth = 1
            while depth:
                j += 1
                depth += {tokenize.FSTRING_START: 1, tokenize.FSTRING_END: -1}.get(tokens[j].type, 0)
        if first is None and tok.type not in (tokenize.INDENT, tokenize.DEDENT):
            first = tok
        if tok.type == tokenize.STRING or j > i:
            (r0, c0), (r1, c1) = tok.start, tokens[j].end
            source = "".join(lines[r0 - 1:r1])[c0:len("".join(lines[r0 - 1:r1 - 1])) + c1]
            if not (header and tok is first and tokens[j + 1].type == tokenize.NEWLINE):  # a docstring
                out.append((r0, source))
        if tok.type == tokenize.NEWLINE:
            header = first is not None and first.type == tokenize.NAME and first.string in ("def", "class")
            first = None
        i = j + 1
    return out


def spelled_names(literal: str) -> set[str]:
    """The results-tree names a string literal spells: as a part of a path, or as the whole literal.
    Replacement fields and wildcards ({...}) are not spelled there, so they do not count."""
    text = re.sub(r"^[a-zA-Z]*('''|\"\"\"|'|\")(.*)\1$", r"\2", literal, flags=re.S)
    while (stripped := re.sub(r"\{[^{}]*\}", "", text)) != text:
        text = stripped
    found = {text} & OWN_NAMES
    for token in text.split():
        if "/" in token and not token.lstrip("(\"'`").startswith(SOURCE_PREFIXES):
            found |= {part for part in re.split(r"[^\w.*-]+", token)
                      if part in TREE_NAMES or FILE_NAME.fullmatch(part)}
    return found


def results_paths_in(text: str) -> list[str]:
    return [f"line {line}: {source} spells {', '.join(sorted(names))}"
            for line, source in _literals(text) if (names := spelled_names(source))]


def test_the_rule_files_spell_no_results_path():
    problems = [f"{path.relative_to(REPO)} {problem}" for path in RULE_FILES for problem in results_paths_in(path.read_text())]
    assert not problems, ("results paths spelled outside pipeline/layout.py (take them from layout.RunTree, "
                          "layout.log_file, ...):\n  " + "\n  ".join(problems))


@pytest.mark.parametrize("planted", [
    'x = f"{V}/eval/{s}.json"',
    'rule r:\n    log:\n        "logs/r/{vrun}.log",\n    shell:\n        "true"',
    'rule r:\n    output:\n        "results/{vrun}/new_thing.csv"\n    shell:\n        "true"',
    'p = Path(d) / "plan.json"',
    'd = [V.export("adapter_final")]',
    'def f(wildcards, input):\n    return f"--init {input.init}/checkpoint"',
    'targets = f"{name}=results/{v}"',
])
def test_a_planted_results_path_is_found(planted):
    assert results_paths_in(planted)


@pytest.mark.parametrize("clean", [
    'report(V.plan, caption="../report/plan.rst", category="Run")',
    'def f():\n    """Its output, results/<run>/eval/<stage>.json, comes from layout."""\n    return 1',
    'x = config["export"]["weights"]',
    'cmd = "python -m pipeline merge --merged {input.merged} --out-adapter-ema {output.adapter_ema}"',
    'configfile: "config/config.yaml"',
])
def test_what_is_not_a_results_path_passes(clean):
    assert results_paths_in(clean) == []


# ------------------------------------------------------------------ the dry run's jobs and paths

_JOB_START = re.compile(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):\s*$")
_FIELD = re.compile(r"^\s+(input|output|log|benchmark|wildcards): (.*)$")


def job_listing(dry_run: str) -> str:
    """Every job of a dry run (`snakemake -n`) with its wildcards and paths, one block each, sorted
    (the dry run's order and job ids vary between runs; inputs are a set)."""
    jobs: list[dict[str, str]] = []
    for line in dry_run.splitlines():
        if m := _JOB_START.match(line):
            jobs.append({"rule": m.group(1)})
        elif jobs and (m := _FIELD.match(line)) and m.group(1) not in jobs[-1]:
            value = m.group(2)
            jobs[-1][m.group(1)] = ", ".join(sorted(value.split(", "))) if m.group(1) == "input" else value
    blocks = [f"{job.pop('rule')} {job.pop('wildcards', '')}".rstrip() + "".join(
        f"\n    {key}: {job[key]}" for key in ("output", "log", "benchmark", "input") if key in job) for job in jobs]
    return "\n".join(sorted(blocks)) + "\n"


@pytest.mark.workflow
@pytest.mark.parametrize("name, args", [("default", []), ("sweep", ["--configfile", "config/sweep.yaml"])])
def test_the_dry_run_lists_the_recorded_jobs_and_paths(tmp_path, name, args):
    workdir = copy_workflow(tmp_path / "wf")
    proc = snakemake(workdir, "-n", "--cores", "2", *args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listing, expected = job_listing(proc.stdout + proc.stderr), (DAG_DIR / f"{name}.txt").read_text()
    (tmp_path / f"{name}.txt").write_text(listing)
    diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), listing.splitlines(keepends=True),
                                        f"tests/workflow/dag/{name}.txt", "this dry run"))
    assert listing == expected, (f"the dry run's jobs or paths changed (if on purpose, copy {tmp_path / name}.txt "
                                 f"over tests/workflow/dag/{name}.txt):\n{diff[:6000]}")
