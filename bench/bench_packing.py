"""Benchmark: supervised tokens/s with padded micro-batches, with our packing, and with TRL's packing.

    python bench/bench_packing.py                  # 3 rounds x 4 configurations, 24 updates each
    python bench/bench_packing.py --rounds 2 --steps 16
    python bench/bench_packing.py --smoke          # 1 round, tiny sizes: checks it runs

One run measures, side by side, on the demo task scaled to mixed lengths (records
of about 32..512 tokens, uniform: `pipeline.demo.text.build_mixed_dataset`) and
the embedded default architecture (Llama, 4 layers, hidden 128, char tokenizer;
random init, fp32 on CPU, 1 torch thread), with the default run's trainer
settings (`train.overrides` of config/config.yaml: global batch 32, micro-batch
16, LoRA, lr, warmup), EMA off on every side (TRL has none):

* ours, padded: `tokens.packing=off`, today's micro-batches of 16 records
  grouped by length, right-padded (`torchrun ... -m pipeline train`, with the
  clock hooks of `_ours.py`);
* ours, packed: the default (`tokens.packing=auto`, `pipeline.planning.packing`:
  each update's records packed by best-fit decreasing into rows of up to the
  longest record, micro-batches of up to 16 rows; on a CPU one flat row per
  micro-batch, SDPA's causal kernel run record by record,
  `pipeline.model.packed_attention`);
* TRL 1.16 `SFTTrainer` with `packing=True, packing_strategy="bfd"` (best-fit
  decreasing over the whole dataset into rows of `max_length` = the longest
  record, padding-free: each micro-batch's rows flattened into one, with
  position ids), with as many rows per update as our packing makes of an
  update's records (16 of 32 records here: an even number near our mean), in
  two shapes: 2 micro-batches of half of them (like ours), and one row per
  micro-batch (TRL's cheapest attention on SDPA: its flat row is then one row
  long). Both see the records our trainer trains on in its first updates, in
  that order, pre-tokenized (our token cache's input_ids and labels, so the same
  supervised tokens); the LoRA, optimizer and schedule settings are ours (as
  bench_train.py sets them).

Supervised tokens/s: the tokens that carry a loss (the assistant's), per
second of the wall time between the ends of consecutive updates (the first
`--warmup` updates excluded); the median over updates, and the total over the
total (the mean) beside it; medians over rounds, configurations interleaved
and rotated. The process CPU-time clock is shown beside the wall clock (the
cores are shared). Padding fraction: padding tokens / tokens computed, over the
measured runs' updates (TRL's padding-free rows have none; its flat row spends
attention on pairs of records that the mask then drops instead).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from bench_train import _clocks, _run as _run_ours  # noqa: E402

# name: (tool, our overrides | TRL's micro-batches per update: 2 of half its rows each, or one row each)
CONFIGS = {
    "ours, padded": ("ours", ["tokens.packing=off"]),
    "ours, packed": ("ours", []),
    "TRL bfd, 2 micro-batches": ("trl", 2),
    "TRL bfd, 1 row per micro-batch": ("trl", None),
}
PACKAGES = ("torch", "transformers", "peft", "trl", "accelerate", "datasets")
GOAL = 1.3  # ours, packed >= 1.3 x TRL's best


def build(root: Path, *, n_train: int, lengths: tuple[int, int]) -> dict:
    """The default architecture (random init; positions for 512 tokens) and token caches of the demo
    task at mixed lengths."""
    from pipeline.data.tokenize import load_tokenizer, tokenize_file, tokenizer_fingerprint
    from pipeline.demo import text as demo

    tok = demo.build_tokenizer()
    model = demo.build_model(tok, seed=0)
    model.config.max_position_embeddings = 512
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    paths = demo.build_mixed_dataset(root / "data", lengths=lengths, n_train=n_train, n_val=16)
    tokenizer, fp = load_tokenizer(root / "model"), tokenizer_fingerprint(root / "model")
    for split in ("train", "val"):
        tokenize_file(paths[split], tokenizer, out_path=root / f"{split}.safetensors", max_length=512,
                      too_long="error", fingerprint=fp, split=split)
    return {"model": root / "model", "train": root / "train.safetensors", "val": root / "val.safetensors"}


# --- TRL child ---------------------------------------------------------------------------------------


def _child_trl(args) -> None:
    """TRL SFTTrainer, bfd packing, on our records in our order, with our LoRA and optimizer settings."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from pipeline import config as train_config
    from pipeline.data.cache import TokenCache
    from pipeline.model.targets import resolve as lora_targets

    cfg = train_config.load(args.config)
    order = json.loads(Path(args.order).read_text())
    cache = TokenCache(C.cfg_value(cfg, C.KEY_TRAIN_CACHE))
    rows = [cache[i] for i in order]
    dataset = Dataset.from_dict({"input_ids": [ids.tolist() for ids, _ in rows],
                                 "labels": [lab.tolist() for _, lab in rows]})
    stamps = []

    class Timer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(_clocks())

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    targets = lora_targets(model, cfg.lora, cfg.moe).modules
    lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=targets, use_rslora=cfg.lora.use_rslora, bias="none", task_type="CAUSAL_LM")
    per_device, accum = int(args.rows), int(args.accum)
    per_update = per_device * accum
    longest = int(max(len(ids) for ids, _ in rows))

    def sft(max_steps: int) -> SFTConfig:
        return SFTConfig(
            output_dir=str(Path(args.work) / "trl"), max_steps=max_steps, seed=cfg.seed,
            per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
            learning_rate=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
            adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1], adam_epsilon=cfg.optim.eps,
            max_grad_norm=cfg.optim.grad_clip, warmup_steps=int(max_steps * cfg.optim.warmup_fraction),
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": cfg.optim.min_lr_ratio},
            gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
            packing=True, packing_strategy="bfd", max_length=longest,
            train_sampling_strategy="sequential", dataloader_num_workers=0,
            logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        )

    # The packed dataset decides how many whole updates there are: pack once to count them.
    probe = SFTTrainer(model=model, args=sft(1), train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    packed = probe.train_dataset
    steps = len(packed) // per_update
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=sft(steps), train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora, callbacks=[Timer()])
    assert trainer.padding_free, "bfd packing is padding-free in TRL 1.16"
    trainer.train()
    supervised, tokens = [], []
    for s in range(steps):
        part = packed.select(range(s * per_update, (s + 1) * per_update))
        sup = tok = 0
        for labels, lengths in zip(part["labels"], part["seq_lengths"]):
            start = 0
            for n in lengths:  # a record's first label is never a target (nothing before it predicts it)
                sup += sum(1 for x in labels[start + 1:start + n] if x != -100)
                start += n
            tok += start
        supervised.append(sup)
        tokens.append(tok)
    Path(args.result).write_text(json.dumps({
        "stamps": stamps, "supervised": supervised, "tokens": tokens, "computed": tokens,
        "threads": torch.get_num_threads(), "rows": len(packed), "rows_per_micro_batch": per_device,
        "accumulation": accum, "max_length": longest,
    }))


