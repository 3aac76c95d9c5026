"""Model cards: the `README.md` of every exported dir.

A card says what the dir holds (which weights: final, EMA, best, merged), the base
model (path, or hub id and the commit the run pinned), the data files with their
record counts, the trainer's key hyperparameters, the schedule of stages, the
evaluation table (every stage, raw and each EMA rate: validation loss, exact
match) and how to load it (transformers for a merged dir; peft on the base for an
adapter, with the embedding resize when the run added tokens).

The export commands (`consolidate`, `export-best`, `merge`) write it with the
`--card-*` options (`add_card_args`): the rule that writes a dir writes its card,
from the run files it declares as inputs. The merged dir is smoke-tested after it
is written, so its card has the stages' evaluations, not its own smoke test
(`results/<run>/export/smoke_test.json`, and the report, have that).

Benchmarks are scored after the dir is written (the jobs read it), so their section
(`write_benchmarks`: lm-eval scores of these weights beside the base model's) is put
into the card afterwards, by `benchmark-report`, between markers that a later report
replaces; an export job that writes the dir again writes a card without it, and the
report that follows the new scores puts it back.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from pipeline import layout
from pipeline.data.run_tokenizer import CHAT_FILE

CARD_FILE = "README.md"
BENCH_BEGIN, BENCH_END = "<!-- benchmarks -->", "<!-- /benchmarks -->"  # the benchmark section's bounds


def add_card_args(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("model card (README.md in each output dir; written when any is given)")
    group.add_argument("--card-run", help="the run's name, for the card's title")
    group.add_argument("--card-plan", type=Path, help="results/<run>/plan.json: the schedule, a hub base's commit")
    group.add_argument("--card-stats", type=Path, help="results/<run>/data/stats.json: data files and counts")
    group.add_argument("--card-config", type=Path, help="results/<run>/train_config.yaml: the trainer config")
    group.add_argument("--card-eval", type=Path, nargs="*", default=[],
                       help="results/<run>/eval/<stage>.json files: the evaluation table")


def card_requested(args: argparse.Namespace) -> bool:
    return any((args.card_run, args.card_plan, args.card_stats, args.card_config, args.card_eval))


def write_cards(args: argparse.Namespace, dirs) -> None:
    """Write `README.md` into each of `dirs` (None entries skipped) when a `--card-*` option was given."""
    if not card_requested(args):
        return
    for path in dirs:
        if path is not None:
            write_card(path, run=args.card_run, plan=args.card_plan, stats=args.card_stats,
                       train_config=args.card_config, evals=args.card_eval)


def _read_json(path) -> dict:
    return json.loads(Path(path).read_text()) if path is not None and Path(path).is_file() else {}


def write_card(dst: Path | str, *, run: str | None = None, plan=None, stats=None, train_config=None,
               evals=()) -> Path:
    dst = Path(dst)
    config = yaml.safe_load(Path(train_config).read_text()) if train_config and Path(train_config).is_file() else {}
    text = build_card(dst, run=run, plan=_read_json(plan), stats=_read_json(stats), config=config or {},
                      evals=[_read_json(p) for p in evals])
    (dst / CARD_FILE).write_text(text)
    return dst / CARD_FILE


def _get(tree: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _fmt(value) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v).replace("|", "\\|") for v in row) + " |" for row in rows]
    return lines


def describe_dir(dst: Path) -> tuple[str, str]:
    """(kind: "adapter" | "model", what the weights are) of an export dir, from its files and name."""
    adapter = (dst / "adapter_config.json").is_file()
    best = _read_json(dst / layout.BEST_META)
    if best:
        rate = f", EMA rate {best['rate']}" if best.get("rate") is not None else ""
        what = (f"the run's best {'EMA' if best.get('rate') is not None else 'raw'} weights: lowest validation "
                f"loss ({_fmt(best.get('loss'))}) at update {best.get('step')} in stage {best.get('stage')}{rate}")
    elif dst.name == layout.MERGED:
        what = "the base model with the LoRA adapter merged in (a plain model, no peft needed)"
    elif "ema" in dst.name:
        what = "the EMA (exponential moving average) weights at the run's last update"
    else:
        what = "the weights at the run's last update"
    return ("adapter" if adapter else "model"), what


def base_model(dst: Path, plan: dict, config: dict) -> tuple[str, str | None]:
    """(base model: hub id or path, the pinned revision or None)."""
    hub = plan.get("model") if isinstance(plan.get("model"), dict) else None
    if hub and hub.get("repo_id"):
        return hub["repo_id"], hub.get("revision")
    adapter = _read_json(dst / "adapter_config.json")
    return str(adapter.get("base_model_name_or_path") or _get(config, "model.path") or "?"), None


def evaluation_rows(evals: list[dict]) -> list[list]:
    rows = []
    for record in evals:
        for row in record.get("rows") or []:
            rows.append([record.get("stage"), record.get("step", 0 if record.get("stage") == "base" else None),
                         row.get("weights"), row.get("loss"), row.get("perplexity"), row.get("exact_match"),
                         row.get("n_test")])
    return rows


_HYPERPARAMETERS = [
    ("LoRA", "lora.enabled"), ("LoRA rank r", "lora.r"), ("LoRA alpha", "lora.alpha"),
    ("LoRA dropout", "lora.dropout"), ("LoRA targets", "lora.target_modules"), ("rsLoRA", "lora.use_rslora"),
    ("DoRA", "lora.use_dora"), ("LoRA init", "lora.init"), ("LoRA+ lr ratio (lora_B)", "optim.lora_plus_ratio"),
    ("learning rate", "optim.lr"), ("weight decay", "optim.weight_decay"), ("Adam betas", "optim.betas"),
    ("warmup fraction", "optim.warmup_fraction"), ("min LR ratio", "optim.min_lr_ratio"),
    ("gradient clip", "optim.grad_clip"), ("global batch", "optim.global_batch"),
    ("micro batch", "optim.micro_batch"), ("EMA rates", "ema.rates"), ("EMA every", "ema.every"),
    ("precision", "precision.mode"), ("model dtype", "model.dtype"), ("distributed", "distributed.strategy"),
    ("seed", "seed"),
]


def build_card(dst: Path, *, run: str | None, plan: dict, stats: dict, config: dict, evals: list[dict]) -> str:
    kind, what = describe_dir(dst)
    base, revision = base_model(dst, plan, config)
    chat = _read_json(dst / CHAT_FILE)
    added = chat.get("added_tokens") or {}
    title = f"{run} / {dst.name}" if run else dst.name
    library = "peft" if kind == "adapter" else "transformers"
    lines = ["---", f"base_model: {base}", f"library_name: {library}", "pipeline_tag: text-generation",
             "tags:", "- lora", "- sft", "---", "", f"# {title}", "",
             f"{'A LoRA adapter (PEFT)' if kind == 'adapter' else 'A Hugging Face model'}: {what}.",
             "It carries the run's tokenizer and chat template (prompts render as in training; generation "
             "stops at the template's end-of-turn marker).", ""]
    lines += _base_section(base, revision, chat, added)
    lines += _data_section(stats)
    lines += _training_section(dst, config)
    lines += _schedule_section(plan)
    lines += _evaluation_section(evals)
    lines += _usage_section(dst.name, kind, base, revision, added)
    return "\n".join(lines).replace("\n\n\n", "\n\n")


def _base_section(base: str, revision: str | None, chat: dict, added: dict) -> list[str]:
    lines = ["## Base model", "", f"- {base}" + (f" at revision `{revision}`" if revision else "")]
    if chat.get("template"):
        marker = f"`{chat['end_of_turn']}`" if chat.get("end_of_turn") else "the template's own"
        lines.append(f"- chat template: {chat['template']} (see chat_template.jinja); end-of-turn marker: {marker}")
    if added:
        lines.append(f"- tokens added to the base's vocabulary: {', '.join(f'`{t}`' for t in added)} "
                     f"(vocabulary {chat.get('base_vocab_size')} -> {chat.get('vocab_size')})")
    return [*lines, ""]


def _data_section(stats: dict) -> list[str]:
    splits = stats.get("splits") or {}
    if not splits:
        return []
    lines = ["## Data", ""]
    lines += _table(["split", "file", "records", "records trained on", "tokens", "supervised tokens"],
                    [[name, _source(s.get("source")), s.get("records_in"), s.get("records"), s.get("tokens"),
                      s.get("supervised_tokens")] for name, s in splits.items()])
    if stats.get("max_length"):
        lines += ["", f"Maximum sequence length {stats['max_length']} tokens (longer records: {stats.get('too_long')})."]
    return [*lines, ""]


def _source(path: str | None) -> str | None:
    """A split's dataset as the card names it: a hub dataset by its URL, not its pin (`fetch_data`)."""
    from pipeline.data.readers import display_name

    return display_name(path) if path else path


