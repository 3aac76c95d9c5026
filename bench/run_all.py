"""Run the benchmarks and (re)write bench/RESULTS.md, the one table of every figure.

    python bench/run_all.py                  # train, checkpoint, stages, gpu, memory (~20 min on 2 cores), then RESULTS.md
    python bench/run_all.py --run all        # also data, merge, fsdp_memory(+_checkpointing), eval_ranks (+ ~30 min, 2 GB models on disk)
    python bench/run_all.py --run none       # only rebuild RESULTS.md from bench/results/
    python bench/run_all.py --run train,gpu
    python bench/run_all.py --smoke          # every benchmark's command line parses (--help), and RESULTS.md
                                             # builds from bench/results/ into a temp dir; runs no benchmark

Each benchmark writes bench/results/<name>.md (its full table) and, except the
older data and merge benchmarks, <name>.json (figures, command, machine, date,
versions), which this script reads; data.md and merge.md are parsed, and their
date is the date of their last commit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_packing import GOAL as PACKING_GOAL  # noqa: E402

BENCHES = {  # name -> script (default arguments)
    "train": "bench_train.py",
    "packing": "bench_packing.py",
    "checkpoint": "bench_checkpoint.py",
    "stages": "bench_stages.py",
    "gpu": "bench_gpu.py",
    "memory": "bench_memory.py",
    "data": "bench_data.py",
    "merge": "bench_merge.py",
    "fsdp_memory": "bench_fsdp_memory.py",
    "fsdp_memory_checkpointing": "bench_fsdp_memory.py --models 40x1024 --checkpointing on",
    "eval_ranks": "bench_eval_ranks.py",
    "quant": "bench_quant.py",
    "step": "bench_step.py",
    "load": "bench_load.py",
    "kernels": "bench_kernels.py",
    "slurm_nodes": "bench_slurm_nodes.py",
    "host_ops": "bench_host_ops.py",
}
DEFAULT_RUN = ["train", "checkpoint", "stages", "gpu", "memory"]


def _load(results: Path, name: str) -> dict | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _committed(path: Path, fmt: str = "%cs") -> str:
    """Date (or, with fmt="%h", commit) of the last commit of `path`."""
    out = subprocess.run(["git", "log", "-1", f"--format={fmt}", "--", str(path)], cwd=C.REPO,
                         capture_output=True, text=True).stdout.strip()
    return out or "uncommitted"


def _parse_md(results: Path, name: str) -> dict | None:
    """Command, machine line and table rows (first cell -> cells) of data.md / merge.md."""
    path = results / f"{name}.md"
    if not path.is_file():
        return None
    text = path.read_text()
    command = re.search(r"Command: `([^`]+)`", text)
    machine = re.search(r"^Machine: (.+)$", text, re.M)
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1 and not set(cells[0]) <= set("-: "):
            rows[cells[0]] = cells[1:]
    return {"command": command.group(1) if command else "?", "machine": machine.group(1) if machine else "?",
            "rows": rows, "date": _committed(path), "text": text}


def _row(rows: dict, prefix: str) -> list[str]:
    for key, cells in rows.items():
        if key.startswith(prefix):
            return cells
    raise KeyError(prefix)


def _data_rows(d: dict, s: str) -> list[tuple]:
    """bench_data.py's figures: records/s at its largest size, and peak RSS at its smallest and largest."""
    runs, bound = d["results"], d["rss_bound_mb"]
    small, large = min(r["records"] for r in runs), max(r["records"] for r in runs)
    at = {(r["records"], r["kind"]): r for r in runs}
    kinds = sorted({r["kind"] for r in runs})
    peak = max(r[phase]["peak_rss_mb"] for r in runs for phase in ("validate", "tokenize"))
    rows = []
    for phase, what in (("validate", "dataset validation"), ("tokenize", "tokenization + cache")):
        rate = " / ".join(f"{at[large, k]['records'] / at[large, k][phase]['seconds']:,.0f}" for k in kinds)
        rss = " / ".join(f"{at[small, k][phase]['peak_rss_mb']:,.0f} -> {at[large, k][phase]['peak_rss_mb']:,.0f} MB"
                         for k in kinds)
        rows += [(f"{what} ({large:,} records), records/s: {' / '.join(kinds)}", rate, "", s),
                 (f"{what}, peak RSS at {small:,} -> {large:,} records: {' / '.join(kinds)}", rss,
                  f"< {bound:,} MB at every size: " + ("met" if peak < bound else "NOT met"), s)]
    return rows