def _run_trl(name: str, rows: int, accum: int, run: dict, order: Path, work: Path, threads: int) -> dict:
    work.mkdir(parents=True)
    result = work / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "trl", "--config", str(run["config"]),
           "--work", str(work), "--result", str(result), "--order", str(order), "--rows", str(rows),
           "--accum", str(accum)]
    load = C.run_child(cmd, work, threads, name)
    out = json.loads(result.read_text())
    out["load"] = load[0] if load else None
    return out


# --- ours ------------------------------------------------------------------------------------------------


def _our_updates(cfg, steps: int, *, packed: bool) -> dict:
    """Per update of ours: supervised tokens, tokens, tokens computed (padding included); and the order
    of its records (what TRL is given)."""
    from pipeline.data.cache import TokenCache
    from pipeline.planning.packing import computed_tokens, pack_update, row_capacity
    from pipeline.train.batches import RunSampler, supervised_counts

    cache = TokenCache(C.cfg_value(cfg, C.KEY_TRAIN_CACHE))
    lengths, counts = cache.lengths, supervised_counts(cache)
    grouped = lengths if C.cfg_value(cfg, C.KEY_GROUP_BY_LENGTH) else None
    sampler = RunSampler(len(cache), cfg.optim.global_batch, cfg.seed, grouped)
    micro = cfg.optim.micro_batch
    out = {"supervised": [], "tokens": [], "computed": [], "order": [], "micro_batches": [], "rows": []}
    for s in range(steps):
        idx = sampler.global_indices(s)
        out["order"] += idx
        out["supervised"].append(int(counts[idx].sum()))
        out["tokens"].append(int(lengths[idx].sum()))
        if packed:
            mbs = pack_update(idx, lengths, capacity=row_capacity(lengths), world=1, micro=micro)[0]
            out["computed"].append(sum(computed_tokens(mb, lengths, "records") for mb in mbs))  # a CPU: one flat row
            out["rows"].append(sum(len(mb) for mb in mbs))
        else:
            mbs = sampler.rank_micro_batches(s, 0, 1, micro)
            out["computed"].append(sum(int(lengths[mb].max()) * len(mb) for mb in mbs))
        out["micro_batches"].append(len(mbs))
    return out


