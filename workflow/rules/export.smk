# Final checkpoint -> Hugging Face dirs, the run's best weights, streaming LoRA merge, its
# verification, a smoke test.
#
# Each rule that writes an export dir also writes its model card (README.md): from the run's
# plan, data stats, trainer config and the stages' evaluations, declared as inputs
# (`card_inputs`, `card_flags` below). The merged dir is smoke-tested after it is
# written, so no card takes the smoke test (a cycle for merged); smoke_test.json and the report
# have it.


rule consolidate:
    input:
        stage=V.stage(LAST_STAGE),
        model=model_inputs(),
        tokenizer=TOKENIZER,  # every export carries the run's tokenizer and chat template
        **card_inputs(),
    output:
        adapter=directory(V.export(layout.ADAPTER_FINAL)),
        # a run that keeps no EMA (ema.rates=[]) has none to export
        adapter_ema=directory(V.export(layout.ADAPTER_EMA)) if HAS_EMA else [],
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("consolidate", "{vrun}"),
    params:
        checkpoint=lambda wc, input: stage_checkpoint(input.stage),
        card=card_flags,
        model=base_model,
        ema=lambda wc, output: f"--out-adapter-ema {output.adapter_ema} --models both" if HAS_EMA else "--models main",
        # Not a function of output: Snakemake compares it, so another export.ema_rate exports again.
        ema_rate=optional("--ema-rate", config["export"]["ema_rate"]) if HAS_EMA else "",
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline consolidate --checkpoint {params.checkpoint} --base {params.model} "
        "--out-adapter {output.adapter} {params.ema} {params.ema_rate} --tokenizer {input.tokenizer} {params.card}"


rule export_best:
    input:
        # every stage: the best weights live in the stage that found them
        stages=[V.stage(s) for s in STAGES],
        tokenizer=TOKENIZER,
        **card_inputs(),
    output:
        best=directory(V.export(layout.ADAPTER_BEST)),
        best_ema=directory(V.export(layout.ADAPTER_BEST_EMA)) if HAS_EMA else [],
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("export_best", "{vrun}"),
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
        adapter=RUN_CONFIG.merge_source(V),
        model=model_inputs(),
        tokenizer=TOKENIZER,
        **card_inputs(),
    output:
        directory(V.export(layout.MERGED)),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("merge_lora", "{vrun}"),
    benchmark:
        layout.benchmark_file("merge_lora", "{vrun}")
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
        merged=V.export(layout.MERGED),
        adapter=RUN_CONFIG.merge_source(V),
        model=model_inputs(),
        config=V.train_config,  # a quantized base (model.quantization) is measured too
    output:
        V.verification,
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("verify_merge", "{vrun}"),
    params:
        model=base_model,
    resources:
        **job_resources("verify"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline verify-merge --base {params.model} --adapter {input.adapter} "
        "--merged {input.merged} --train-config {input.config} --out {output}"


rule smoke_test:
    input:
        merged=V.export(layout.MERGED),
        verified=V.verification,
        test=DATA.held_out_inputs().get("test", []),
    output:
        V.smoke_test,
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("smoke_test", "{vrun}"),
    params:
        test=lambda wc, input, output: DATA.held_out_args(input, ["test"]),
        max_test=optional("--max-test", config["evaluate"]["max_test"]),
        max_new_tokens=config["evaluate"]["max_new_tokens"],
        fields=field_flags(),  # the held-out file's own key / role names (data.smk)
        min_em=optional("--min-exact-match", config["export"]["min_exact_match"]),
    resources:
        **job_resources("smoke"),
    shell:
        launch(gpus=EVAL_GPUS) + "python -m pipeline smoke-test --model {input.merged} {params.test} {params.max_test} "
        "--max-new-tokens {params.max_new_tokens} {params.min_em} {params.fields} --out {output}"
