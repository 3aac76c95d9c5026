# The base model (an embedded default, or a hub model into the HF cache), dataset validation, tokenization cache.

# Undeclared on purpose: Snakemake deletes a failed job's declared outputs, so
# `validate` also leaves its reports here when it fails (and clears them when it passes).
VALIDATION_FAILED = R.validation_failed
DEMO_TREE = layout.RunTree.of("{demo}")  # an embedded demo's base model and dataset
LABEL_VIEW_RECORDS = 5  # records per split on the report's label page (`python -m pipeline labels -n` for more)


rule prepare_base:
    output:
        model=directory(DEMO_TREE.base_model),
        train=DEMO_TREE.demo_split("train"),
        val=DEMO_TREE.demo_split("val"),
        test=DEMO_TREE.demo_split("test"),
    wildcard_constraints:
        demo="|".join(EMBEDDED_KINDS),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("prepare_base", "{demo}"),
    benchmark:
        layout.benchmark_file("prepare_base", "{demo}")
    params:
        kind=lambda wc: EMBEDDED_KINDS[wc.demo],
        data_dir=lambda wc, output: os.path.dirname(output.train),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline prepare-base --kind {params.kind} --model-dir {output.model} "
        "--data-dir {params.data_dir}"


rule fetch_model:
    # A `model:` given by hub id, downloaded once where snakemake runs (compute nodes often have
    # no network) into the Hugging Face cache; model.json pins the commit every later job reads.
    output:
        R.hub_model,
    localrule: True
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("fetch_model", RUN),
    params:
        model=str(HUB_MODEL),
    shell:
        launch() + "python -m pipeline fetch-model --model {params.model} --out {output}"


rule prepare_tokenizer:
    input:
        model=model_inputs(),
    output:
        directory(TOKENIZER),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("prepare_tokenizer", RUN),
    params:
        model=base_model,
        chat_template=optional("--chat-template", config["data"]["chat_template"]),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline prepare-tokenizer --model {params.model} {params.chat_template} --out {output}"


# One training file: validated with val / test, then tokenized with val, by one job each.
if TRAIN_SETS is None:

    rule validate_dataset:
        input:
            unpack(lambda wc: data_inputs()),
            tokenizer=TOKENIZER,
        output:
            json=R.validation_json,
            csv=R.validation_csv,
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("validate_dataset", RUN),
        params:
            val=lambda wc, input: optional("--val", input.get("val")),
            test=lambda wc, input: optional("--test", input.get("test")),
            max_length=config["data"]["max_length"],
            too_long=config["data"]["too_long"],
            duplicates=config["data"]["duplicates"],
            reasoning=config["data"]["reasoning"],
            fields=field_flags(),
            failed_reports=VALIDATION_FAILED,
        resources:
            **job_resources("cpu"),
        shell:
            launch() + "python -m pipeline validate --train {input.train} {params.val} {params.test} "
            "--tokenizer {input.tokenizer} --max-length {params.max_length} --too-long {params.too_long} "
            "--duplicates {params.duplicates} --reasoning {params.reasoning} {params.fields} --out-json {output.json} "
            "--out-csv {output.csv} --failed-report-dir {params.failed_reports}"


    rule tokenize:
        input:
            unpack(lambda wc: data_inputs()),
            validation=R.validation_json,
            tokenizer=TOKENIZER,
        output:
            train=R.cache("train"),
            val=R.cache("val") if data_file("val") else [],
            stats=R.stats,
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("tokenize", RUN),
        params:
            val=lambda wc, input, output: f'{optional("--val", input.get("val"))} {optional("--out-val", output.get("val"))}',
            max_length=config["data"]["max_length"],
            too_long=config["data"]["too_long"],
            duplicates=config["data"]["duplicates"],
            reasoning=config["data"]["reasoning"],
            fields=field_flags(),
        resources:
            **job_resources("cpu"),
        shell:
            launch() + "python -m pipeline tokenize --train {input.train} {params.val} --tokenizer {input.tokenizer} "
            "--max-length {params.max_length} --too-long {params.too_long} --duplicates {params.duplicates} "
            "--reasoning {params.reasoning} {params.fields} "
            "--out-train {output.train} --out-stats {output.stats}"


