# Evaluation of the base and of every stage (raw + each EMA rate), and the summary:
# the table, the plots and the pages of `snakemake --report report.html`.


report: "../report/workflow.rst"


rule evaluate_base:
    # The base model, once for all variants of a sweep (with the sweep's base config).
    input:
        config=f"{R}/train_config.yaml",
        val=f"{R}/data/val.safetensors" if data_file("val") else [],
        test=data_file("test") or [],
    output:
        f"{R}/eval/base.json",
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/evaluate_stage/{RUN}/base.log",
    params:
        test=lambda wc, input: optional("--test", input.get("test")),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
    resources:
        **job_resources("evaluate"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline evaluate --config {input.config} --stage base {params.test} {params.max_test} "
        "--max-new-tokens {params.max_new_tokens} --out {output}"


rule evaluate_stage:
    input:
        stage=f"{V}/stages/{{stage}}",
        val=f"{R}/data/val.safetensors" if data_file("val") else [],
        test=data_file("test") or [],
    output:
        f"{V}/eval/{{stage}}.json",
    conda:
        "../envs/sft.yaml"
    log:
        "logs/evaluate_stage/{vrun}/{stage}.log",
    params:
        test=lambda wc, input: optional("--test", input.get("test")),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
    resources:
        **job_resources("evaluate"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline evaluate --checkpoint {input.stage}/checkpoint --stage {wildcards.stage} "
        "{params.test} {params.max_test} --max-new-tokens {params.max_new_tokens} --out {output}"


SUB = "{vrun}" if SWEEP else None  # a sweep's report pages, one subcategory per variant


rule summarize:
    input:
        evals=[f"{R}/eval/base.json"] + [f"{V}/eval/{s}.json" for s in STAGES],
        stages=[f"{V}/stages/{s}" for s in STAGES],
        smoke=f"{V}/export/smoke_test.json",
        plan=f"{V}/plan.json",
        gate=f"{V}/pilot_report.json",
        verification=f"{V}/export/verification.json",
        # the exports the overview lists (written before it is)
        exports=[f"{V}/export/adapter_final"] + ([f"{V}/export/adapter_ema"] if HAS_EMA else []) + best_exports(V),
    output:
        # Categories of `snakemake --report report.html`: Overview, Training, Evaluation, Run. The HTML
        # pages show the table, plan and gate inline (the report only offers CSV/JSON as downloads).
        # overview.html is also the report's landing page (workflow/report/workflow.rst inserts it).
        overview=report(f"{V}/report/overview.html", caption="../report/overview_html.rst", category="Overview",
                         subcategory=SUB),
        loss=report(f"{V}/eval/loss.png", caption="../report/loss.rst", category="Training", subcategory=SUB),
        val=report(f"{V}/eval/val_loss.png", caption="../report/val_loss.rst", category="Evaluation",
                   subcategory=SUB),
        html=report(f"{V}/report/summary.html", caption="../report/summary_html.rst", category="Evaluation",
                    subcategory=SUB),
        samples=report(f"{V}/report/samples.html", caption="../report/samples_html.rst", category="Evaluation",
                       subcategory=SUB),
        csv=report(f"{V}/eval/summary.csv", caption="../report/summary.rst", category="Evaluation", subcategory=SUB),
        plan=report(f"{V}/report/plan.html", caption="../report/plan_html.rst", category="Run", subcategory=SUB),
        gate=report(f"{V}/report/pilot_gate.html", caption="../report/pilot_gate_html.rst", category="Run",
                    subcategory=SUB),
    conda:
        "../envs/sft.yaml"
    log:
        "logs/summarize/{vrun}.log",
    params:
        run="{vrun}",
        # each stage job's wall clock (Snakemake's benchmark files: not declared outputs, read if there)
        benchmarks="benchmarks/train_stage/{vrun}",
        export=lambda wc, input: os.path.dirname(input.verification),
    shell:
        launch() + "python -m pipeline summarize --eval {input.evals} --metrics {input.stages} --smoke {input.smoke} "
        "--plan {input.plan} --gate {input.gate} --run {params.run} --verification {input.verification} "
        "--export-dir {params.export} --benchmarks {params.benchmarks} "
        "--out-samples-html {output.samples} --out-overview-html {output.overview} "
        "--out-csv {output.csv} --out-loss-plot {output.loss} --out-eval-plot {output.val} "
        "--out-summary-html {output.html} --out-plan-html {output.plan} --out-gate-html {output.gate}"
