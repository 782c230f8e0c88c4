"""vLLM's own KV blocks of one request of a sliding-window model, from its config.json alone.

Run with a python that imports vLLM (``HAWK_VLLM_PYTHON``; tests/test_sliding_window.py calls
it): reads a JSON list of cases on stdin, each ``{"config": {...}, "block_size": B,
"memory_bytes": M, "prompt": P, "output": O}``, and prints a JSON list, per case:

- the layer specs as vLLM's model runner would build them: a layer listed as
  ``"sliding_attention"`` in the config's ``layer_types`` (transformers fills it in for Gemma 2
  and Qwen2/Qwen3) gets a ``SlidingWindowSpec`` of the config's ``sliding_window``, the others
  a ``FullAttentionSpec``; without ``layer_types`` every layer takes ModelConfig's
  ``get_sliding_window()`` (Mistral's convention);
- ``get_kv_cache_configs``'s grouping of them (``vllm.v1.core.kv_cache_utils``): per group its
  layer count and the page bytes of one block of one of its layers, and the pool's blocks for
  M bytes;
- one request run through vLLM's own managers (``get_manager_for_kv_cache_spec``: a
  ``SlidingWindowManager`` or ``FullAttentionManager`` per group, on one ``BlockPool``): its
  prompt allocated in one step, then one token per decode step, each step first freeing the
  blocks that fell out of the window (``remove_skipped_blocks``, as ``allocate_slots`` does);
  the most blocks each group held at once in the decode steps, and those blocks' bytes.
"""

import json
import sys
import tempfile
from pathlib import Path


def _specs(mc, pc, bs):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    heads, size = mc.get_num_kv_heads(pc), mc.get_head_size()
    layers = mc.get_num_layers(pc)
    types = getattr(mc.hf_text_config, "layer_types", None)
    window = getattr(mc.hf_text_config, "sliding_window", None)
    if types is None:
        window = mc.get_sliding_window()
        types = ["sliding_attention" if window else "full_attention"] * layers
    full = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=size,
                             dtype=torch.bfloat16)
    sliding = (SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=size,
                                 dtype=torch.bfloat16, sliding_window=window)
               if window else full)
    return {f"model.layers.{i}.self_attn.attn": sliding if t == "sliding_attention" else full
            for i, t in enumerate(types)}


def _run_request(vc, config, bs, prompt, output):
    """Peak non-null blocks per group over the decode steps of one request."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec

    pool = BlockPool(config.num_blocks, enable_caching=False, hash_block_size=bs)
    managers = [get_manager_for_kv_cache_spec(
        g.kv_cache_spec, vc.max_in_flight_tokens, vc.model_config.max_model_len,
        block_pool=pool, enable_caching=False, kv_cache_group_id=i, scheduler_block_size=bs)
        for i, g in enumerate(config.kv_cache_groups)]
    rid, peaks = "r", [0] * len(managers)

    def step(computed, num_tokens, decode):
        for k, m in enumerate(managers):
            m.remove_skipped_blocks(rid, computed)
            m.get_num_blocks_to_allocate(rid, num_tokens, [], computed, computed, num_tokens)
            m.allocate_new_blocks(rid, num_tokens, num_tokens)
            held = sum(not b.is_null for b in m.req_to_blocks[rid])
            if decode:
                peaks[k] = max(peaks[k], held)

    step(0, prompt, False)
    for computed in range(prompt, prompt + output):
        step(computed, computed + 1, True)
    return peaks


def main() -> int:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    out = []
    for case in json.load(sys.stdin):
        bs = case["block_size"]
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "config.json").write_text(json.dumps(case["config"]))
            mc = ModelConfig(model=tmp, tokenizer=tmp, skip_tokenizer_init=True,
                             dtype="bfloat16",
                             max_model_len=case["prompt"] + case["output"] + bs)
            pc = ParallelConfig(tensor_parallel_size=1)
            cc = CacheConfig(block_size=bs)
            cc.kv_cache_layout = "LBHNC"      # any layout: it changes no byte count
            vc = VllmConfig(model_config=mc, parallel_config=pc, cache_config=cc)
            config = get_kv_cache_configs(vc, [_specs(mc, pc, bs)], [case["memory_bytes"]])[0]
            peaks = _run_request(vc, config, bs, case["prompt"], case["output"])
            groups = [{"num_layers": len(g.layer_names),
                       "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                       "page_size_bytes": g.kv_cache_spec.page_size_bytes, "peak_blocks": p}
                      for g, p in zip(config.kv_cache_groups, peaks)]
            out.append({"num_blocks": config.num_blocks, "groups": groups,
                        "request_bytes": sum(g["num_layers"] * g["page_size_bytes"]
                                             * g["peak_blocks"] for g in groups)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
