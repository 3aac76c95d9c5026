# Evaluation of the base and of every stage (raw + each EMA rate), and the summary:
# the table, the plots and the pages of `snakemake --report report.html`.


report: "../report/workflow.rst"


rule evaluate_base:
    # The base model, once for all variants of a sweep (with the sweep's base config).
    input:
        config=R.train_config,
        val=R.cache("val") if data_file("val") else [],
        test=data_file("test") or [],
    output:
        R.evaluation(layout.BASE_EVAL),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("evaluate_stage", f"{RUN}/{layout.BASE_EVAL}"),
    params:
        test=lambda wc, input: optional("--test", input.get("test")),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        fields=field_flags(),
    resources:
        **job_resources("evaluate"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline evaluate --config {input.config} --stage base {params.test} {params.max_test} "
        "--max-new-tokens {params.max_new_tokens} {params.fields} --out {output}"


rule evaluate_stage:
    input:
        stage=V.stage("{stage}"),
        val=R.cache("val") if data_file("val") else [],
        test=data_file("test") or [],
    output:
        V.evaluation("{stage}"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("evaluate_stage", "{vrun}/{stage}"),
    params:
        checkpoint=lambda wc, input: stage_checkpoint(input.stage),
        test=lambda wc, input: optional("--test", input.get("test")),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        fields=field_flags(),
    resources:
        **job_resources("evaluate"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline evaluate --checkpoint {params.checkpoint} --stage {wildcards.stage} "
        "{params.test} {params.max_test} --max-new-tokens {params.max_new_tokens} {params.fields} --out {output}"


SUB = "{vrun}" if SWEEP else None  # a sweep's report pages, one subcategory per variant


rule summarize:
    input:
        evals=run_evaluations(V),
        stages=[V.stage(s) for s in STAGES],
        smoke=V.smoke_test,
        plan=V.plan,
        gate=V.pilot_report,
        verification=V.verification,
        # the exports the overview lists (written before it is)
        exports=RUN_CONFIG.adapter_exports(V),
    output:
        # Categories of `snakemake --report report.html`: Overview, Training, Evaluation, Run. The HTML
        # pages show the table, plan and gate inline (the report only offers CSV/JSON as downloads).
        # overview.html is also the report's landing page (workflow/report/workflow.rst inserts it).
        overview=report(V.overview_html, caption="../report/overview_html.rst", category="Overview",
                         subcategory=SUB),
        loss=report(V.loss_plot, caption="../report/loss.rst", category="Training", subcategory=SUB),
        val=report(V.val_loss_plot, caption="../report/val_loss.rst", category="Evaluation",
                   subcategory=SUB),
        html=report(V.summary_html, caption="../report/summary_html.rst", category="Evaluation",
                    subcategory=SUB),
        samples=report(V.samples_html, caption="../report/samples_html.rst", category="Evaluation",
                       subcategory=SUB),
        csv=report(V.summary_csv, caption="../report/summary.rst", category="Evaluation", subcategory=SUB),
        plan=report(V.plan_html, caption="../report/plan_html.rst", category="Run", subcategory=SUB),
        gate=report(V.pilot_gate_html, caption="../report/pilot_gate_html.rst", category="Run",
                    subcategory=SUB),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("summarize", "{vrun}"),
    params:
        run="{vrun}",
        # each stage job's wall clock (Snakemake's benchmark files: not declared outputs, read if there)
        benchmarks=str(layout.benchmarks_of("train_stage", "{vrun}")),
        export=lambda wc, input: os.path.dirname(input.verification),
    shell:
        launch() + "python -m pipeline summarize --eval {input.evals} --metrics {input.stages} --smoke {input.smoke} "
        "--plan {input.plan} --gate {input.gate} --run {params.run} --verification {input.verification} "
        "--export-dir {params.export} --benchmarks {params.benchmarks} "
        "--out-samples-html {output.samples} --out-overview-html {output.overview} "
        "--out-csv {output.csv} --out-loss-plot {output.loss} --out-eval-plot {output.val} "
        "--out-summary-html {output.html} --out-plan-html {output.plan} --out-gate-html {output.gate}"
