# The base model (an embedded default, or a hub model into the HF cache), hub datasets, validation, tokenization.

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


if DATA.hub:

    checkpoint fetch_data:
        # A dataset file (or glob of shards) given by hub URL, downloaded once where snakemake runs into
        # the Hugging Face cache, with the image files its records name beside it; its pin (commit and
        # files) is the dataset path every later job reads.
        # A checkpoint: how many shards a training dataset is split into is known once its files are
        # here, and the jobs that depend on that are planned then (`fetched`).
        output:
            R.hub_data("{key}"),
        localrule: True
        wildcard_constraints:
            key=DATA.hub_wildcard(),
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("fetch_data", f"{RUN}/{{key}}"),
        params:
            url=lambda wc: shlex.quote(DATA.hub[wc.key]),
            # a function of `output`, which Snakemake leaves out of --rerun-triggers params: a changed
            # data.columns does not fetch the dataset again
            fields=lambda wc, output: DATA.fetch_flags(wc.key),
        shell:
            launch() + "python -m pipeline fetch-data --url {params.url} --out {output} {params.fields}"


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
        template_kwargs=optional("--template-kwargs", shlex.quote(json.dumps(config["data"]["chat_template_kwargs"]))
                                 if config["data"]["chat_template_kwargs"] else None),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline prepare-tokenizer --model {params.model} {params.chat_template} "
        "{params.template_kwargs} --out {output}"


# Every training dataset, one file (a mix of one) or each of a list, by the same rules (wildcard `dataset`,
# pipeline/data/datasets.py): validated with val / test (their overlaps) and tokenized into
# results/<run>/data/train/<name>/. A file of data.shard_mb MiB or more is split into shards, each
# validated and tokenized by a job of its own (cached, restartable and scheduled on its own: under
# SLURM, CPU jobs of their own) and merged into exactly what one job writes (pipeline/data/shards.py).
# The run's validation.json/.csv and stats.json are merged from the datasets' (`data_reports`).


