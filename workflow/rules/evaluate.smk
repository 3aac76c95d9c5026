# Evaluation of the base and of every stage (raw + each EMA rate), and the summary:
# the table, the plots and the pages of `snakemake --report report.html`.


report: "../report/workflow.rst"


rule evaluate_base:
    # The base model, once for all variants of a sweep (with the sweep's base config).
    input:
        config=R.train_config,
        val=R.cache("val") if data_file("val") else [],
        test=DATA.held_out_inputs().get("test", []),
    output:
        R.evaluation(layout.BASE_EVAL),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("evaluate_stage", f"{RUN}/{layout.BASE_EVAL}"),
    params:
        test=lambda wc, input, output: DATA.held_out_args(input, ["test"]),
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
        test=DATA.held_out_inputs().get("test", []),
    output:
        V.evaluation("{stage}"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("evaluate_stage", "{vrun}/{stage}"),
    params:
        checkpoint=lambda wc, input: stage_checkpoint(input.stage),
        test=lambda wc, input, output: DATA.held_out_args(input, ["test"]),
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
        # benchmarks (evaluate.benchmarks): their rows go into summary.csv, their table into summary.html
        bench=lambda wc: BENCH.summary_inputs(wc.vrun),
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
        bench=lambda wc, input: optional("--bench-csv", input.bench[0] if input.bench else None),
    shell:
        launch() + "python -m pipeline summarize --eval {input.evals} --metrics {input.stages} --smoke {input.smoke} "
        "--plan {input.plan} --gate {input.gate} --run {params.run} --verification {input.verification} "
        "--export-dir {params.export} --benchmarks {params.benchmarks} "
        "--out-samples-html {output.samples} --out-overview-html {output.overview} "
        "--out-csv {output.csv} --out-loss-plot {output.loss} --out-eval-plot {output.val} "
        "--out-summary-html {output.html} --out-plan-html {output.plan} --out-gate-html {output.gate} {params.bench}"


# --- Standard benchmarks (evaluate.benchmarks): lm-evaluation-harness on the base model and the
# trained weights, one job per (weights, task), offline. pipeline/planning/benchmarks.py says how
# they are keyed: the task's content and the lm-eval version as params, the weights as inputs, and
# inside the job the weights' content, so byte-identical weights are never scored twice.

# Checked when the workflow loaded, with every task's data in the local caches (run_config.load).
BENCH = RUN_CONFIG.benchmarks


rule demo_benchmark:
    # The embedded demo's multiple-choice task, from its held-out split (pipeline/demo/benchmark.py).
    input:
        test=layout.RunTree.of("{demo}").demo_split("test"),
    output:
        task=layout.RunTree.of("{demo}").demo_bench_task(".yaml"),
        docs=layout.RunTree.of("{demo}").demo_bench_task(".jsonl"),
    wildcard_constraints:
        demo="|".join(name for name, kind in EMBEDDED_KINDS.items() if kind == "text"),
    localrule: True
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("demo_benchmark", "{demo}"),
    params:
        data_dir=lambda wc, input: os.path.dirname(input.test),
    shell:
        launch() + "python -m pipeline demo-benchmark --data-dir {params.data_dir}"


rule benchmark_base:
    # The base model with the run's tokenizer (its chat template, rows for tokens it added), once
    # for all variants of a sweep.
    input:
        unpack(lambda wc: BENCH.inputs(wc.task, layout.BENCH_BASE, None, model=model_inputs(), tokenizer=TOKENIZER)),
    output:
        R.benchmark(layout.BENCH_BASE, "{task}"),
    wildcard_constraints:
        task=BENCH.task_pattern(),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("benchmark", f"{RUN}/{layout.BENCH_BASE}/{{task}}"),
    params:
        flags=lambda wc: BENCH.flags(wc.task),
        key=lambda wc: BENCH.key(wc.task),
        # A function of `output`: Snakemake leaves it out of the params it compares (a batch size
        # changes no score; changing it reruns nothing).
        batch=lambda wc, output: BENCH.section["batch_size"],
        cache=R.benchmark_cache,
    resources:
        **job_resources("benchmark"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline benchmark --weights {input.weights} --tokenizer {input.tokenizer} "
        "--name base {params.flags} --batch-size {params.batch} --cache-dir {params.cache} --out {output}"


rule benchmark:
    # A trained set of weights: the merged model, or an adapter on its base.
    input:
        unpack(lambda wc: BENCH.inputs(wc.task, wc.weights, wc.vrun, model=model_inputs(), tokenizer=TOKENIZER)),
    output:
        V.benchmark("{weights}", "{task}"),
    wildcard_constraints:
        task=BENCH.task_pattern(),
        weights=BENCH.weights_pattern(),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("benchmark", "{vrun}/{weights}/{task}"),
    params:
        base=lambda wc, input: optional("--base", input.get("model")),
        flags=lambda wc: BENCH.flags(wc.task),
        key=lambda wc: BENCH.key(wc.task),
        batch=lambda wc, output: BENCH.section["batch_size"],
        cache=R.benchmark_cache,
    resources:
        **job_resources("benchmark"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline benchmark --weights {input.weights} {params.base} "
        "--name {wildcards.weights} {params.flags} --batch-size {params.batch} --cache-dir {params.cache} --out {output}"


rule benchmark_report:
    input:
        results=lambda wc: BENCH.all_results(wc.vrun),
    output:
        csv=report(V.benchmarks_csv, caption="../report/benchmarks.rst", category="Evaluation", subcategory=SUB),
        plot=report(V.benchmarks_plot, caption="../report/benchmarks_plot.rst", category="Evaluation",
                    subcategory=SUB),
        html=report(V.benchmarks_html, caption="../report/benchmarks_html.rst", category="Evaluation",
                    subcategory=SUB),
    localrule: True
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("benchmark_report", "{vrun}"),
    params:
        weights=" ".join(BENCH.weights),
        run="{vrun}",
    shell:
        launch() + "python -m pipeline benchmark-report --results {input.results} --weights {params.weights} "
        "--run {params.run} --out-csv {output.csv} --out-plot {output.plot} --out-html {output.html}"


rule benchmark_card:
    # The scores into the scored export dirs' model cards (written after the dirs: the jobs read them).
    input:
        csv=V.benchmarks_csv,
        dirs=[V.export(w) for w in BENCH.trained],
    output:
        V.benchmark_cards,
    localrule: True
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("benchmark_card", "{vrun}"),
    shell:
        launch() + "python -m pipeline benchmark-card --table {input.csv} --dirs {input.dirs} --out {output}"
