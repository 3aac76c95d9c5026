"""Benchmark: streaming `pipeline merge` vs peft `merge_and_unload` + `save_pretrained`.

    python bench/bench_merge.py [--workdir /tmp] [--layers 16] [--out bench/results/merge.md]
    python bench/bench_merge.py --smoke     # a 2-layer, 64-wide model (SMOKE_SHAPE), to a temp dir: checks it runs

Generates a ~2 GB fp16 Llama-style base (random init, written directly shard
by shard, ~5 shards + index) and a rank-16 LoRA adapter on all seven linear
targets, then merges it twice, each in its own fresh subprocess:

* ours: `python -m pipeline merge --base B --adapter A --out O`
* peft: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(B), A)
  .merge_and_unload().save_pretrained(O)`

Peak RSS is the child's own `VmHWM` (/proc/self/status: the kernel's
high-water mark of its RSS since exec, no sampling gap), cross-checked by
psutil polling from the parent. (`ru_maxrss` is not used: Linux carries it over
from the forking parent, so it reports at least the parent's size.) The
inputs are generated in a subprocess too, so the parent stays small. Wall
time is measured from the parent (interpreter start and imports included for
both).
The two outputs are then compared tensor by tensor. Results go to a Markdown
file; the generated files are deleted at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARD_BYTES = 420 * 10**6
SHAPE = dict(hidden_size=2048, intermediate_size=5632, vocab_size=32000, num_attention_heads=16)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, vocab_size=512, num_attention_heads=4)


# --- children: each runs one merge and reports its own peak RSS -------------------------------


def _child(kind: str, base: str, adapter: str, out: str) -> None:
    started = time.perf_counter()
    if kind == "ours":
        from pipeline import cli

        rc = cli.main(["merge", "--base", base, "--adapter", adapter, "--out", out])
        assert rc == 0
    else:
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float16)
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.save_pretrained(out, max_shard_size=SHARD_BYTES)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    peak_mb = int(status["VmHWM"].split()[0]) / 1024  # kB
    print(json.dumps({"peak_rss_mb": peak_mb, "work_s": time.perf_counter() - started}))


def _measure(kind: str, base: Path, adapter: Path, out: Path) -> dict:
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(base), str(adapter), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    polled = [0]

    def poll() -> None:
        handle = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                polled[0] = max(polled[0], handle.memory_info().rss)
            except psutil.Error:
                break
            time.sleep(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - started
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"{kind} merge failed:\n{stderr[-3000:]}")
    report = json.loads(stdout.strip().splitlines()[-1])
    report.update(wall_s=wall, polled_rss_mb=polled[0] / 2**20)
    return report


# --- inputs ------------------------------------------------------------------------------------


def _llama_config(layers: int, smoke: bool = False):
    from transformers import LlamaConfig

    shape = SMOKE_SHAPE if smoke else SHAPE
    return LlamaConfig(**shape, num_hidden_layers=layers, num_key_value_heads=shape["num_attention_heads"],
                       max_position_embeddings=2048, tie_word_embeddings=False, dtype="float16")


def _shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        shapes += [(f"{p}.self_attn.{m}.weight", (h, h)) for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
        shapes += [(f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                   (f"{p}.mlp.down_proj.weight", (h, i))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def _write_base(root: Path, config) -> list[int]:
    """Random fp16 weights streamed into ~420 MB shards; returns the shard sizes."""
    import torch
    from transformers import GenerationConfig

    from pipeline.storage import hf_dir
    from pipeline.storage.safetensors_stream import StreamingWriter, TensorSpec

    root.mkdir(parents=True)
    config.save_pretrained(root)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(root)
    specs = [TensorSpec(name, torch.float16, shape) for name, shape in _shapes(config)]
    groups = hf_dir.plan_shards(specs, SHARD_BYTES)
    names = [hf_dir.SHARD_NAME.format(index=n + 1, count=len(groups)) for n in range(len(groups))]
    generator = torch.Generator().manual_seed(0)
    for name, group in zip(names, groups):
        with StreamingWriter(root / name, group, hf_dir.ST_METADATA) as writer:
            for spec in group:
                if spec.name.endswith("norm.weight"):
                    tensor = torch.ones(spec.shape, dtype=torch.float16)
                else:
                    tensor = (torch.randn(spec.shape, generator=generator) * 0.02).to(torch.float16)
                writer.write(spec.name, tensor)
    hf_dir.write_index(root, dict(zip(names, groups)))
    return [sum(s.nbytes for s in group) for group in groups]


def _write_adapter(root: Path, config, base: Path, rank: int = 16) -> None:
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, shape in _shapes(config):
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in TARGETS:
            out_features, in_features = shape
            key = f"base_model.model.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn((rank, in_features), generator=generator) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn((out_features, rank), generator=generator) * 0.01
    root.mkdir(parents=True)
    save_file(tensors, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="CAUSAL_LM",
               base_model_name_or_path=str(base)).save_pretrained(str(root))


def _max_diff(first: Path, second: Path) -> float:
    """max |a - b| over every tensor of two model dirs (read one tensor at a time)."""
    from safetensors import safe_open

    def where(root: Path) -> dict[str, Path]:
        index = root / "model.safetensors.index.json"
        if not index.is_file():  # one shard (a small model): no index
            with safe_open(str(root / "model.safetensors"), "pt") as f:
                return {k: root / "model.safetensors" for k in f.keys()}
        return {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}

    a, b = where(first), where(second)
    if set(a) != set(b):
        raise SystemExit(f"outputs hold different tensors: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for key in a:
        with safe_open(str(a[key]), "pt") as fa, safe_open(str(b[key]), "pt") as fb:
            worst = max(worst, float((fa.get_tensor(key).float() - fb.get_tensor(key).float()).abs().max()))
    return worst


# --- report ------------------------------------------------------------------------------------


def _machine(load: str) -> str:
    import psutil
    import peft
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, peft {peft.__version__}; load average before the runs: {load}")


def _report(path: Path, *, command, machine, base_mb, shards_mb, adapter_mb, ours, peft, diff) -> str:
    largest = max(shards_mb)
    rss_ratio = ours["peak_rss_mb"] / peft["peak_rss_mb"]
    wall_ratio = ours["wall_s"] / peft["wall_s"]
    ok = lambda flag: "yes" if flag else "**NO**"  # noqa: E731
    text = (C.SMOKE_BANNER + "\n\n" if C.SMOKE else "") + f"""# Streaming LoRA merge vs peft `merge_and_unload`

