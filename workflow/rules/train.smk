# The run's plan, the training stages (pilot, chunk01..chunkNN, tail) and the pilot gate.


rule plan:
    # No config file is an input: the trainer config is keyed on its resolved content (config_id
    # in plan_params), so a comment or an unused group file retrains nothing, and a changed
    # resolved value re-plans and retrains every stage (--rerun-triggers params).
    # The base model is: plan checks the LoRA targets against its layers; and the run's tokenizer:
    # special tokens it added rule out distributed.strategy=fsdp.
    input:
        model=model_inputs(),
        tokenizer=TOKENIZER,
        # several training datasets: the plan counts their records for the mix (plan.json `mix`)
        mix=DATA.mix_caches(),
    output:
        plan=report(V.plan, caption="../report/plan.rst", category="Run",
                    subcategory="{vrun}" if SWEEP else None),
        config=V.train_config,
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("plan", "{vrun}"),
    params:
        # The run's config as the workflow resolved it when it loaded (pipeline/planning/run_config.py).
        **plan_params(lambda wc: RUN_CONFIG.variants[wc.vrun]),
    shell:
        launch() + "python -m pipeline plan {params.args} {params.world} --max-length {params.max_length} "
        "--out-plan {output.plan} --out-config {output.config}"


rule train_stage:
    input:
        unpack(train_inputs),
    output:
        directory(V.stage("{stage}")),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("train_stage", "{vrun}/{stage}"),
    benchmark:
        layout.benchmark_file("train_stage", "{vrun}/{stage}")
    params:
        scratch=lambda wc: layout.scratch_dir(wc.vrun, wc.stage),
        init=init_flag,
    threads: train_threads()
    resources:
        **job_resources("train"),
    shell:
        # The launcher runs one process, torchrun over the GPUs the job holds (train.nproc), or one
        # torchrun per node under srun (train.nodes), and passes SIGTERM / SIGUSR1 to every rank,
        # which saves at its next step boundary and exits 75.
        launch(gpus=TRAIN_GPUS, train=True) + "-m pipeline train "
        "--plan {input.plan} --config {input.config} --stage {wildcards.stage} {params.init} "
        "--scratch {params.scratch} --out {output}"


rule pilot_gate:
    input:
        pilot=V.stage(PILOT),
        plan=V.plan,
    output:
        report(V.pilot_report, caption="../report/pilot_gate.rst", category="Run",
               subcategory="{vrun}" if SWEEP else None),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("pilot_gate", "{vrun}"),
    params:
        override="--override" if config["gate"]["override"] else "",
    shell:
        launch() + "python -m pipeline pilot-gate --pilot {input.pilot} --plan {input.plan} --out {output} "
        "{params.override}"
