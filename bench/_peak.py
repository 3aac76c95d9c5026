"""Run one training stage with a memory probe around every update, as `python -m pipeline train` runs it.

    python bench/_peak.py RESULT.json --plan ... --config ... --stage ... --scratch ... --out ...

Imports the trainer from PYTHONPATH (so one probe measures any version of it: bench_memory.py points
PYTHONPATH at a `git archive` of an older commit for the "before" figures). A thread samples the
process RSS every millisecond while an update runs; RESULT.json gets, per update, the RSS at its start
and the highest RSS seen during it, and the process's ru_maxrss at the end. The probe changes nothing
the trainer computes (it wraps `Updater.__call__`, which every version since issue 12 has).
"""

from __future__ import annotations

import json
import resource
import sys
import threading
import time
from pathlib import Path


def _rss() -> int:
    # /proc/self/statm: pages; field 2 is the resident set.
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def probe_updates() -> list[dict]:
    """Wrap the trainer's `Updater.__call__` with the RSS probe; returns the list each update appends
    {"rss_start", "rss_peak"} to (bytes)."""
    from pipeline.train import update

    updates: list[dict] = []
    call = update.Updater.__call__

    def probed(self, state, **kwargs):
        start, peak, done = _rss(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _rss())
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            return call(self, state, **kwargs)
        finally:
            done.set()
            sampler.join()
            updates.append({"rss_start": start, "rss_peak": max(peak[0], _rss())})

    update.Updater.__call__ = probed
    return updates


def main() -> int:
    result, argv = Path(sys.argv[1]), sys.argv[2:]
    from pipeline import cli

    updates = probe_updates()
    rc = cli.main(["train", *argv])
    result.write_text(json.dumps({"updates": updates,
                                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    return rc


if __name__ == "__main__":
    sys.exit(main())
