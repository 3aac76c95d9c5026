"""Where a training stage's host (Python) time goes, for GPU sessions: a stack sampler loaded into every
Python process started with this folder on PYTHONPATH (Python imports `sitecustomize` at start-up).

    PYTHONPATH=bench/stack_sampler:$PYTHONPATH STACK_SAMPLES=/tmp/samples python bench/bench_gpu.py ...

In a trainer process (one whose argv has `--plan`), a thread reads the main thread's stack every 4 ms and
keeps the samples taken inside an update (a frame of pipeline/train/update.py). At exit it writes
`$STACK_SAMPLES/samples_<pid>.txt`: each frame's share of the samples (inclusive), the leaf frames' shares,
and the CUDA syncs PyTorch's sync-debug mode reported while sampling, by stack. A frame holding many
samples is where the host is, busy or blocked (a blocking CUDA call shows as the Python line that made it);
the sampler adds its own overhead (about a fifth fewer tokens/s on the H200 run of 2026-11-28).

STACK_SAMPLER_SDP=no-cudnn turns off PyTorch's cuDNN attention backend in the trainer (the arm that tells
whether scaled_dot_product_attention's host time is cuDNN's per-shape graph building).
Diagnostics only: nothing in pipeline/ imports this.
"""
import collections
import os
import sys
import threading
import time
import traceback
import warnings

OUT = os.environ.get("STACK_SAMPLES")
INTERVAL_S = 0.004
STACK_DEPTH = 40


def _where(frame: tuple) -> str:
    path, line, name = frame
    return f"{path.split('site-packages/')[-1]}:{line} {name}"


class _Sampler:
    def __init__(self, out: str) -> None:
        self.out, self.main = out, threading.main_thread().ident
        self.samples: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.taken, self.armed = 0, False
        self._show = warnings.showwarning

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        """warnings.showwarning while sampling: a sync-debug warning is counted by its stack, others shown."""
        if "synchroniz" not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-3][-14:]
        self.syncs["\n".join(f"  {f.filename}:{f.lineno} {f.name}" for f in stack)] += 1

    def arm(self) -> None:
        """On the first sample inside an update (CUDA is up by then): sync reporting, the SDP switch."""
        self.armed = True
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return
        if os.environ.get("STACK_SAMPLER_SDP") == "no-cudnn":
            torch.backends.cuda.enable_cudnn_sdp(False)
        warnings.showwarning = self.show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def run(self) -> None:
        time.sleep(0.5)  # sys.argv is set by now
        if not any("--plan" in a for a in sys.argv):
            return
        while True:
            time.sleep(INTERVAL_S)
            frame, stack = sys._current_frames().get(self.main), []
            while frame is not None and len(stack) < 200:
                stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
                frame = frame.f_back
            if not any(path.endswith("train/update.py") for path, _, _ in stack):
                continue
            if not self.armed:
                self.arm()
            self.taken += 1
            self.samples[tuple(stack[:STACK_DEPTH])] += 1

    def write(self) -> None:
        if not self.taken:
            return
        inclusive, leaf = collections.Counter(), collections.Counter()
        for stack, n in self.samples.items():
            leaf[stack[0]] += n
            for frame in set(stack):
                inclusive[frame] += n
        lines = [f"{self.taken} samples inside updates, every {INTERVAL_S * 1e3:.0f} ms", "== inclusive, top 70"]
        lines += [f"{100 * n / self.taken:5.1f}% {_where(f)}" for f, n in inclusive.most_common(70)]
        lines += ["== leaf frames, top 40"]
        lines += [f"{100 * n / self.taken:5.1f}% {_where(f)}" for f, n in leaf.most_common(40)]
        lines += [f"== CUDA syncs reported: {sum(self.syncs.values())}"]
        for stack, n in self.syncs.most_common(30):
            lines += [f"{n} x", stack]
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"samples_{os.getpid()}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if OUT:
    import atexit

    _sampler = _Sampler(OUT)
    atexit.register(_sampler.write)
    threading.Thread(target=_sampler.run, name="stack-sampler", daemon=True).start()
