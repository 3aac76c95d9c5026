"""`python -m snakemake`, with the SLURM executor plugin's status polls at most POLL_CAP_S apart.

The plugin (2.8.0) polls squeue every `slurm-init-seconds-before-status-checks` while jobs finish,
and after each poll in which none did it waits 10 s longer (1, 11, 21, ... s, up to 180 s). On a
real cluster that spares slurmctld; here, with jobs of 10-40 s in a chain, it left 5-30 s between a
job's end and the submission of the next: ~140 s of idle polling in the 2-node whole-DAG run of
~370 s. This runner caps the wait, nothing else: the same snakemake, profile, plugin and jobs.
SLURM_TEST_POLL_CAP_S sets the cap (default 2 s); 0 leaves the plugin's own backoff.
"""

from __future__ import annotations

import os
import sys

from snakemake_executor_plugin_slurm import Executor

POLL_CAP_S = float(os.environ.get("SLURM_TEST_POLL_CAP_S", "2"))

_plugin_wait = getattr(Executor, "next_seconds_between_status_checks", None)  # a property of the plugins' base class
if POLL_CAP_S > 0 and isinstance(_plugin_wait, property) and _plugin_wait.fset is not None:

    def _capped(self, seconds):
        _plugin_wait.fset(self, None if seconds is None else min(seconds, POLL_CAP_S))

    Executor.next_seconds_between_status_checks = property(_plugin_wait.fget, _capped)
elif POLL_CAP_S > 0:  # another plugin version: its own polling, slower but the same run
    print("snakemake_poll.py: this SLURM plugin has no settable next_seconds_between_status_checks; "
          "its polls are not capped", file=sys.stderr)

if __name__ == "__main__":
    from snakemake.cli import main

    main()