Command: `{command}`

Machine: {machine}

Input: Llama-style base, fp16, {base_mb:.0f} MB in {len(shards_mb)} shards (largest {largest:.0f} MB) + index;
LoRA r=16 on {", ".join(TARGETS)} ({adapter_mb:.0f} MB, fp32). Each merge ran in a fresh subprocess.

| | peak RSS (VmHWM) | peak RSS (psutil, 20 ms) | wall time (process) | of which merge work |
|---|---|---|---|---|
| ours (`python -m pipeline merge`) | {ours['peak_rss_mb']:.0f} MB | {ours['polled_rss_mb']:.0f} MB | {ours['wall_s']:.1f} s | {ours['work_s']:.1f} s |
| peft (`merge_and_unload` + `save_pretrained`) | {peft['peak_rss_mb']:.0f} MB | {peft['polled_rss_mb']:.0f} MB | {peft['wall_s']:.1f} s | {peft['work_s']:.1f} s |

| goal | result | met |
|---|---|---|
| peak RSS <= 0.3 x peft | {rss_ratio:.2f} x | {ok(rss_ratio <= 0.3)} |
| peak RSS <= largest shard + 300 MB ({largest + 300:.0f} MB) | {ours['peak_rss_mb']:.0f} MB | {ok(ours['peak_rss_mb'] <= largest + 300)} |
| wall time <= 1.0 x peft | {wall_ratio:.2f} x | {ok(wall_ratio <= 1.0)} |

Outputs agree: max |ours - peft| over all tensors = {diff:.3g} (fp16; peft adds the delta in
fp16, ours sums in fp32 and rounds once, so they may differ by one fp16 ulp).

Why ours is small: no model is built; each base tensor is read through its own `safe_open`
handle (so its mapped pages are released with it), merged in fp32 and streamed into the
output shard by a header-first safetensors writer. The process holds the runtime (about
220 MB for Python + torch), the adapter, and a few copies of one tensor (the largest here
is the {32000 * 2048 * 2 / 1e6:.0f} MB embedding); peft holds the whole model.

Timings are from a shared 2-core machine (see the load average above); the memory
figures do not depend on load.
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the ~6 GB of scratch goes")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16: ~1.9 GB)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "merge.md")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "BASE", "ADAPTER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--generate", metavar="DIR", help=argparse.SUPPRESS)
    C.add_smoke(parser)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    if args.generate:
        config = _llama_config(args.layers, smoke=args.smoke)
        shards = _write_base(Path(args.generate) / "base", config)
        _write_adapter(Path(args.generate) / "adapter", config, Path(args.generate) / "base")
        print(json.dumps(shards))
        return

    command = C.command_line(__file__)
    C.smoke(args, out="out", layers=2)
    scratch = Path(tempfile.mkdtemp(prefix="bench_merge_", dir=args.workdir))
    try:
        started = time.perf_counter()
        generated = subprocess.run([sys.executable, __file__, "--generate", str(scratch), "--layers", str(args.layers),
                                    *(["--smoke"] if args.smoke else [])],
                                   capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if generated.returncode != 0:
            raise SystemExit(f"generating the inputs failed:\n{generated.stderr[-3000:]}")
        shards = json.loads(generated.stdout.strip().splitlines()[-1])
        print(f"generated {sum(shards) / 1e6:.0f} MB base in {time.perf_counter() - started:.0f} s", flush=True)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        ours = _measure("ours", scratch / "base", scratch / "adapter", scratch / "ours")
        print("ours", ours, flush=True)
        peft = _measure("peft", scratch / "base", scratch / "adapter", scratch / "peft")
        print("peft", peft, flush=True)
        diff = _max_diff(scratch / "ours", scratch / "peft")
        machine = _machine(load)
        print(_report(args.out, command=command, machine=machine, base_mb=sum(shards) / 1e6,
                      shards_mb=[s / 1e6 for s in shards],
                      adapter_mb=(scratch / "adapter" / "adapter_model.safetensors").stat().st_size / 1e6,
                      ours=ours, peft=peft, diff=diff))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
