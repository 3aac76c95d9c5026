# The base model (an embedded default, or a hub model into the HF cache), dataset validation, tokenization cache.

# Undeclared on purpose: Snakemake deletes a failed job's declared outputs, so
# `validate` also leaves its reports here when it fails (and clears them when it passes).
VALIDATION_FAILED = f"{R}/data/validation_failed"
LABEL_VIEW_RECORDS = 5  # records per split on the report's label page (`python -m pipeline labels -n` for more)


rule prepare_base:
    output:
        model=directory("results/{demo}/model"),
        train="results/{demo}/data/train.jsonl",
        val="results/{demo}/data/val.jsonl",
        test="results/{demo}/data/test.jsonl",
    wildcard_constraints:
        demo="|".join(EMBEDDED_KINDS),
    conda:
        "../envs/sft.yaml"
    log:
        "logs/prepare_base/{demo}.log",
    benchmark:
        "benchmarks/prepare_base/{demo}.tsv"
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
        f"{R}/model.json",
    localrule: True
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/fetch_model/{RUN}.log",
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
        f"logs/prepare_tokenizer/{RUN}.log",
    params:
        model=base_model,
        chat_template=optional("--chat-template", config["data"]["chat_template"]),
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline prepare-tokenizer --model {params.model} {params.chat_template} --out {output}"


rule validate_dataset:
    input:
        unpack(lambda wc: data_inputs()),
        tokenizer=TOKENIZER,
    output:
        json=f"{R}/data/validation.json",
        csv=f"{R}/data/validation.csv",
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/validate_dataset/{RUN}.log",
    params:
        val=lambda wc, input: optional("--val", input.get("val")),
        test=lambda wc, input: optional("--test", input.get("test")),
        max_length=config["data"]["max_length"],
        too_long=config["data"]["too_long"],
        duplicates=config["data"]["duplicates"],
        reasoning=config["data"]["reasoning"],
        failed_reports=VALIDATION_FAILED,
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline validate --train {input.train} {params.val} {params.test} "
        "--tokenizer {input.tokenizer} --max-length {params.max_length} --too-long {params.too_long} "
        "--duplicates {params.duplicates} --reasoning {params.reasoning} --out-json {output.json} --out-csv {output.csv} "
        "--failed-report-dir {params.failed_reports}"


rule tokenize:
    input:
        unpack(lambda wc: data_inputs()),
        validation=f"{R}/data/validation.json",
        tokenizer=TOKENIZER,
    output:
        train=f"{R}/data/train.safetensors",
        val=f"{R}/data/val.safetensors" if data_file("val") else [],
        stats=f"{R}/data/stats.json",
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/tokenize/{RUN}.log",
    params:
        val=lambda wc, input, output: f'{optional("--val", input.get("val"))} {optional("--out-val", output.get("val"))}',
        max_length=config["data"]["max_length"],
        too_long=config["data"]["too_long"],
        duplicates=config["data"]["duplicates"],
        reasoning=config["data"]["reasoning"],
    resources:
        **job_resources("cpu"),
    shell:
        launch() + "python -m pipeline tokenize --train {input.train} {params.val} --tokenizer {input.tokenizer} "
        "--max-length {params.max_length} --too-long {params.too_long} --duplicates {params.duplicates} "
        "--reasoning {params.reasoning} "
        "--out-train {output.train} --out-stats {output.stats}"


rule label_view:
    # The report's label page: the first records of each split as trained, supervised tokens
    # marked, with the split's counts and the validation's chat warnings. No model weights.
    input:
        train=f"{R}/data/train.safetensors",
        val=f"{R}/data/val.safetensors" if data_file("val") else [],
        stats=f"{R}/data/stats.json",
        validation=f"{R}/data/validation.json",
        tokenizer=TOKENIZER,
    output:
        report(f"{R}/report/labels.html", caption="../report/labels_html.rst", category="Data"),
    conda:
        "../envs/sft.yaml"
    log:
        f"logs/label_view/{RUN}.log",
    params:
        records=LABEL_VIEW_RECORDS,
        title=f"Labels of run {RUN}",
    shell:
        launch() + "python -m pipeline labels --cache {input.train} {input.val} --tokenizer {input.tokenizer} "
        "--stats {input.stats} --validation {input.validation} -n {params.records} --title {params.title:q} "
        "--out {output}"
