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
include: "workflow/rules/sweep.smk"


# Seconds of work on small JSON files: run them where snakemake runs, not as cluster jobs
# (a sweep's rules, which exist only with a sweep, say so themselves: `localrule: True`).
localrules:
    all,
    plan,
    pilot_gate,
    summarize,
    export_best,
    label_view,


rule all:
    input:
        # Every stage is a target: a deleted stage dir is retrained (with what follows),
        # not silently skipped because the exports downstream of it still exist. Per variant:
        # its stages and their evaluations, its summary and report pages, its exports
        # (run_targets in workflow/rules/common.smk); a sweep adds the comparison.
        lambda wc: [target for vrun in VARIANTS for target in run_targets(vrun)],
        f"{R}/report/labels.html",  # the label page: what the run trains on, shared by a sweep's variants
        [f"{R}/sweep/comparison.csv", f"{R}/sweep/loss.png", f"{R}/sweep/comparison.html",
         f"{R}/sweep/best.json"] if SWEEP else [],
    default_target: True
