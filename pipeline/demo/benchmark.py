"""The embedded default's benchmark: an lm-eval multiple-choice task over the demo's skill.

    python -m pipeline demo-benchmark --data-dir results/embedded/data

Written beside the demo dataset that `prepare_base` builds, from its held-out test split
(`data/bench/repeat_choice.yaml` and `.jsonl`; `evaluate.benchmarks.tasks: [embedded]`
scores it), by a job of its own: a demo built before benchmarks existed gets the task
without its base model being built (and every stage trained) again. One document per
held-out test word: the question is the demo's instruction (`repeat: <word>`, rendered in
a user turn of the run's chat template), the choices are the word and three anagrams of it.

Why anagrams: the base model was pre-trained to copy words (`word=word`), so it already
prefers letters that appear in the prompt; against random distractors it scores well
above chance before any SFT (0.67 with random words of the same length, measured on the
demo base). Anagrams hold exactly the prompt's letters, so only copying them *in order
after the assistant header*, which the SFT teaches, picks the answer: the base scores
near chance (0.25) and the fine-tuned model near 1.0. The task needs no network: the
documents are a local JSONL file, read by the `datasets` json builder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pipeline import layout
from pipeline.demo.text import INSTRUCTION

CHOICES = 4  # the word and three anagrams: chance is 0.25


def anagrams(word: str, rng: random.Random, count: int) -> list[str] | None:
    """`count` distinct rearrangements of `word`'s letters, none the word itself; None when it has
    fewer (a word like "aab" has only two)."""
    seen: set[str] = set()
    for _ in range(200):
        letters = list(word)
        rng.shuffle(letters)
        candidate = "".join(letters)
        if candidate != word:
            seen.add(candidate)
        if len(seen) == count:
            return sorted(seen)
    return None


def documents(words: list[str], *, seed: int = 3) -> list[dict]:
    """One multiple-choice document per word that has enough anagrams: {word, choices, answer}."""
    rng = random.Random(seed)
    docs = []
    for word in words:
        others = anagrams(word, rng, CHOICES - 1)
        if others is None:
            continue
        choices = [word, *others]
        rng.shuffle(choices)
        docs.append({"word": word, "choices": choices, "answer": choices.index(word)})
    return docs


def task_yaml(data_file: Path) -> str:
    """The lm-eval task config. `data_file` is written as given: lm-eval reads `data_files` relative to
    the directory it runs in (the workflow's), so a relative path keeps the config the same on every
    checkout (and so its cache key)."""
    return "\n".join([
        "# The embedded default's benchmark (pipeline/demo/benchmark.py): multiple choice between a held-out",
        "# word and three anagrams of it, asked with the demo's instruction in the run's chat template.",
        f"task: {layout.DEMO_BENCH_TASK}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(data_file))}",
        "test_split: test",
        "output_type: multiple_choice",
        f"doc_to_text: {json.dumps(INSTRUCTION.format(word='{{word}}'))}",  # the document's word, by jinja
        "doc_to_choice: choices",
        "doc_to_target: answer",
        'target_delimiter: ""  # the answer follows the assistant header directly, as in training',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        "",
    ])


def test_words(test_split: Path) -> list[str]:
    """The reference answers of a demo test split (the held-out words)."""
    words = []
    for line in Path(test_split).read_text().splitlines():
        if line.strip():
            words.append(json.loads(line)["conversations"][-1]["value"])
    return words


def build_benchmark(data_dir: Path) -> tuple[Path, Path]:
    """Write the task (data/bench/repeat_choice.yaml) and its documents (.jsonl) from the demo's
    held-out test split in `data_dir`; returns both paths."""
    data_dir = Path(data_dir)
    yaml_path, docs_path = (data_dir / layout.BENCH_DIR / f"{layout.DEMO_BENCH_TASK}{suffix}" for suffix in (".yaml", ".jsonl"))
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs = documents(test_words(data_dir / f"test{layout.DEMO_SPLIT_SUFFIX}"))
    docs_path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    yaml_path.write_text(task_yaml(docs_path))
    return yaml_path, docs_path


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipeline demo-benchmark", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, required=True, help="the demo's data dir (its test split is read)")
    args = ap.parse_args(argv)
    yaml_path, docs_path = build_benchmark(args.data_dir)
    print(f"demo benchmark: {yaml_path} ({len(docs_path.read_text().splitlines())} documents in {docs_path})")
    return 0
