"""Sweep variants from the config, and the decisions made on them (pipeline/planning/sweep.py:
variants and prune decisions); the sweep through Snakemake: tests/workflow/test_sweep.py."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import UserError
from pipeline.planning import sweep
from pipeline.planning.sweep import prune_points, variants

STAGES = ["pilot", "chunk01", "chunk02", "tail"]


def test_no_sweep_means_no_variants():
    assert variants({}) == {} and variants(None) == {}
    assert prune_points({}, STAGES) == ([], None)


def test_grid_names_come_from_values_and_stay_when_values_are_added():
    two = variants({"grid": {"optim.lr": [1e-3, 2e-3], "lora.r": [8, 16]}})
    assert two == {
        "lr-0.001_r-8": ["optim.lr=0.001", "lora.r=8"],
        "lr-0.001_r-16": ["optim.lr=0.001", "lora.r=16"],
        "lr-0.002_r-8": ["optim.lr=0.002", "lora.r=8"],
        "lr-0.002_r-16": ["optim.lr=0.002", "lora.r=16"],
    }
    three = variants({"grid": {"optim.lr": [1e-3, 2e-3, 5e-4], "lora.r": [8, 16]}})
    assert set(two) < set(three) and all(three[n] == two[n] for n in two)


def test_clashing_last_components_use_the_whole_key_and_lists_and_bools_are_hydra_values():
    out = variants({"grid": {"optim.warmup_fraction": [0.1], "ema.warmup_fraction": [0.0]},
                    "variants": {"no-ema": ["ema.rates=[]"]}})
    assert out == {"optim.warmup_fraction-0.1_ema.warmup_fraction-0.0":
                   ["optim.warmup_fraction=0.1", "ema.warmup_fraction=0.0"],
                   "no-ema": ["ema.rates=[]"]}
    grid = variants({"grid": {"ema.rates": [[0.9, 0.99]], "model.gradient_checkpointing": [True]}})
    assert grid == {"rates-0.9-0.99_gradient_checkpointing-true":
                    ["ema.rates=[0.9,0.99]", "model.gradient_checkpointing=true"]}


def test_bad_names_clashes_and_shared_keys_are_named():
    with pytest.raises(UserError) as err:
        variants({"grid": {"optim.lr": [1e-3]},
                  "variants": {"lr-0.001": ["optim.lr=3e-3"], "a/b": ["lora.r=4"], "own": ["model.path=/x"]}})
    text = str(err.value)
    assert "'lr-0.001' is also the name of a grid variant" in text
    assert "'a/b' is not a usable name" in text
    assert "sweep variant 'own': ['model.path=/x'] would change what all variants share" in text


def test_prune_points_are_stages_a_run_goes_on_from():
    assert prune_points({"prune": {"at": ["chunk01", "pilot"], "keep": 2}}, STAGES) == (["pilot", "chunk01"], 2)
    with pytest.raises(UserError, match=r"\['tail', 'chunk09'\] are not stages"):
        prune_points({"prune": {"at": ["tail", "chunk09"], "keep": 2}}, STAGES)


def _eval(path, **losses):
    path.write_text(json.dumps({"stage": "pilot", "rows": [{"weights": w, "loss": v} for w, v in losses.items()]}))
    return path


def test_prune_keeps_the_k_lowest_by_their_best_weight_set_and_says_why_the_rest_stop(tmp_path):
    evals = {"a": _eval(tmp_path / "a.json", raw=2.0, ema_0_9=1.5),  # scored by its EMA: 1.5
             "b": _eval(tmp_path / "b.json", raw=1.2, ema_0_9=1.9),
             "c": _eval(tmp_path / "c.json", raw=1.7),
             "d": _eval(tmp_path / "d.json", raw=1.5)}  # ties with a: listed later, ranked later
    decision = sweep.prune("pilot", 2, evals)
    assert decision["ranking"] == ["b", "a", "d", "c"] and decision["kept"] == ["b", "a"]
    assert decision["stopped"]["d"] == ("pruned after pilot: rank 3 of 4 by validation loss (1.5000; the last "
                                        "kept had 1.5000), sweep.prune.keep=2")
    assert set(decision["stopped"]) == {"c", "d"}
    assert sweep.prune("pilot", 4, evals)["stopped"] == {}
