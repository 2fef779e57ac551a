"""litkv's KV cache policies inside Hugging Face transformers (`pip install -e ".[hf]"`).

    cache = litkv.hf.Cache(model, litkv.KVCacheConfig(policy="h2o", cache_length=256))
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Importing this module checks the installed transformers against `TRANSFORMERS_RANGE` (ImportError in one line
outside it); building a `Cache` registers litkv's attention function and sets the model to it (docs/hf.md).
"""

from __future__ import annotations

import transformers

from litkv.hf.compat import FAMILIES, TRANSFORMERS_RANGE, check_transformers_version

check_transformers_version(transformers.__version__)

from litkv.hf.cache import Cache, CacheLayer  # noqa: E402
from litkv.hf.kvzip import kvzip_compress, repeat_prompt  # noqa: E402

__all__ = ["FAMILIES", "TRANSFORMERS_RANGE", "Cache", "CacheLayer", "kvzip_compress", "repeat_prompt"]