def _training_section(dst: Path, config: dict) -> list[str]:
    if not config:
        return []
    lines = ["## Training", ""]
    lines += _table(["setting", "value"], [[label, _get(config, key)] for label, key in _HYPERPARAMETERS
                                           if _get(config, key) is not None])
    lines.append("")
    adapted = _read_json(dst / "adapter_config.json")
    if adapted.get("target_parameters"):  # a mixture of experts: say that the experts are adapted too
        lines += [f"LoRA adapts the layers {', '.join(sorted(adapted.get('target_modules') or []))} and the fused "
                  f"weights {', '.join(sorted(adapted['target_parameters']))} (experts; peft target_parameters).", ""]
    return lines


def _schedule_section(plan: dict) -> list[str]:
    if not plan.get("stages"):
        return []
    lines = ["## Schedule", "", f"{plan.get('total_updates')} optimizer updates in {len(plan['stages'])} stages "
             "(one learning-rate schedule, EMA and data order across all of them):", ""]
    lines += _table(["stage", "first update", "last update", "updates"],
                    [[s["name"], s["start"] + 1, s["end"], s["end"] - s["start"]] for s in plan["stages"]])
    return [*lines, ""]


def _evaluation_section(evals: list[dict]) -> list[str]:
    rows = evaluation_rows(evals)
    if not rows:
        return []
    lines = ["## Evaluation", "",
             "Validation loss and exact match on held-out prompts (greedy decoding) at each stage's end, "
             "for the raw weights and each EMA rate:", ""]
    lines += _table(["stage", "update", "weights", "val loss", "perplexity", "exact match", "n"], rows)
    return [*lines, ""]


