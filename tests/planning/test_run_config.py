"""`pipeline.planning.run_config.load`: the workflow config as the Snakefile loads it, in process.

The same call `workflow/rules/common.smk` makes: checks, defaults, stages, variants, the trainer
overrides and their resolution, the cross-checks and the config's id. The workflow tests run it
through snakemake; these show what it derives without a dry run.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from pathlib import Path

import pytest
import yaml

from pipeline import config as train_config
from pipeline.errors import UserError
from pipeline.planning import run_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = yaml.safe_load((REPO / "config/config.yaml").read_text())


@pytest.fixture
def load(tmp_path, monkeypatch):
    """`load(config=None, **kw)`: run_config.load of (a copy of) the shipped config, in an empty workflow dir."""
    monkeypatch.chdir(tmp_path)

    def _load(config: dict | None = None, **kw):
        return run_config.load(copy.deepcopy(config or SHIPPED), train_config_dir=REPO / "config/train", **kw)
    return _load


def test_the_shipped_config_is_one_run_whose_id_is_the_sha256_of_the_text_the_plan_writes(load):
    rc = load()
    assert list(rc.variants) == ["demo"] and not rc.sweep and rc.base is rc.variants["demo"]
    assert [s.name for s in rc.stages] == ["pilot", "chunk01", "chunk02", "tail"]
    variant = rc.variants["demo"]
    assert variant.text == train_config.to_yaml(variant.cfg)
    assert variant.config_id == hashlib.sha256(variant.text.encode()).hexdigest()
    # The lr of config/config.yaml's train.overrides, and the paths the workflow owns
    assert variant.cfg.optim.lr == 2e-3 and "lr: 0.002" in variant.text
    assert variant.cfg.model.path == "results/embedded/model" and variant.cfg.model.tokenizer == "results/demo/tokenizer"
    assert variant.cfg.tokens.train_cache == "results/demo/data/train/train/train.safetensors"  # one file: a mix of one
    assert rc.data.split_path("val") == "results/embedded/data/val.jsonl" and rc.has_ema and rc.world is None
    assert rc.config["slurm"]["train"] == {"partition": None, "account": None, "extra": None}  # schema defaults


def test_the_sweep_example_gives_four_variants_and_a_base_without_their_overrides(load):
    config = {**SHIPPED, **yaml.safe_load((REPO / "config/sweep.yaml").read_text())}
    rc = load(config)
    assert rc.sweep and sorted(rc.variants) == sorted(f"demo/variants/lr-{lr}_r-{r}" for lr in ("0.001", "0.002")
                                                       for r in (8, 16))
    lrs = {v.name: (v.cfg.optim.lr, v.cfg.lora.r) for v in rc.variants.values()}
    assert lrs["lr-0.001_r-16"] == (1e-3, 16) and rc.base.cfg.optim.lr == 2e-3 and rc.base.name == ""
    assert len({v.config_id for v in rc.variants.values()}) == 4
    assert rc.base.config_id == rc.variants["demo/variants/lr-0.002_r-16"].config_id  # the base: lr 2e-3, r 16


def test_a_defaulted_key_and_a_missing_one_are_the_same_config(load):
    trimmed = copy.deepcopy(SHIPPED)
    del trimmed["evaluate"], trimmed["tracker"]
    assert load(trimmed).variants["demo"].config_id == load().variants["demo"].config_id


def test_every_problem_of_the_workflow_config_at_once_naming_where_it_came_from(load):
    config = copy.deepcopy(SHIPPED)
    config["schedule"]["total_updates"] = "many"
    config["trian"] = {}
    with pytest.raises(UserError) as err:
        load(config, command_line={"schedule": {"total_updates": "many"}}, configfiles=["config/config.yaml"])
    text = str(err.value)
    assert text.startswith("config: problems in the workflow config (config/config.yaml, --config schedule):")
    assert "schedule.total_updates: 'many' is not of type 'integer' (from --config)" in text and "trian: unknown" in text


def test_paths_and_the_chat_template_are_checked_after_the_schema(load):
    config = copy.deepcopy(SHIPPED)
    config["data"]["val"] = "no/such/val.jsonl"
    config["data"]["chat_template"] = "no-such-template"
    with pytest.raises(UserError) as err:
        load(config)
    assert "data.val: no/such/val.jsonl does not exist" in str(err.value)
    assert "data.chat_template: 'no-such-template' is neither a built-in template" in str(err.value)


def test_the_two_configs_disagreeing_names_both_keys_and_the_variant(load):
    config = copy.deepcopy(SHIPPED)
    config["export"]["ema_rate"] = 0.5
    with pytest.raises(UserError, match=r"export.ema_rate=0.5 is not one of the trainer's ema.rates=\[0.9, 0.98\]"):
        load(config)
    config = {**copy.deepcopy(SHIPPED), "sweep": {"variants": {"noema": ["ema.rates=[]"]}}}
    with pytest.raises(UserError, match=r"^config \(sweep variant noema\): the workflow config .* disagree"):
        load(config)


def test_more_processes_than_gpus_per_node_is_a_config_problem(load):
    config = copy.deepcopy(SHIPPED)
    config["train"].update(gpus_per_node=2, nproc=4)
    with pytest.raises(UserError, match=r"^config \(.*\): train.nproc=4 processes per node but train.gpus_per_node=2"):
        load(config)


def test_a_base_model_dir_holding_the_outputs_is_refused(load, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # the workflow dir itself as the model: results/ is inside it
    with pytest.raises(UserError, match="config: output path results/demo is inside the base model dir ."):
        load({**SHIPPED, "model": "."})


def test_the_guard_runs_in_the_main_process_only(load, tmp_path):
    trained = tmp_path / "results/demo"
    (trained / "stages/pilot").mkdir(parents=True)
    (trained / "train_config.yaml").write_text(load().variants["demo"].text.replace("lr: 0.002", "lr: 0.001"))
    with pytest.raises(UserError, match=r"optim.lr: 0.001 -> 0.002"):
        load()
    assert load(main_process=False).changed == []  # a cluster job: the main process decided
    archived = load({**SHIPPED, "on_config_change": "archive"})
    assert [run.vrun for run, _ in archived.changed] == ["demo"]
    assert "optim.lr: 0.001 -> 0.002" in archived.archive_notes()[0]


def test_loading_the_config_imports_no_torch():
    import subprocess

    code = ("import sys, yaml; from pipeline.planning import run_config; "
            "run_config.load(yaml.safe_load(open('config/config.yaml')), main_process=False); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_the_plan_is_keyed_on_what_it_depends_on_and_handed_the_text_it_writes(load):
    import shlex

    rc = load()
    variant = rc.variants["demo"]
    assert rc.plan_keys(variant) == {"config_id": variant.config_id, "world": "", "max_length": 128,
                                     "schedule": "pilot:0-15 + chunk01:15-157 + chunk02:157-299 + tail:299-300"}
    assert set(rc.plan_keys(variant, base=True)) == {"config_id", "schedule"}  # a sweep's base trains nothing
    args = shlex.split(rc.plan_args(variant))
    assert args[args.index("--resolved-config") + 1] == variant.text  # as the shell hands it over
    assert args[-4:] == ["--export-weights", "ema", "--export-ema-rate", "0.98"]
    assert shlex.split(rc.plan_args(variant, base=True))[-2:] == ["--export-weights", "raw"]


def test_a_stage_reads_the_one_before_it_and_after_the_pilot_its_gate(load):
    rc = load()
    tree = rc.tree
    assert rc.stage_inputs(tree, "pilot") == {"plan": tree.plan, "config": tree.train_config}
    assert rc.stage_inputs(tree, "chunk02") == {"plan": tree.plan, "config": tree.train_config,
                                                "init": tree.stage("chunk01"), "gate": tree.pilot_report}


def test_what_a_finished_run_exports_follows_ema_and_the_validation_set(load):
    rc = load()
    names = lambda paths: [p.name for p in paths]
    assert names(rc.adapter_exports(rc.tree)) == ["adapter_final", "adapter_ema", "adapter_best", "adapter_best_ema"]
    assert rc.merge_source(rc.tree).name == "adapter_ema"
    plain = copy.deepcopy(SHIPPED)
    plain["data"]["val"] = None
    plain["export"].update(weights="raw", ema_rate=None)
    plain["train"]["overrides"] = [o for o in plain["train"]["overrides"] if not o.startswith(("ema.", "validation."))]
    plain["train"]["overrides"].append("ema.rates=[]")
    rc = load(plain)
    assert names(rc.adapter_exports(rc.tree)) == ["adapter_final"] and rc.merge_source(rc.tree).name == "adapter_final"
