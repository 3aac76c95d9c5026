# LoRA / EMA supervised fine-tuning as a cached, restartable DAG.
#
#   snakemake --cores all                   # the whole pipeline (embedded default on CPU)
#   snakemake --profile slurm               # the same DAG on a SLURM cluster
#   snakemake results/<run>/stages/chunk02 -f   # rerun one stage
#
# This file is a table of contents: the rules live in workflow/rules/, the code
# in the `pipeline` package, the settings in config/.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/export.smk"


# Seconds of work on small JSON files: run them where snakemake runs, not as cluster jobs.
localrules:
    all,
    plan,
    pilot_gate,
    summarize,
    export_best,


rule all:
    input:
        # Every stage is a target: a deleted stage dir is retrained (with what follows),
        # not silently skipped because the exports downstream of it still exist.
        expand(f"{R}/stages/{{stage}}", stage=STAGES),
        expand(f"{R}/eval/{{stage}}.json", stage=STAGES),
        f"{R}/eval/summary.csv",
        f"{R}/eval/loss.png",
        f"{R}/eval/val_loss.png",
        # pages `snakemake --report` shows inline: the eval table, the plan, the pilot gate
        f"{R}/report/summary.html",
        f"{R}/report/plan.html",
        f"{R}/report/pilot_gate.html",
        # the exported adapters (PeftModel.from_pretrained): a deleted one is made again
        f"{R}/export/adapter_final",
        [f"{R}/export/adapter_ema"] if HAS_EMA else [],
        f"{R}/export/verification.json",
        f"{R}/export/smoke_test.json",
        # the run's best raw / EMA weights by validation loss (tracked only with a validation set)
        best_exports(),
    default_target: True
