"""The SLURM tests' snakemake runner only caps the plugin's wait between status polls."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _runner(monkeypatch, cap: str):
    monkeypatch.setenv("SLURM_TEST_POLL_CAP_S", cap)
    plugin = pytest.importorskip("snakemake_executor_plugin_slurm")
    monkeypatch.setattr(plugin.Executor, "next_seconds_between_status_checks",
                        plugin.Executor.next_seconds_between_status_checks)  # restored after the test
    spec = importlib.util.spec_from_file_location("snakemake_poll", Path(__file__).with_name("snakemake_poll.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return object.__new__(plugin.Executor)  # no workflow: only the wait's attribute is used


def test_the_wait_after_idle_polls_is_capped(monkeypatch):
    executor = _runner(monkeypatch, "2")
    for plugin_says, waits in ((1, 1), (11, 2), (180, 2), (0.5, 0.5)):
        executor.next_seconds_between_status_checks = plugin_says
        assert executor.next_seconds_between_status_checks == waits


def test_cap_zero_leaves_the_plugins_backoff(monkeypatch):
    executor = _runner(monkeypatch, "0")
    executor.next_seconds_between_status_checks = 21
    assert executor.next_seconds_between_status_checks == 21
