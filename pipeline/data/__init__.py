"""Dataset handling: reading chat datasets, validating them, tokenizing them into a cache.

* `pipeline.data.formats`  -- LLaVA/ShareGPT and OpenAI records (JSON or JSONL) -> `Record`
* `pipeline.data.validate` -- every check on every record; `python -m pipeline validate`
* `pipeline.data.tokenize` -- chat-template tokenization with assistant-only labels;
  `python -m pipeline tokenize`
* `pipeline.data.cache`    -- the safetensors token cache and `TokenCache` (memory-mapped)
* `pipeline.data.images`   -- image files: present, decodable, of a sane size
* `pipeline.data.vision`   -- a vision-language model's processor: image tokens, pixels

Only the light, dependency-free names are re-exported here; import `TokenCache`
from `pipeline.data.cache` (it needs numpy and torch).
"""

from pipeline.data.formats import Problem, Record, load_records, parse_file, prompt_and_reference

__all__ = ["Problem", "Record", "load_records", "parse_file", "prompt_and_reference"]