# Several training datasets (data.train a list): each validated (with the val / test files: their
# overlaps) and tokenized by jobs of its own, so adding one runs only its jobs; the run's reports
# (validation.json/.csv, stats.json) are merged from theirs, each dataset as split train:<name>.
else:

    rule validate_train_set:
        input:
            unpack(train_set_inputs),
            tokenizer=TOKENIZER,
        output:
            json=R.train_set_validation_json("{dataset}"),
            csv=R.train_set_validation_csv("{dataset}"),
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("validate_train_set", f"{RUN}/{{dataset}}"),
        params:
            val=lambda wc, input: optional("--val", input.get("val")),
            test=lambda wc, input: optional("--test", input.get("test")),
            max_length=config["data"]["max_length"],
            too_long=config["data"]["too_long"],
            duplicates=config["data"]["duplicates"],
            reasoning=config["data"]["reasoning"],
            fields=lambda wc: field_flags(TRAIN_SETS[wc.dataset]),
            failed_reports=lambda wc: R.train_set_validation_failed(wc.dataset),
        resources:
            **job_resources("cpu"),
        shell:
            launch() + "python -m pipeline validate --train {input.train} {params.val} {params.test} "
            "--tokenizer {input.tokenizer} --max-length {params.max_length} --too-long {params.too_long} "
            "--duplicates {params.duplicates} --reasoning {params.reasoning} {params.fields} "
            "--out-json {output.json} --out-csv {output.csv} --failed-report-dir {params.failed_reports}"

    rule tokenize_train_set:
        input:
            train=lambda wc: TRAIN_SETS[wc.dataset]["path"],
            validation=R.train_set_validation_json("{dataset}"),
            tokenizer=TOKENIZER,
        output:
            train=R.train_set_cache("{dataset}"),
            stats=R.train_set_stats("{dataset}"),
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("tokenize_train_set", f"{RUN}/{{dataset}}"),
        params:
            max_length=config["data"]["max_length"],
            too_long=config["data"]["too_long"],
            duplicates=config["data"]["duplicates"],
            reasoning=config["data"]["reasoning"],
            fields=lambda wc: field_flags(TRAIN_SETS[wc.dataset]),
        resources:
            **job_resources("cpu"),
        shell:
            launch() + "python -m pipeline tokenize --train {input.train} --tokenizer {input.tokenizer} "
            "--max-length {params.max_length} --too-long {params.too_long} --duplicates {params.duplicates} "
            "--reasoning {params.reasoning} {params.fields} --out-train {output.train} --out-stats {output.stats}"

    if data_file("val"):

        rule tokenize_val:
            # Validated with every training dataset; tokenized once, after the first dataset's validation
            # passed (not after all: appending a dataset must not re-tokenize the validation set).
            input:
                val=data_file("val"),
                validation=R.train_set_validation_json(next(iter(TRAIN_SETS))),
                tokenizer=TOKENIZER,
            output:
                val=R.cache("val"),
                stats=R.val_stats,
            conda:
                "../envs/sft.yaml"
            log:
                layout.log_file("tokenize_val", RUN),
            params:
                max_length=config["data"]["max_length"],
                too_long=config["data"]["too_long"],
                duplicates=config["data"]["duplicates"],
                reasoning=config["data"]["reasoning"],
                fields=field_flags(),
            resources:
                **job_resources("cpu"),
            shell:
                launch() + "python -m pipeline tokenize --val {input.val} --tokenizer {input.tokenizer} "
                "--max-length {params.max_length} --too-long {params.too_long} --duplicates {params.duplicates} "
                "--reasoning {params.reasoning} {params.fields} --out-val {output.val} --out-stats {output.stats}"

    rule mixed_reports:
        input:
            validations=[R.train_set_validation_json(name) for name in TRAIN_SETS],
            stats=[R.train_set_stats(name) for name in TRAIN_SETS],
            val_stats=R.val_stats if data_file("val") else [],
        output:
            json=R.validation_json,
            csv=R.validation_csv,
            stats=R.stats,
        localrule: True
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("mixed_reports", RUN),
        params:
            datasets=" ".join(f"--dataset {name}={R.train_set(name)}" for name in TRAIN_SETS),
            val_stats=lambda wc, input: optional("--val-stats", input.get("val_stats")),
        shell:
            launch() + "python -m pipeline mixed-reports {params.datasets} {params.val_stats} "
            "--out-json {output.json} --out-csv {output.csv} --out-stats {output.stats}"


rule label_view:
    # The report's label page: the first records of each split as trained, supervised tokens
    # marked, with the split's counts and the validation's chat warnings. No model weights.
    input:
        train=train_caches(),
        val=R.cache("val") if data_file("val") else [],
        stats=R.stats,
        validation=R.validation_json,
        tokenizer=TOKENIZER,
    output:
        report(R.labels_html, caption="../report/labels_html.rst", category="Data"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("label_view", RUN),
    params:
        records=LABEL_VIEW_RECORDS,
        title=f"Labels of run {RUN}",
        # Several training datasets: each cache's stats.json lies next to it (the val cache's: the run's).
        stats=lambda wc, input: optional("--stats", input.stats if TRAIN_SETS is None else None),
    shell:
        launch() + "python -m pipeline labels --cache {input.train} {input.val} --tokenizer {input.tokenizer} "
        "{params.stats} --validation {input.validation} -n {params.records} --title {params.title:q} "
        "--out {output}"