def _usage_section(name: str, kind: str, base: str, revision: str | None, added: dict) -> list[str]:
    lines = ["## How to use", "", "With this workflow (chat template of training, greedy by default):", "",
             "```bash", f"python -m pipeline chat {name} --prompt \"...\"", "```", ""]
    if kind != "adapter":
        return lines + [
            "With transformers (also served as is by vLLM or TGI):", "", "```python",
            "from transformers import pipeline", "",
            f'chat = pipeline("text-generation", model="{name}", tokenizer="{name}")',
            'print(chat([{"role": "user", "content": "..."}], max_new_tokens=64)[0]["generated_text"][-1]["content"])',
            "```", ""]
    resize = ("model.resize_token_embeddings(len(tokenizer))  # the run added tokens: grow the embeddings first\n"
              if added else "")
    return lines + [
        "With transformers and peft:", "", "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "from peft import PeftModel", "",
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")  # this dir: the run\'s tokenizer and chat template',
        f'model = AutoModelForCausalLM.from_pretrained("{base}"' + (f', revision="{revision}"' if revision else "") + ")",
        resize + f'model = PeftModel.from_pretrained(model, "{name}")',
        'prompt = tokenizer.apply_chat_template([{"role": "user", "content": "..."}], tokenize=False, add_generation_prompt=True)',
        'inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True))",
        "```", "",
        "For serving (vLLM, TGI) use the merged dir, or load this adapter as a LoRA module on the base.", ""]


def benchmark_lines(rows: list[dict]) -> list[str]:
    """The card's benchmark section: one row per (task, metric) with the base model's score, these
    weights' score and the difference, each with its standard error (rows: benchmarks.csv's)."""
    def pm(value, stderr):
        return "-" if value is None else _fmt(value) + (f" ± {_fmt(stderr)}" if stderr is not None else "")

    def shots(row):
        return "default" if row.get("num_fewshot") is None else int(row["num_fewshot"])

    version = next((r["lm_eval"] for r in rows if r.get("lm_eval")), "?")
    lines = [BENCH_BEGIN, "## Benchmarks", "",
             f"lm-evaluation-harness {version}, the base model and these weights on the same documents "
             "(± the standard error; the difference's is paired where the metric is a mean over documents):", ""]
    lines += _table(["task", "metric", "n", "few-shot", "chat template", "base model", "this model", "difference"],
                    [[r["task"], r["metric"], r.get("n"), shots(r), "yes" if r.get("chat_template") in (True, "True") else "no",
                      pm(r.get("base"), r.get("base_stderr")), pm(r.get("final"), r.get("final_stderr")),
                      pm(r.get("delta"), r.get("delta_stderr"))] for r in rows])
    return lines + ["", BENCH_END]


def write_benchmarks(dst: Path | str, rows: list[dict]) -> None:
    """Put the benchmark section into `dst`'s card (README.md), in place of an earlier one, before
    "How to use"; a dir without a card is left alone."""
    card = Path(dst) / CARD_FILE
    if not card.is_file():
        return
    text = card.read_text()
    if BENCH_BEGIN in text and BENCH_END in text:
        text = text[:text.index(BENCH_BEGIN)] + text[text.index(BENCH_END) + len(BENCH_END):].lstrip("\n")
    section = "\n".join(benchmark_lines(rows)) + "\n\n"
    anchor = text.find("## How to use")
    text = text[:anchor] + section + text[anchor:] if anchor >= 0 else text.rstrip("\n") + "\n\n" + section
    card.write_text(text)


def main_benchmarks(argv: list[str]) -> int:
    """`python -m pipeline benchmark-card --table eval/benchmarks.csv --dirs export/merged ... --out FILE`:
    each export dir's card gets the rows of its own weights (benchmarks.csv `weights` = the dir's name);
    `--out` (export/benchmarks.md) collects the sections written."""
    import pandas as pd

    ap = argparse.ArgumentParser(prog="python -m pipeline benchmark-card", description=main_benchmarks.__doc__)
    ap.add_argument("--table", type=Path, required=True, help="eval/benchmarks.csv (pipeline.evaluate.bench_report)")
    ap.add_argument("--dirs", type=Path, nargs="+", required=True, help="the scored export dirs")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    bench = pd.read_csv(args.table).astype(object)
    bench = bench.where(bench.notna(), None)
    sections = []
    for dst in args.dirs:
        rows = [r for r in bench.to_dict("records") if r["weights"] == dst.name]
        if rows:
            write_benchmarks(dst, rows)
            sections += [f"# {dst.name}", "", *benchmark_lines(rows), ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(sections) + "\n")
    return 0


__all__ = ["BENCH_BEGIN", "BENCH_END", "CARD_FILE", "add_card_args", "benchmark_lines", "build_card",
           "card_requested", "main_benchmarks", "write_benchmarks", "write_card", "write_cards"]
