# The run's plan, the training stages (pilot, chunk01..chunkNN, tail) and the pilot gate.


rule plan:
    input:
        # Trainer YAML files are inputs: editing one retrains (a changed hyperparameter must).
        train_configs=sorted(str(p) for p in Path("config/train").rglob("*.yaml")),
        main=f"config/train/{config['train']['config_name']}.yaml",
    output:
        plan=report(f"{R}/plan.json", caption="../report/plan.rst", category="Run"),
        config=f"{R}/train_config.yaml",
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/plan/{RUN}.log",
    params:
        total=config["schedule"]["total_updates"],
        fraction=config["schedule"]["pilot_fraction"],
        chunks=config["schedule"]["num_chunks"],
        # params, not inputs: a changed override re-plans (and so retrains) via --rerun-triggers params
        overrides=train_overrides(),
        override_flags=lambda wc: " ".join(f"--override '{o}'" for o in train_overrides()),
    shell:
        "python -m pipeline plan --total-updates {params.total} --pilot-fraction {params.fraction} "
        "--num-chunks {params.chunks} --train-config-dir $(dirname {input.main}) --train-config-name $(basename {input.main} .yaml) "
        "{params.override_flags} --out-plan {output.plan} --out-config {output.config} > {log} 2>&1"


rule train_stage:
    input:
        unpack(train_inputs),
    output:
        directory(f"{R}/stages/{{stage}}"),
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/train_stage/{RUN}/{{stage}}.log",
    benchmark:
        f"benchmarks/train_stage/{RUN}/{{stage}}.tsv"
    params:
        scratch=lambda wc: f"{WORK}/{wc.stage}",
        init=init_flag,
        nproc=nproc,
    threads: train_threads()
    shell:
        # --standalone: single-node rendezvous on a free port. Multi-node: see README.
        # exec: SLURM / Snakemake signals (TERM, USR1) reach torchrun itself, which
        # passes TERM on to the ranks; each saves at its next step boundary.
        "exec torchrun --standalone --nproc-per-node {params.nproc} -m pipeline train "
        "--plan {input.plan} --config {input.config} --stage {wildcards.stage} {params.init} "
        "--scratch {params.scratch} --out {output} > {log} 2>&1"


rule pilot_gate:
    input:
        pilot=f"{R}/stages/{PILOT}",
        plan=f"{R}/plan.json",
    output:
        report(f"{R}/pilot_report.json", caption="../report/pilot_gate.rst", category="Run"),
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/pilot_gate/{RUN}.log",
    params:
        override="--override" if config["gate"]["override"] else "",
    shell:
        "python -m pipeline pilot-gate --pilot {input.pilot} --plan {input.plan} --out {output} "
        "{params.override} > {log} 2>&1"
