# A sweep (config `sweep`): the base config its base evaluation uses, the pruning at chosen stage
# ends, and the comparison of every variant. Without a sweep none of these rules exists.


if SWEEP:

    # Small JSON work, where snakemake runs (with the Snakefile's own localrules).
    localrules:
        plan_base,
        sweep_prune,
        sweep_compare,

    rule plan_base:
        # The trainer config without any variant's overrides: what the base model is evaluated with,
        # once for the whole sweep (a new variant does not evaluate the base again).
        input:
            model=model_inputs(),
        output:
            plan=R.plan,
            config=R.train_config,
        log:
            layout.log_file("plan", RUN),
        params:
            **plan_params(lambda wc: RUN_CONFIG.base, base=True),
        shell:
            launch() + "python -m pipeline plan {params.args} --out-plan {output.plan} --out-config {output.config}"

    checkpoint sweep_prune:
        # At a prune point only the `keep` best variants (lowest validation loss at that stage's end)
        # go on. A checkpoint: which later stages exist as targets is known only once it ran.
        # Raising sweep.prune.keep re-runs it (params) and brings the newly kept variants back.
        input:
            evals=lambda wc: [layout.RunTree.of(v).evaluation(wc.stage) for v in VARIANTS],
        output:
            R.prune_decision("{stage}"),
        log:
            layout.log_file("sweep_prune", f"{RUN}/{{stage}}"),
        params:
            keep=RUN_CONFIG.prune_keep,
            variants=lambda wc, input: " ".join(f"{variant_name(v)}={e}" for v, e in zip(VARIANTS, input.evals)),
        shell:
            launch() + "python -m pipeline sweep-prune --stage {wildcards.stage} --keep {params.keep} "
            "--variant {params.variants} --out {output}"

    rule sweep_compare:
        input:
            unpack(compare_inputs),
        output:
            csv=report(R.comparison_csv, caption="../report/sweep_csv.rst", category="Sweep"),
            plot=report(R.comparison_plot, caption="../report/sweep_loss.rst", category="Sweep"),
            html=report(R.comparison_html, caption="../report/sweep_html.rst", category="Sweep"),
            best=R.best_file,
        log:
            layout.log_file("sweep_compare", RUN),
        params:
            variants=lambda wc: " ".join(f"{variant_name(v)}={layout.RunTree.of(v)}" for v in VARIANTS),
            overrides=lambda wc: " ".join(f"'{variant_name(v)}={json.dumps(VARIANTS[v][1])}'" for v in VARIANTS),
            prune=lambda wc, input: " ".join(input.get("prune", [])) or "none",
            stages=" ".join(STAGES),
        shell:
            launch() + "python -m pipeline sweep-compare --run {R} --variant {params.variants} "
            "--overrides {params.overrides} --stages {params.stages} --prune {params.prune} --out-csv {output.csv} "
            "--out-plot {output.plot} --out-html {output.html} --out-best {output.best}"
