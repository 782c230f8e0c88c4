"""vLLM's own KV cache sizing of models given by their config.json alone (no weights).

Run with a python that imports vLLM (``HAWK_VLLM_PYTHON``; tests/test_model_config.py calls
it): reads a JSON list of cases on stdin, each ``{"config": {...}, "tp": N, "block_size": B,
"memory_bytes": M}``, and prints a JSON list, per case: vLLM's layer count, KV heads per rank,
head size, sliding window and whether it uses MLA (``vllm.config.ModelConfig``), the page size
of one layer's block (``vllm.v1.kv_cache_interface`` specs: ``MLAAttentionSpec`` for MLA,
``SlidingWindowSpec`` on every layer where ModelConfig reads a sliding window, else
``FullAttentionSpec``), and the number of KV blocks vLLM's engine would give M bytes per rank
(``vllm.v1.core.kv_cache_utils.get_kv_cache_configs``). The layer specs are built here from
ModelConfig's answers, as the model runner builds them from its attention layers (so a model
mixing sliding and full layers is out of its reach).
"""

import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, MLAAttentionSpec,
                                            SlidingWindowSpec)

    out = []
    for case in json.load(sys.stdin):
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "config.json").write_text(json.dumps(case["config"]))
            mc = ModelConfig(model=tmp, tokenizer=tmp, skip_tokenizer_init=True,
                             dtype="bfloat16", max_model_len=4096)
            pc = ParallelConfig(tensor_parallel_size=case["tp"])
            cc = CacheConfig(block_size=case["block_size"])
            cc.kv_cache_layout = "LBHNC"      # any layout: it changes no byte count
            vc = VllmConfig(model_config=mc, parallel_config=pc, cache_config=cc)
            layers, heads = mc.get_num_layers(pc), mc.get_num_kv_heads(pc)
            size, bs, window = mc.get_head_size(), case["block_size"], mc.get_sliding_window()
            if mc.use_mla:
                spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=size,
                                        dtype=torch.bfloat16)
            elif window:
                spec = SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=size,
                                         dtype=torch.bfloat16, sliding_window=window)
            else:
                spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=size,
                                         dtype=torch.bfloat16)
            specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}
            config = get_kv_cache_configs(vc, [specs], [case["memory_bytes"]])[0]
            out.append({"num_layers": layers, "num_kv_heads": heads, "head_size": size,
                        "use_mla": bool(mc.use_mla), "page_size_bytes": spec.page_size_bytes,
                        "sliding_window": getattr(spec, "sliding_window", None),
                        "num_blocks": config.num_blocks})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