def _met(train: dict, ema: str) -> str:
    """Judge a ratio on both clocks: on a shared machine the wall clock carries +-20% noise per round."""
    f, rounds = train["figures"], train["per_round"]
    key = "ratio_ema" if ema else "ratio_no_ema"
    wall, cpu = f[key], f[key + "_cpu"]
    per_round = [a["tokens_per_s_wall"] / b["tokens_per_s_wall"]
                 for a, b in zip(rounds[f"ours{ema}"], rounds[f"trl{ema}"])]
    if wall >= 1.0 and cpu >= 1.0:
        return "met"
    if cpu >= 1.0:
        return (f"met on CPU time; wall clock {wall:.3f}, within its noise (rounds "
                f"{min(per_round):.2f}..{max(per_round):.2f})")
    return "NOT met"


def build_results(results: Path = C.RESULTS) -> str:
    """RESULTS.md's text from the result files in `results`."""
    train, ckpt, stages, gpu, mem = (_load(results, n) for n in ("train", "checkpoint", "stages", "gpu", "memory"))
    packing = _load(results, "packing")
    fsdp_mems = [(n, _load(results, n)) for n in ("fsdp_memory", "fsdp_memory_checkpointing")]
    eval_ranks, quant = _load(results, "eval_ranks"), _load(results, "quant")
    step = _load(results, "step")
    workflow_load = _load(results, "load")
    data, merge = _parse_md(results, "data"), _parse_md(results, "merge")
    table: list[tuple] = []  # (figure, value, goal, source)
    sources: list[tuple[str, dict]] = []

    def src(key: str, d: dict) -> str:
        if key not in [k for k, _ in sources]:
            sources.append((key, d))
        return f"[{key}]"

    if train:
        f, s = train["figures"], src("train", train)
        t = f["tokens_per_s"]
        table += [
            ("tokens/s, ours with EMA (2 rates) / TRL SFTTrainer + equivalent EMA callback",
             f"{t['ours+ema']:,.0f} / {t['trl+ema']:,.0f}", "", s),
            ("tokens/s, ours / TRL SFTTrainer, both without EMA", f"{t['ours']:,.0f} / {t['trl']:,.0f}", "", s),
            ("**tokens/s ratio ours / TRL**, both with EMA: wall clock / process CPU time",
             f"**{f['ratio_ema']:.2f} / {f['ratio_ema_cpu']:.2f}**", ">= 1.0: " + _met(train, "+ema"), s),
            ("**tokens/s ratio ours / TRL**, both without EMA: wall clock / process CPU time",
             f"**{f['ratio_no_ema']:.2f} / {f['ratio_no_ema_cpu']:.2f}**", ">= 1.0: " + _met(train, ""), s),
            ("tokens/s ratio ours with EMA / TRL without EMA: wall clock / process CPU time",
             f"{t['ours+ema'] / t['trl']:.2f} / {f['tokens_per_s_cpu']['ours+ema'] / f['tokens_per_s_cpu']['trl']:.2f}",
             "", s),
            (f"**EMA overhead**, {len(f['ema_rates'])} rates {f['ema_rates']}, % of step time (same run as the ratios)",
             f"**{f['ema_overhead_pct']:.2f}%** ({f['ema_update_us']:.0f} us per update; A/B between runs "
             f"{f['ema_overhead_ab_pct']:+.1f}%, noise)", "<= 2%", s),
        ]
    if packing:
        f, s = packing["figures"], src("packing", packing)
        sup, pad, best = f["supervised_per_s"], f["padding"], f["trl_best"]
        goal = PACKING_GOAL
        verdict = ("met" if min(f["ratio_packed_vs_trl"], f["ratio_packed_vs_trl_cpu"]) >= goal else
                   "met on CPU time only" if f["ratio_packed_vs_trl_cpu"] >= goal else "NOT met")
        table += [
            ("supervised tokens/s, demo task at 32..512 tokens: ours padded / ours packed / TRL bfd packing (its "
             "best shape); padding fraction of each",
             f"{sup['ours, padded']:,.0f} / {sup['ours, packed']:,.0f} / {sup[best]:,.0f}; "
             f"{pad['ours, padded']:.1%} / {pad['ours, packed']:.1%} / {pad[best]:.1%}", "", s),
            ("**supervised tokens/s ratio ours packed / TRL bfd packing**: wall clock / process CPU time",
             f"**{f['ratio_packed_vs_trl']:.2f} / {f['ratio_packed_vs_trl_cpu']:.2f}** (ours packed / padded: "
             f"{f['ratio_packed_vs_padded']:.2f} / {f['ratio_packed_vs_padded_cpu']:.2f})", f">= {goal}: {verdict}", s),
        ]
    if ckpt:
        f, s = ckpt["figures"], src("checkpoint", ckpt)
        table += [
            ("checkpoint save, loop stall per save: sync / async (default)",
             f"{f['sync']['stall_ms']:.0f} ms / {f['async']['stall_ms']:.0f} ms "
             f"(= {f['sync']['stall_steps']:.2f} / {f['async']['stall_steps']:.2f} updates of {f['step_ms']:.0f} ms)",
             "", s),
            ("checkpoint save, CPU time of the write (inline when sync; on the writer thread when async)",
             f"{f['sync']['write_cpu_ms']:.0f} ms / {f['async']['write_cpu_ms']:.0f} ms "
             f"({f['checkpoint_mb']:.2f} MiB checkpoint; first save of a process: "
             f"{f['sync']['first_stall_ms']:.0f} ms sync, a full garbage collection)", "", s),
        ]
    if stages:
        f, s = stages["figures"], src("stages", stages)
        n = stages["settings"]["total"]
        table += [
            ("fixed cost of one stage (process start, imports, model load, restore, final save, exit)",
             f"{f['stage_fixed_s']:.1f} s (medians, s: " + ", ".join(
                 f"{k.replace('_', ' ')} {f['phases_chunk_s'][k]:.2f}"
                 for k in ("launch", "imports", "setup", "first_update", "save", "exit")) + ")", "", s),
            ("fixed cost of a stage under `torchrun --standalone` / as a plain `python` process (pilot)",
             f"{f['stage_fixed_pilot_s']:.1f} s / {f['stage_fixed_plain_python_s']:.1f} s", "", s),
            (f"{n} updates: chunked (pilot + 2 chunks + tail) / one process, wall time",
             f"{f['chunked_wall_s']:.1f} s / {f['one_wall_s']:.1f} s = {f['chunked_over_one']:.2f}x; results "
             f"{'bit-identical' if f['identical'] else 'DIFFER'}", "", s),
        ]
    if merge:
        s = src("merge", {"command": merge["command"], "machine_text": merge["machine"], "date": merge["date"]})
        ours, peft = _row(merge["rows"], "ours"), _row(merge["rows"], "peft")
        table += [
            ("LoRA merge of a 1.9 GB fp16 model, peak RSS: ours (streaming) / peft merge_and_unload",
             f"{ours[0]} / {peft[0]}", "<= 0.3x peft", s),
            ("LoRA merge, wall time: ours / peft", f"{ours[2]} / {peft[2]}", "<= 1.0x peft", s),
        ]
    if data:
        s = src("data", {"command": data["command"], "machine_text": data["machine"], "date": data["date"]})
        figures = _load(results, "data")
        if figures:
            table += _data_rows(figures, s)
        else:  # a data.md of before its data.json (throughput only)
            val, tok = _row(data["rows"], "validate ("), _row(data["rows"], "tokenize")
            table += [
                (f"dataset validation ({val[0]} records), records/s / tokens/s", f"{val[2]} / {val[3]}", "", s),
                (f"tokenization + cache ({tok[0]} records), records/s / tokens/s", f"{tok[2]} / {tok[3]}", "", s),
            ]
    if mem:
        f, s = mem["figures"], src("memory", mem)
        b, a, pad = f["before"], f["after"], f["padding"]
        table += [
            ("**peak memory of one update**, CPU, vocab 32k, micro-batch 8 x 512 tokens: before / after issue 13",
             f"{b['update_peak_mb']:,.0f} MB / {a['update_peak_mb']:,.0f} MB = **{f['update_peak_ratio']:.2f}x**",
             "<= 0.5x: " + ("met" if f["update_peak_ratio"] <= 0.5 else "NOT met"), s),
            ("tokens/s of the same runs: before / after", f"{b['tokens_per_s']:,.0f} / {a['tokens_per_s']:,.0f}",
             "", s),
            ("padding fraction of the default data: micro-batches as sampled / grouped by length",
             f"{100 * pad['before']:.1f}% / {100 * pad['after']:.1f}%", "", s),
        ]
    for name, fsdp_mem in fsdp_mems:
        if not fsdp_mem:
            continue
        s = src(name, fsdp_mem)
        for m in fsdp_mem["figures"]:
            worst = m["rounds"][m["ratios"].index(m["ratio"])]  # the round the ratio comes from
            before, after = (max(worst[f"meta_init={x}"]["rank_peak_rss_mb"]) for x in ("False", "True"))
            table.append((f"**FSDP peak host RSS per rank**, 2 CPU ranks, {m['params'] / 1e6:.0f}M parameters "
                          f"({m['shape']}), LoRA, activation checkpointing {fsdp_mem['checkpointing']}: whole-model "
                          f"load / sharded load (worst of {len(m['rounds'])} rounds)",
                          f"{before:,.0f} MiB / {after:,.0f} MiB = **{m['ratio']:.3f}x**; final shards "
                          f"{'bit-identical' if m['identical'] else 'DIFFER'}",
                          "<= 0.6x: " + ("met" if m["ratio"] <= 0.6 else "NOT met"), s))
    if eval_ranks:
        f, s = eval_ranks["figures"], src("eval_ranks", eval_ranks)
        table.append(("evaluation of the default validation set (raw + 2 EMA rates), CPU: 1 rank / 2 ranks",
                      f"{f['seconds']['1']:.2f} s / {f['seconds']['2']:.2f} s = {f['speedup']:.2f}x; losses "
                      f"{'identical' if f['identical'] else 'DIFFER'}", "", s))
    if quant:
        f, s = quant["figures"], src("quant", quant)
        b, q = f["bf16"], f["nf4"]
        table += [
            (f"**QLoRA: base weights' share of host memory**, {b['params'] / 1e6:.0f}M parameters, CPU: bf16 base / "
             "nf4 base (RSS rise of the load; plan's estimate beside)",
             f"{b['base_rss_mb']:,.0f} MiB / {q['base_rss_mb']:,.0f} MiB = **{f['base_share_ratio']:.3f}x** (estimate "
             f"{b['estimate_weights_mb']:,.0f} / {q['estimate_weights_mb']:,.0f} MiB)",
             f"<= {f['goal']}x: " + ("met" if f["base_share_ratio"] <= f["goal"] else "NOT met"), s),
            ("QLoRA: peak RSS of one update, whole process: bf16 base / nf4 base (plan's estimate beside, "
             "without its CUDA allowance)",
             f"{b['update_peak_rss_mb']:,.0f} MiB / {q['update_peak_rss_mb']:,.0f} MiB = {f['update_peak_ratio']:.2f}x "
             f"(estimate {b['estimate_total_mb']:,.0f} / {q['estimate_total_mb']:,.0f} MiB)", "", s),
        ]
    if step:
        f, s = step["figures"], src("step", step)
        table += [("one step, padded batch, Llama vocab 32k, CPU: tokens/s with the attention mask (before) / "
                   "without (after): wall clock; per process CPU second",
                   f"{f['tokens_per_s']['masked']:,.0f} / {f['tokens_per_s']['mask-free']:,.0f}; "
                   f"{f['tokens_per_cpu_s']['masked']:,.0f} / {f['tokens_per_cpu_s']['mask-free']:,.0f}",
                   "after >= before: " + ("met" if f["tokens_per_s"]["mask-free"] >= f["tokens_per_s"]["masked"]
                                          else "NOT met"), s),
                  ("mask-free vs masked step: max abs diff of the mean loss / of the gradients",
                   f"{f['loss_diff']:.2g} / {f['grad_diff']:.2g}",
                   "<= 1e-6: " + ("met" if max(f["loss_diff"], f["grad_diff"]) <= 1e-6 else "NOT met"), s)]
    if workflow_load:
        f, s = workflow_load["figures"], src("load", workflow_load)
        before, after = f["before"], f["after"]
        table += [(f"`snakemake -n -q` of the default config, {workflow_load['before']} (before) / this tree (after): "
                   "wall s; CPU s; peak RSS; torch imported",
                   f"{before['wall_s']:.2f} / {after['wall_s']:.2f}; {before['cpu_s']:.2f} / {after['cpu_s']:.2f}; "
                   f"{before['rss_mb']:.0f} / {after['rss_mb']:.0f} MiB; {'yes' if 'torch' in before['heavy'] else 'no'}"
                   f" / {'yes' if 'torch' in after['heavy'] else 'no'}",
                   "no torch at load: " + ("met" if "torch" not in after["heavy"] else "NOT met"), s)]
    host_ops = _load(results, "host_ops")
    if host_ops:
        peft_row = next(r for r in host_ops["rows"] if r["arm"] == "peft")
        table.append((f"ops that compute (a kernel each on a GPU) per micro-batch, Llama-3.2-1B's structure "
                      f"({host_ops['layers']} layers) with LoRA r=16 x 7, forward + backward",
                      f"{peft_row['computing_ops']:,}", "(a count: see gpu_check.md)", src("host_ops", host_ops)))
    nodes = _load(results, "slurm_nodes")
    if nodes:
        by = {r["arm"]: r for r in nodes["rows"]}
        one, two, backoff = (by.get(a) for a in ("1 node", "2 nodes", "2 nodes, plugin backoff"))
        if one and two:
            table.append(("default pipeline through the test SLURM cluster (2 cores), whole run: train.nodes=1 / 2"
                          + (" / 2 with the plugin's own poll backoff" if backoff else "") + ", s",
                          f"{one['wall_s']:.0f} / {two['wall_s']:.0f}" + (f" / {backoff['wall_s']:.0f}" if backoff else ""),
                          "2-node tests add <= 4 min to CI: see the issue 35 note", src("slurm_nodes", nodes)))
    kernels = _load(results, "kernels")
    if kernels:
        s = src("kernels", kernels)
        arms = {a["arm"]: a for a in kernels["arms"]}
        base = kernels["arms"][0]
        table += [("fused settings, LoRA fp32 step on a CPU, against the default: tokens per CPU s / tokens/s "
                   "(wall) / RSS rise over the steps of " + ", ".join(arms),
                   "; ".join(f"{a['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x / "
                             f"{a['tokens_per_s'] / base['tokens_per_s']:.2f}x / "
                             f"{a['step_rss_rise_mb'] - base['step_rss_rise_mb']:+,.0f} MB" for a in arms.values()),
                   "", s)]
    if gpu:
        s = src("gpu", gpu)
        if gpu.get("status") == "measured" and "mfu_6n" in gpu["figures"]:
            f = gpu["figures"]
            table += [("GPU: tokens/s, LoRA bf16, Llama-3.2-1B shapes", f"{f['tokens_per_s']:,.0f} on {f['gpu']}", "", s),
                      ("GPU: MFU, LoRA actual / 6N convention", f"{100 * f['mfu_lora_actual']:.1f}% / "
                       f"{100 * f['mfu_6n']:.1f}%", ">= 45% (6N) on H100", s),
                      ("GPU: peak memory / plan's estimate", f"{f['mem_mb'] / 1024:.1f} / {f['estimate_mb'] / 1024:.1f} GiB",
                       "", s)]
        else:
            status = gpu["status"] if gpu.get("status") != "measured" else "not measured with this version"
            table += [("GPU: tokens/s, LoRA bf16, Llama-3.2-1B shapes", status, "", s),
                      ("GPU: MFU, LoRA actual / 6N convention", status, ">= 45% (6N) on H100", s)]

    lines = [
        "# Benchmark results",
        "",
        "Every figure, with where it comes from. Regenerate with `python bench/run_all.py` (see bench/README.md); "
        "each source's full table, with how it was measured, is in bench/results/<name>.md.",
        "",
        "| figure | value | goal | source |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table]
    lines += ["", "Sources (command from the repository root; machine; date; versions):", ""]
    for key, d in sources:
        machine = d.get("machine_text") or C.machine_text(d["machine"])
        versions = f"; {C.versions_text(d['versions'])}" if d.get("versions") else ""
        extra = ""
        if d.get("load_during"):
            extra = f"; load average during the runs {d['load_during'][0]:.1f}..{d['load_during'][1]:.1f}"
        if d.get("trainer_commit"):
            extra += f"; trainer at commit {d['trainer_commit']}"
        else:  # older result files: say which commit brought them, the trainer's is not recorded
            path = next((p for p in (results / f"{key}.json", results / f"{key}.md") if p.is_file()), None)
            extra += (f"; trainer commit not recorded (result file committed in "
                      f"{_committed(path, '%h') if path else 'uncommitted'})")
        lines.append(f"- [{key}] `{d['command']}` — {d['date']}; {machine}{versions}{extra}. "
                     f"Details: [results/{key}.md](results/{key}.md).")
    lines += [
        "",
        "Notes:",
        "",
        "- The CPU figures come from a 2-core machine shared with other jobs (see the load averages): "
        "configurations were interleaved and rotated and the figures are medians, but noise remains: between two "
        "full runs of bench_train.py the wall-clock ratios moved by up to 0.3, the process CPU-time ones (given "
        "beside them, and disturbed much less by other jobs) by 0.1.",
        "- The throughput ratios and the EMA overhead come from the same `bench_train.py` run: the EMA overhead is "
        "each `EMA.update` call timed inside the runs that give our tokens/s.",
        "- Merge and data figures were measured earlier by bench_merge.py and bench_data.py and are copied from "
        "their result files (date = last commit of the file).",
        "- Each source's figures are from the trainer of its own date and commit (above); a benchmark is "
        "re-run only when its figures are wanted, so they are of different ages. [checkpoint] and [stages] "
        "are from the trainer before issue 13. [memory] compares that trainer (0603ead) with the one of its "
        "commit on one update, and its RSS figures move between rounds by up to a third (the allocator keeps "
        "or returns freed memory): its table gives every round.",
        "- [train] of 2026-11-24 (commit 326f2e1 of the bench branch: its pipeline/ and config/ are main's 31c9b83) replaces the figures of 2026-11-21 (trainer 779317e, before issue 13; ratios "
        "ours / TRL 1.33 / 1.17 with EMA and 1.25 / 1.20 without, wall / CPU). Since then the trainer computes "
        "the loss at supervised positions only (TokenLoss, chunked), groups each update's micro-batches by "
        "length, and gained FSDP2, vision-language, chat-template, tracker and progress-line code (issues "
        "12-16, 21); the benchmark now gives TRL the very micro-batches ours takes (so both pad alike) and the "
        "layer names our trainer resolves from `target_modules: [all-linear]` (its TRL arm had failed since "
        "that default). Its runs shared the 2 cores with a load average of 4-8, so the wall-clock figures "
        "(the EMA A/B among them) are mostly that load; the CPU-time ratios are the ones to read.",
        "- [quant] is at its goal's edge: the run before the one shown (same command, commit 20e1a95, load "
        "average 8-9) gave 708 / 322 MiB = 0.454x (NOT met); the bytes of the base's tensors are 0.40x in both "
        "(exact, and what the plan's estimate says), the rest is the load's allocator overhead (30-60 MiB either "
        "way). At 8B (Llama-3-8B shapes, 87% of the weights in quantized layers) the estimate's share is 0.355x. "
        "Measured on the CPU only: no GPU here.",
        "- Every script's `--smoke` mode (tiny sizes, a temp dir) runs in tests/test_bench_smoke.py, so a "
        "benchmark that stops running is noticed; the figures here come only from the real modes.",
        "- [step] measures the CPU. Its loss chunk is the eager one in both arms (as before the change); the "
        "loss chunk compiled with torch.compile, which the trainer takes on CUDA only, is not measured: no GPU. "
        "Run once through inductor's CPU backend (a one-off check, not a benchmark) it matched the eager chunk "
        "to 1.1e-7 relative in the loss and 6e-8 in the gradients. The mask-free step on a GPU (SDPA's flash "
        "kernel instead of the masked one) is not measured either.",
        "- [kernels] measures the CPU only (no GPU was lent): its fused-loss arm is the torch fallback of the "
        "kernels' contract (full logits), not Liger's or cut-cross-entropy's kernels, and it is faster there "
        "because the default's chunked loss recomputes its chunk's logits in the backward; the ratios are of "
        "tokens per process CPU second and of wall clock on a shared machine (its table gives the load).",
    ]
    return "\n".join(lines) + "\n"


def _check_command_lines() -> None:
    """Every benchmark's command line in BENCHES parses (`--help`: the script loads and knows its options)."""
    for name, line in BENCHES.items():
        script, *extra = line.split()
        proc = subprocess.run([sys.executable, str(C.REPO / "bench" / script), *extra, "--help"], cwd=C.REPO,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name}: `python bench/{line} --help` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=",".join(DEFAULT_RUN),
                    help=f"comma-separated benchmarks to run first ({', '.join(BENCHES)}), 'all' or 'none'")
    ap.add_argument("--out", type=Path, default=C.RESULTS_MD, help="where RESULTS.md goes")
    C.add_smoke(ap)
    args = ap.parse_args()
    if C.smoke(args, out="out", run="none"):
        _check_command_lines()
    names = {"all": list(BENCHES), "none": []}.get(args.run, [n for n in args.run.split(",") if n])
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    for name in names:
        script, *extra = BENCHES[name].split()
        script = C.REPO / "bench" / script
        print(f"== {name}: python {' '.join([str(script.relative_to(C.REPO)), *extra])}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(script), *extra], cwd=C.REPO, check=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(build_results())
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
