"""Engine settings from a vLLM server log: the non-default arguments and the KV cache it allocated.

Reads the last ``non-default args: {...}`` line (the server that served the run, when the log holds
several restarts) and, after it, ``num_gpu_blocks is: N`` (V1 metrics logger) or ``GPU KV cache
size: N tokens`` and the ``vLLM ... version`` line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from servelab.common.errors import InputError

_ARGS = re.compile(r"non-default args: (\{.*\})\s*$")
_BLOCKS = re.compile(r"num_gpu_blocks is: (\d+)")
_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
_VERSION = re.compile(r"vLLM (?:API server )?version (\S+)")
ARG_KEYS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
            "tensor_parallel_size": "tp", "block_size": "block_size",
            "gpu_memory_utilization": "gpu_memory_utilization", "enable_prefix_caching": "enable_prefix_caching",
            **{k: k for k in ("data_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                              "quantization", "kv_cache_dtype")}}


def settings_from_log(path: Path) -> tuple[dict, dict]:
    """(settings for run.json's config, facts for run.json's source)."""
    if not path.is_file():
        raise InputError(path, "file not found")
    settings: dict = {}
    source: dict = {"vllm_log": str(path)}
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        m = _ARGS.search(line)
        if m:
            try:
                args = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                raise InputError(path, "cannot read the non-default args", row=lineno) from None
            settings = {ARG_KEYS[k]: v for k, v in args.items() if k in ARG_KEYS}
            served = args.get("served_model_name")
            settings["model"] = (served[0] if isinstance(served, list) and served else served) or args.get("model")
            source.pop("kv_cache_tokens", None)
            continue
        if (m := _BLOCKS.search(line)):
            settings["num_gpu_blocks"] = int(m.group(1))
        elif (m := _KV_TOKENS.search(line)):
            source["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        elif (m := _VERSION.search(line)):
            source["vllm_version"] = m.group(1)
    return settings, source