rule validate_shard:
    input:
        train=lambda wc: DATA.train_files(wc.dataset),
        tokenizer=TOKENIZER,
    output:
        scan=R.shard_scan("{dataset}", "{shard}"),
        arrays=R.shard_scan("{dataset}", "{shard}").with_suffix(".npz"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("validate_shard", f"{RUN}/{{dataset}}/{{shard}}"),
    params:
        train=lambda wc, input, output: DATA.train_arg(wc.dataset),  # a glob as given, not its matches
        data=lambda wc: DATA.flags(wc.dataset, duplicates=False),
        shard=lambda wc: DATA.shard_flag(wc.dataset, wc.shard),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline validate-shard --train {params.train} --shard {params.shard} "
        "--tokenizer {input.tokenizer} {params.data} --out {output.scan}"


rule validate_dataset:
    input:
        unpack(lambda wc: DATA.validate_inputs(fetched(wc.dataset))),
    output:
        json=R.train_set_validation_json("{dataset}"),
        csv=R.train_set_validation_csv("{dataset}"),
        dropped=R.train_set_dropped("{dataset}"),
        shards=R.train_set_shards("{dataset}", "validate"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("validate_dataset", f"{RUN}/{{dataset}}"),
    params:
        train=fetched_input("train", lambda wc: DATA.train_arg(wc.dataset)),
        tokenizer=fetched_input("tokenizer"),
        held_out=lambda wc, input, output: DATA.held_out_args(input),
        # .get: before a hub dataset's fetch_data checkpoint has run, its inputs are only that checkpoint's
        scans=lambda wc, input: optional("--scans", " ".join(input.get("scans", []))),
        data=lambda wc: DATA.flags(wc.dataset),
        # Undeclared on purpose: Snakemake deletes a failed job's declared outputs, so validation
        # also leaves its reports here when it fails (and clears them when it passes).
        failed_reports=lambda wc: R.train_set_validation_failed(wc.dataset),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline validate --train {params.train} {params.held_out} {params.scans} "
        "--tokenizer {params.tokenizer} {params.data} --out-json {output.json} --out-csv {output.csv} "
        "--out-drop {output.dropped} --shards-out {output.shards} --failed-report-dir {params.failed_reports}"


rule tokenize_shard:
    input:
        train=lambda wc: DATA.train_files(wc.dataset),
        validation=R.train_set_validation_json("{dataset}"),
        dropped=R.train_set_dropped("{dataset}"),
        tokenizer=TOKENIZER,
    output:
        part=R.shard_part("{dataset}", "{shard}"),
        info=R.shard_part("{dataset}", "{shard}").with_suffix(".json"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("tokenize_shard", f"{RUN}/{{dataset}}/{{shard}}"),
    params:
        train=lambda wc, input, output: DATA.train_arg(wc.dataset),
        data=lambda wc: DATA.flags(wc.dataset),
        shard=lambda wc: DATA.shard_flag(wc.dataset, wc.shard),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline tokenize-shard --train {params.train} --shard {params.shard} "
        "--tokenizer {input.tokenizer} {params.data} --drop {input.dropped} --out {output.part}"


rule tokenize_dataset:
    input:
        unpack(lambda wc: DATA.tokenize_inputs(fetched(wc.dataset))),
    output:
        train=R.train_set_cache("{dataset}"),
        stats=R.train_set_stats("{dataset}"),
        shards=R.train_set_shards("{dataset}", "tokenize"),
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("tokenize_dataset", f"{RUN}/{{dataset}}"),
    params:
        train=fetched_input("train", lambda wc: DATA.train_arg(wc.dataset)),
        tokenizer=fetched_input("tokenizer"),
        dropped=fetched_input("dropped"),
        data=lambda wc: DATA.flags(wc.dataset),
        parts=lambda wc, input: optional("--parts", " ".join(input.get("parts", []))),  # .get: as scans
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline tokenize --train {params.train} --tokenizer {params.tokenizer} {params.data} "
        "--drop {params.dropped} {params.parts} --out-train {output.train} --out-stats {output.stats} "
        "--shards-out {output.shards}"


if DATA.split_path("val"):

    rule tokenize_val:
        # Validated with every training dataset; tokenized once, after the first dataset's validation
        # passed (not after all: appending a dataset must not re-tokenize the validation set).
        input:
            val=DATA.held_out_inputs()["val"],
            validation=R.train_set_validation_json(next(iter(DATA.sets))),
            tokenizer=TOKENIZER,
        output:
            val=R.cache("val"),
            stats=R.val_stats,
        conda:
            "../envs/sft.yaml"
        log:
            layout.log_file("tokenize_val", RUN),
        params:
            val=lambda wc, input, output: DATA.held_out_args(input),  # --val <path>: a glob as given
            data=DATA.flags(),
        resources:
            **job_resources("cpu"),
        shell:
            launch() + "python -m pipeline tokenize {params.val} --tokenizer {input.tokenizer} {params.data} "
            "--out-val {output.val} --out-stats {output.stats}"


rule data_reports:
    input:
        validations=[R.train_set_validation_json(name) for name in DATA.sets],
        stats=[R.train_set_stats(name) for name in DATA.sets],
        shards=[R.train_set_shards(name, step) for name in DATA.sets for step in ("validate", "tokenize")],
        val_stats=R.val_stats if DATA.split_path("val") else [],
    output:
        json=R.validation_json,
        csv=R.validation_csv,
        stats=R.stats,
        shards=R.data_shards,
        html=report(R.data_html, caption="../report/data_html.rst", category="Data"),
    localrule: True
    conda:
        "../envs/sft.yaml"
    log:
        layout.log_file("data_reports", RUN),
    params:
        datasets=DATA.report_flags(),
        val_stats=lambda wc, input: optional("--val-stats", input.get("val_stats")),
    shell:
        launch() + "python -m pipeline mixed-reports {params.datasets} {params.val_stats} "
        "--out-json {output.json} --out-csv {output.csv} --out-stats {output.stats} --out-shards {output.shards} "
        "--out-html {output.html}"


rule label_view:
    # The report's label page: the first records of each split as trained, supervised tokens
    # marked, with the split's counts and the validation's chat warnings. No model weights.
    input:
        train=DATA.train_caches(),
        val=R.cache("val") if DATA.split_path("val") else [],
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
        # Each training cache's stats.json lies next to it (the val cache's: the run's).
    shell:
        launch() + "python -m pipeline labels --cache {input.train} {input.val} --tokenizer {input.tokenizer} "
        "--validation {input.validation} -n {params.records} --title {params.title:q} "
        "--out {output}"
