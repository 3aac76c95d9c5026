"""File formats and file-system primitives shared by every stage of the pipeline.

* `dtypes`             -- the one map between dtype names (configs, CLIs, safetensors, config.json)
* `safetensors_stream` -- safetensors read and written one tensor at a time
* `hf_dir`             -- Hugging Face model dirs: finding their weights, writing them in shards
* `publish`            -- atomic publication of dirs and files (temp sibling + rename / exchange)
* `hub`                -- a model given by hub id: fetched once into the Hugging Face cache, read from there
* `globs`              -- a dataset given as a local glob: the files it matches

Nothing here knows about training, checkpoints or the workflow; everything above uses it.
"""
