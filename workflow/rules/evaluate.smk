# Evaluation of the base and of every stage (raw + each EMA rate), and the summary:
# the table, the plots and the pages of `snakemake --report report.html`.


report: "../report/workflow.rst"


rule evaluate_base:
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
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline evaluate --config {input.config} --stage base {params.test} {params.max_test} "
        "--max-new-tokens {params.max_new_tokens} --out {output}"


rule evaluate_stage:
    input:
        stage=f"{R}/stages/{{stage}}",
        val=f"{R}/data/val.safetensors" if data_file("val") else [],
        test=data_file("test") or [],
    output:
        f"{R}/eval/{{stage}}.json",
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/evaluate_stage/{RUN}/{{stage}}.log",
    params:
        test=lambda wc, input: optional("--test", input.get("test")),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline evaluate --checkpoint {input.stage}/checkpoint --stage {wildcards.stage} "
        "{params.test} {params.max_test} --max-new-tokens {params.max_new_tokens} --out {output}"


rule summarize:
    input:
        evals=[f"{R}/eval/base.json"] + expand(f"{R}/eval/{{stage}}.json", stage=STAGES),
        stages=expand(f"{R}/stages/{{stage}}", stage=STAGES),
        smoke=f"{R}/export/smoke_test.json",
        plan=f"{R}/plan.json",
        gate=f"{R}/pilot_report.json",
    output:
        # Categories of `snakemake --report report.html`: Training, Evaluation, Run. The HTML
        # pages show the table, plan and gate inline (the report only offers CSV/JSON as downloads).
        loss=report(f"{R}/eval/loss.png", caption="../report/loss.rst", category="Training"),
        val=report(f"{R}/eval/val_loss.png", caption="../report/val_loss.rst", category="Evaluation"),
        html=report(f"{R}/report/summary.html", caption="../report/summary_html.rst", category="Evaluation"),
        csv=report(f"{R}/eval/summary.csv", caption="../report/summary.rst", category="Evaluation"),
        plan=report(f"{R}/report/plan.html", caption="../report/plan_html.rst", category="Run"),
        gate=report(f"{R}/report/pilot_gate.html", caption="../report/pilot_gate_html.rst", category="Run"),
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/summarize/{RUN}.log",
    params:
        run=RUN,
    shell:
        launch() + "python -m pipeline summarize --eval {input.evals} --metrics {input.stages} --smoke {input.smoke} "
        "--plan {input.plan} --gate {input.gate} --run {params.run} "
        "--out-csv {output.csv} --out-loss-plot {output.loss} --out-eval-plot {output.val} "
        "--out-summary-html {output.html} --out-plan-html {output.plan} --out-gate-html {output.gate}"
