"""Fixtures for the dataset tests: the demo tokenizer on disk and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The demo char-level tokenizer (with chat template), saved like a real model dir."""
    from pipeline.demo.text import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _run_pipeline(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=timeout,
    )


@pytest.fixture(scope="session")
def run_pipeline():
    """`run_pipeline("validate", "--train", ...)` -> CompletedProcess of `python -m pipeline ...`."""
    return _run_pipeline
