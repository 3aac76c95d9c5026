# Final checkpoint -> Hugging Face dirs, the run's best weights, streaming LoRA merge, its
# verification, a smoke test.
#
# Each rule that writes an export dir also writes its model card (README.md): from the run's
# plan, data stats, trainer config and the stages' evaluations, declared as inputs
# (`card_inputs`, `card_flags` in common.smk). The merged dir is smoke-tested after it is
# written, so no card takes the smoke test (a cycle for merged); smoke_test.json and the report
# have it.


rule consolidate:
    input:
        stage=f"{V}/stages/{LAST_STAGE}",
        model=model_inputs(),
        tokenizer=TOKENIZER,  # every export carries the run's tokenizer and chat template
        **card_inputs(),
    output:
        adapter=directory(f"{V}/export/adapter_final"),
        # a run that keeps no EMA (ema.rates=[]) has none to export
        adapter_ema=directory(f"{V}/export/adapter_ema") if HAS_EMA else [],
    conda:
        "../envs/sft.yaml"
    log:
        "logs/consolidate/{vrun}.log",
    params:
        card=card_flags,
        model=base_model,
        ema=lambda wc, output: f"--out-adapter-ema {output.adapter_ema} {ema_rate_flag()} --models both"
        if HAS_EMA else "--models main",
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline consolidate --checkpoint {input.stage}/checkpoint --base {params.model} "
        "--out-adapter {output.adapter} {params.ema} --tokenizer {input.tokenizer} {params.card}"


rule export_best:
    input:
        # every stage: the best weights live in the stage that found them
        stages=[f"{V}/stages/{s}" for s in STAGES],
        tokenizer=TOKENIZER,
        **card_inputs(),
    output:
        best=directory(f"{V}/export/adapter_best"),
        best_ema=directory(f"{V}/export/adapter_best_ema") if HAS_EMA else [],
    conda:
        "../envs/sft.yaml"
    log:
        "logs/export_best/{vrun}.log",
    params:
        card=card_flags,
        stages=lambda wc, input: os.path.dirname(input.stages[0]),
        last=LAST_STAGE,
        best_ema=lambda wc, output: f"--out-best-ema {output.best_ema}" if HAS_EMA else "",
    shell:
        launch() + "python -m pipeline export-best --stages {params.stages} --last {params.last} "
        "--out-best {output.best} {params.best_ema} --tokenizer {input.tokenizer} {params.card}"


rule merge_lora:
    input:
        adapter=export_adapter(),
        model=model_inputs(),
        tokenizer=TOKENIZER,
        **card_inputs(),
    output:
        directory(f"{V}/export/merged"),
    conda:
        "../envs/sft.yaml"
    log:
        "logs/merge_lora/{vrun}.log",
    benchmark:
        "benchmarks/merge_lora/{vrun}.tsv"
    params:
        card=card_flags,
        model=base_model,
        dtype=config["export"]["dtype"],
    resources:
        **job_resources("merge"),
    shell:
        launch() + "python -m pipeline merge --base {params.model} --adapter {input.adapter} --out {output} "
        "--tokenizer {input.tokenizer} "
        "--dtype {params.dtype} {params.card}"


rule verify_merge:
    input:
        merged=f"{V}/export/merged",
        adapter=export_adapter(),
        model=model_inputs(),
    output:
        f"{V}/export/verification.json",
    conda:
        "../envs/sft.yaml"
    log:
        "logs/verify_merge/{vrun}.log",
    params:
        model=base_model,
    resources:
        **job_resources("verify"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline verify-merge --base {params.model} --adapter {input.adapter} "
        "--merged {input.merged} --out {output}"


rule smoke_test:
    input:
        merged=f"{V}/export/merged",
        verified=f"{V}/export/verification.json",
        test=data_file("test") or [],
    output:
        f"{V}/export/smoke_test.json",
    conda:
        "../envs/sft.yaml"
    log:
        "logs/smoke_test/{vrun}.log",
    params:
        test=lambda wc, input: optional("--test", input.get("test")),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        min_em=optional("--min-exact-match", config["export"]["min_exact_match"]),
    resources:
        **job_resources("smoke"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline smoke-test --model {input.merged} {params.test} {params.max_test} "
        "--max-new-tokens {params.max_new_tokens} {params.min_em} --out {output}"