def _summarize(stamps: list, supervised: list[int], warmup: int) -> dict:
    """Steady-state supervised tokens/s of one run (updates warmup+1 .. N, 1-based), wall and CPU clock."""
    # interval i ends update i+2 (1-based): the first update has no start stamp
    steps = [((b[0] - a[0], b[1] - a[1]), sup) for i, (a, b, sup) in
             enumerate(zip(stamps, stamps[1:], supervised[1:])) if i + 2 > warmup]
    res = {"steps": len(steps)}
    for k, clock in enumerate(("wall", "cpu")):
        res[f"sup_per_s_{clock}"] = C.median(sup / dt[k] for dt, sup in steps)
        res[f"sup_per_s_{clock}_mean"] = sum(sup for _, sup in steps) / sum(dt[k] for dt, _ in steps)
        res[f"step_s_{clock}"] = C.median(dt[k] for dt, _ in steps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="updates per run of ours (TRL: as many as its rows fill)")
    ap.add_argument("--warmup", type=int, default=4, help="updates excluded at the start of every run")
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads of every run")
    ap.add_argument("--records", type=int, default=2000, help="training records of the mixed-length demo data")
    ap.add_argument("--out-dir", type=Path, default=C.RESULTS)
    C.add_smoke(ap)
    ap.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    for name in ("config", "work", "result", "order", "rows", "accum"):
        ap.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child_trl(args)
    lengths = (32, 512)
    if C.smoke(args, rounds=1, steps=4, warmup=1, records=64):
        lengths = (32, 96)
    machine = C.machine()

    from pipeline import config as train_config

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        tmp = Path(tmp)
        data = build(tmp / "data", n_train=args.records, lengths=lengths)
        base = [*C.workflow_overrides(), "checkpoint.save_every=0", "ema.rates=[]"]
        runs = {name: C.plan_run(tmp / f"plan{k}", data, total=args.steps, single_stage=True,
                                 overrides=[*base, *spec[1]])
                for k, (name, spec) in enumerate(CONFIGS.items()) if spec[0] == "ours"}
        cfg = train_config.load(runs["ours, packed"]["config"])
        ours = {name: _our_updates(train_config.load(run["config"]), args.steps, packed=name == "ours, packed")
                for name, run in runs.items()}
        assert ours["ours, padded"]["order"] == ours["ours, packed"]["order"]  # the same records, update by update
        order = tmp / "order.json"
        order.write_text(json.dumps(ours["ours, packed"]["order"]))
        rows = ours["ours, packed"]["rows"]
        per_update = max(2, 2 * round(sum(rows) / len(rows) / 2))  # TRL's rows per update: even, near ours
        trl_shape = {n: ((per_update // spec, spec) if spec else (1, per_update))
                     for n, (tool, spec) in CONFIGS.items() if tool == "trl"}

        names = list(CONFIGS)
        results: dict[str, list[dict]] = {n: [] for n in names}
        raw: dict[str, dict] = {}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                tool, spec = CONFIGS[name]
                work = tmp / f"r{r}_{names.index(name)}"
                t0 = time.perf_counter()
                if tool == "ours":
                    out = _run_ours(name, "ours", False, runs[name], order, work, args.steps, args.threads)
                    assert out["tokens"] == ours[name]["tokens"], name  # the trainer's own count: the same records
                    out = {**out, **{k: ours[name][k] for k in ("supervised", "computed", "micro_batches")}}
                else:
                    out = _run_trl(name, *trl_shape[name], runs["ours, packed"], order, work, args.threads)
                raw.setdefault(name, out)
                s = {**_summarize(out["stamps"], out["supervised"], args.warmup), "load": out["load"]}
                results[name].append(s)
                print(f"round {r + 1}/{args.rounds} {name:20s} {s['sup_per_s_wall']:7,.0f} supervised tokens/s wall "
                      f"{s['sup_per_s_cpu']:7,.0f} CPU  step {1000 * s['step_s_wall']:7.1f} ms  load {s['load']}  "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    _report(args, machine, cfg, results, raw, time.time() - started, lengths, per_update)


def _report(args, machine, cfg, results, raw, wall, lengths, per_update) -> None:
    med = {n: {k: C.median(r[k] for r in rs) for k in rs[0] if k != "load"} for n, rs in results.items()}
    padding = {n: 1.0 - sum(out["tokens"]) / sum(out["computed"]) for n, out in raw.items()}
    trl = [n for n in CONFIGS if CONFIGS[n][0] == "trl"]
    best = max(trl, key=lambda n: med[n]["sup_per_s_cpu"])
    rounds = range(args.rounds)
    ratio = {clock: [results["ours, packed"][i][f"sup_per_s_{clock}"] / results[best][i][f"sup_per_s_{clock}"]
                     for i in rounds] for clock in ("wall", "cpu")}
    vs_padded = {clock: [results["ours, packed"][i][f"sup_per_s_{clock}"]
                         / results["ours, padded"][i][f"sup_per_s_{clock}"] for i in rounds] for clock in ("wall", "cpu")}
    loads = [r["load"] for rs in results.values() for r in rs if r["load"] is not None]
    figures = {
        "supervised_per_s": {n: med[n]["sup_per_s_wall"] for n in med},
        "supervised_per_s_cpu": {n: med[n]["sup_per_s_cpu"] for n in med},
        "supervised_per_s_mean": {n: med[n]["sup_per_s_wall_mean"] for n in med},
        "padding": padding, "trl_best": best,
        "ratio_packed_vs_trl": C.median(ratio["wall"]), "ratio_packed_vs_trl_cpu": C.median(ratio["cpu"]),
        "ratio_packed_vs_padded": C.median(vs_padded["wall"]),
        "ratio_packed_vs_padded_cpu": C.median(vs_padded["cpu"]),
    }
    command = C.command_line(__file__)
    data = {"name": "packing", "command": command, "date": C.today(), "machine": machine,
            "versions": C.versions(*PACKAGES), "trainer_commit": C.git_commit(), "wall_s": wall,
            "load_during": [min(loads), max(loads)] if loads else None,
            "settings": {"steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "threads": args.threads,
                         "records": args.records, "lengths": list(lengths), "micro_batch": cfg.optim.micro_batch,
                         "global_batch": cfg.optim.global_batch, "trl_rows_per_update": per_update,
                         "lora": {"r": cfg.lora.r, "alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout}},
            "figures": figures, "per_round": results}
    f = figures
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    met = "met" if f["ratio_packed_vs_trl"] >= GOAL and f["ratio_packed_vs_trl_cpu"] >= GOAL else (
        "met on CPU time only" if f["ratio_packed_vs_trl_cpu"] >= GOAL else "NOT met")
    shapes = {"ours, padded": f"{C.median(raw['ours, padded']['micro_batches']):.0f} micro-batches of "
                              f"{cfg.optim.micro_batch} records per update, grouped by length",
              "ours, packed": f"{C.median(raw['ours, packed']['micro_batches']):.0f} micro-batches of up to "
                              f"{cfg.optim.micro_batch} rows per update, each one flat row attended record by "
                              "record"}
    for n in trl:
        shapes[n] = (f"{raw[n]['rows_per_micro_batch']} row(s) of {raw[n]['max_length']} tokens per micro-batch x "
                     f"{raw[n]['accumulation']}, flattened to one row")
    lines = [
        "# Packing: supervised tokens/s, padded vs our packing vs TRL's bfd packing",
        "",
        f"Command: `{command}` (from the repository root); {C.today()}; {wall / 60:.1f} min in all.",
        "",
        f"Machine: {C.machine_text(machine)}"
        + (f"; load average during the runs {min(loads):.1f}..{max(loads):.1f}." if loads else "."),
        f"Versions: {C.versions_text(data['versions'])}; trainer at commit {data['trainer_commit']}.",
        "",
        f"Data: the demo task at mixed lengths, {args.records} training records of about {lengths[0]}..{lengths[1]} "
        f"tokens (uniform). Model: the embedded default architecture (Llama, 4 layers, hidden 128), random init, "
        f"fp32, SDPA, {args.threads} torch thread(s). LoRA r={cfg.lora.r}, alpha={cfg.lora.alpha}, "
        f"dropout={cfg.lora.dropout}; no EMA. Ours: {cfg.optim.global_batch} records per update, "
        f"{args.steps} updates per run; TRL: {per_update} packed rows per update (the same records, in our "
        f"order), as many updates as they fill. First {args.warmup} updates of each run excluded; {args.rounds} "
        "rounds, configurations interleaved and rotated; medians over rounds.",
        "",
        "| configuration | micro-batches | padding | supervised tokens/s, wall | per round | mean | "
        "CPU time | step (ms), wall |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in CONFIGS:
        m = med[n]
        lines.append(f"| {n} | {shapes[n]} | {padding[n]:.1%} | {m['sup_per_s_wall']:,.0f} "
                     f"| {C.spread(r['sup_per_s_wall'] for r in results[n])} | {m['sup_per_s_wall_mean']:,.0f} "
                     f"| {m['sup_per_s_cpu']:,.0f} | {1000 * m['step_s_wall']:.0f} |")
    lines += [
        "",
        "| figure | value | goal |",
        "|---|---:|---|",
        f"| ours, packed / TRL's best ({best}), supervised tokens/s | {f['ratio_packed_vs_trl']:.2f} wall "
        f"(rounds {fmt(ratio['wall'])}); {f['ratio_packed_vs_trl_cpu']:.2f} CPU time (rounds {fmt(ratio['cpu'])}) "
        f"| >= {GOAL}: {met} |",
        f"| ours, packed / ours, padded | {f['ratio_packed_vs_padded']:.2f} wall (rounds {fmt(vs_padded['wall'])}); "
        f"{f['ratio_packed_vs_padded_cpu']:.2f} CPU time | |",
        "",
        "Padding: padding tokens / tokens computed over the run's updates (ours, padded: records padded to the "
        "micro-batch's longest; ours, packed, on a CPU: one flat row per micro-batch, no padding; TRL's "
        "padding-free rows have none either, but each micro-batch is one flat row over which SDPA computes every "
        "pair of positions before the document mask drops those across records, where ours computes each "
        "record's own causal triangle). The tokens/s count only supervised tokens (the assistant's answer), the "
        "same records on every side.",
    ]
    C.write_results("packing", lines, data, args.out_dir)


if __name__ == "__main__":
    main()
