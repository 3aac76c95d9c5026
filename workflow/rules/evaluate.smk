# Evaluation of the base and of every stage (raw + each EMA rate), and the summary.


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
        "python -m pipeline evaluate --config {input.config} --stage base {params.test} {params.max_test} "
        "--max-new-tokens {params.max_new_tokens} --out {output} > {log} 2>&1"


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
        "python -m pipeline evaluate --checkpoint {input.stage}/checkpoint --stage {wildcards.stage} "
        "{params.test} {params.max_test} --max-new-tokens {params.max_new_tokens} --out {output} > {log} 2>&1"


rule summarize:
    input:
        evals=[f"{R}/eval/base.json"] + expand(f"{R}/eval/{{stage}}.json", stage=STAGES),
        stages=expand(f"{R}/stages/{{stage}}", stage=STAGES),
        smoke=f"{R}/export/smoke_test.json",
    output:
        csv=report(f"{R}/eval/summary.csv", caption="../report/summary.rst", category="Evaluation"),
        loss=report(f"{R}/eval/loss.png", caption="../report/loss.rst", category="Evaluation"),
        val=report(f"{R}/eval/val_loss.png", caption="../report/val_loss.rst", category="Evaluation"),
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/summarize/{RUN}.log",
    params:
        metrics=lambda wc, input: " ".join(f"{s}/metrics.jsonl" for s in input.stages),
    shell:
        "python -m pipeline summarize --eval {input.evals} --metrics {params.metrics} --smoke {input.smoke} "
        "--out-csv {output.csv} --out-loss-plot {output.loss} --out-eval-plot {output.val} > {log} 2>&1"
