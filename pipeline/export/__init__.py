"""Export: training checkpoints -> Hugging Face dirs, LoRA merge, merge verification.

Commands (each `main(argv) -> int`, dispatched by `pipeline.cli`):

* `consolidate` (`consolidate.py`): a final checkpoint in any format (HF dirs,
  DCP shards, legacy `.pt`) -> adapter / model dirs that stock peft and
  transformers load;
* `merge` (`merge.py`): fold a LoRA adapter into the base shard by shard,
  without building the model;
* `verify-merge` (`verify.py`): merged logits vs base + adapter.

Building blocks: `lora_math` (pure merge math), `safetensors_stream` (tensor-
at-a-time safetensors I/O), `hf_dir` (model dir files), `checkpoint` (reading
training checkpoints), `outputs` (write guards), `dtypes` (dtype names).
"""
