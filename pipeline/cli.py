"""`python -m pipeline <command> ...`: the one entry point the workflow rules call.

Each command lives in its own module as `main(argv) -> int` with its own
argparse parser; this file only dispatches, so importing it stays cheap.
"""

from __future__ import annotations

import importlib
import os
import sys

from pipeline.errors import ERROR_FILE_ENV, UserError

COMMANDS = {
    "prepare-base": ("pipeline.demo.cli", "embedded default: tiny base model, tokenizer, demo dataset"),
    "demo-benchmark": ("pipeline.demo.benchmark", "embedded default: its lm-eval task over the held-out words"),
    "fetch-model": ("pipeline.storage.hub", "download a hub model into the Hugging Face cache, pin its commit"),
    "fetch-data": ("pipeline.data.hub_images", "download a hub dataset's files and the images beside them, pin the commit"),
    "prepare-tokenizer": ("pipeline.data.prepare", "the run's tokenizer: the chat template it trains with, new tokens"),
    "validate": ("pipeline.data.validate", "check every record of the dataset files"),
    "validate-shard": ("pipeline.data.scan", "check one shard of a large training file (validate --scans merges)"),
    "tokenize": ("pipeline.data.tokenize_cli", "tokenize with the chat template into a safetensors cache"),
    "tokenize-shard": ("pipeline.data.parts", "tokenize one shard of a large training file (tokenize --parts merges)"),
    "mixed-reports": ("pipeline.data.mixed_reports", "a run of several training datasets: its data reports from theirs"),
    "labels": ("pipeline.data.labels", "records of a token cache with the supervised tokens marked (text / HTML)"),
    "train-config-reference": ("pipeline.config_reference",
                              "docs/train_config.yaml: every trainer setting, its default and doc (generated)"),
    "plan": ("pipeline.planning.plan", "split total updates into pilot / chunks / tail; check and write the resolved trainer config"),
    "train": ("pipeline.train.stage", "train one stage (run under torchrun)"),
    "status": ("pipeline.train.status", "where each stage of a run is (files only: works from a login node)"),
    "pilot-gate": ("pipeline.evaluate.gate", "sanity checks on the pilot before the chunks start"),
    "evaluate": ("pipeline.evaluate.stage", "validation loss / task metric for raw and EMA weights"),
    "summarize": ("pipeline.evaluate.summarize", "summary table and plots across stages"),
    "consolidate": ("pipeline.export.consolidate", "final checkpoint -> Hugging Face dirs"),
    "export-best": ("pipeline.export.best", "the run's best raw and EMA weights (lowest validation loss)"),
    "merge": ("pipeline.export.merge", "streaming LoRA merge, shard by shard"),
    "verify-merge": ("pipeline.export.verify", "merged logits vs base + adapter"),
    "smoke-test": ("pipeline.evaluate.smoke", "merged model answers held-out prompts"),
    "benchmark": ("pipeline.evaluate.benchmarks", "score one set of weights on one lm-eval task (offline, cached by content)"),
    "benchmark-report": ("pipeline.evaluate.bench_report", "lm-eval scores of base vs the trained weights: table, plot, page"),
    "benchmark-card": ("pipeline.export.card:main_benchmarks", "the benchmark scores into the export dirs' model cards"),
    "fetch-benchmarks": ("pipeline.evaluate.bench_data", "the data of lm-eval tasks into the local caches (--check: offline)"),
    "chat": ("pipeline.export.chat", "answer a prompt with an export dir (merged or adapter), its chat template"),
    "sweep-prune": ("pipeline.evaluate.compare:main_prune", "a sweep's prune point: which variants go on"),
    "sweep-compare": ("pipeline.evaluate.compare:main_compare", "a sweep's comparison table, plot, best variant"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m pipeline <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, _, entry = COMMANDS[name][0].partition(":")
    command = getattr(importlib.import_module(module_name), entry or "main")
    try:
        return int(command(rest) or 0)
    except UserError as err:
        # Bad input is the user's to fix: one clear message, no traceback.
        print(f"error: {err}", file=sys.stderr)
        _report(f"error: {err}")
        return err.exit_code
    except Exception as err:
        # Not the user's input: a bug or a broken environment. The traceback goes to the
        # log as usual; the one-line cause also goes where the launcher shows it.
        _report(f"{type(err).__name__}: {err} (an unexpected error: the traceback is in the log)")
        raise


def _report(message: str) -> None:
    """Append a failure's message to the file `pipeline.launch` reads back (when it set one).

    Every rank of a torchrun job appends its own; the launcher shows each distinct one once.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(message.rstrip("\n") + "\n\x00\n")
