"""Single-process greedy generation: the token-exact reference for served runs.

Prefill every prompt in one batch, then decode the sequences still running one token each per
step, until each has its ``max_new_tokens``; no stop tokens, no continuous batching. Each
sequence owns a contiguous run of blocks in one paged cache sized for the whole run.
"""

from __future__ import annotations

from hardware.kv_layout import blocks_for
from hardware.model.cache import PagedKVCache


def quantize_kv(tile_dtype: str):
    """What K/V ``[..., D]`` read back as after a trip through NPU tile format ``tile_dtype``
    (block floats share an exponent per 16 elements of one token's head, so tokens quantise
    independently, as ``hardware.tiles`` packs them)."""
    import torch

    from hardware.tiles import quantize, tile_format

    tile_format(tile_dtype)

    def quantize_tensor(x):
        flat = x.detach().float().cpu().reshape(-1, x.shape[-1]).numpy()     # [N, D]
        out = torch.from_numpy(quantize(flat, tile_dtype))
        return out.reshape(x.shape).to(device=x.device, dtype=x.dtype)
    return quantize_tensor


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: list[int],
                    block_size: int = 16, kv_quantize=None) -> list[list[int]]:
    """The ``max_new_tokens[i]`` tokens ``model`` (a ``LlamaModel``) picks greedily after
    ``prompts[i]``, for every i (the prompt itself is not repeated).

    ``kv_quantize``: a function ``[N, K, D] -> [N, K, D]`` (e.g. ``quantize_kv("bfloat8_b")``)
    that the KV cache goes through as a disaggregated decode side receives it: the prompt's
    K/V once prefill is done (its first token comes from the unquantised cache, as on the
    prefill side), each decoded token's K/V as it is stored."""
    if len(prompts) != len(max_new_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
    limit = model.config.max_position_embeddings
    for i, (prompt, n) in enumerate(zip(prompts, max_new_tokens)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"max_new_tokens[{i}] {n!r} must be an integer >= 0")
        if len(prompt) + n > limit:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + {n} new exceed "
                             f"max_position_embeddings {limit}")
    outputs: list[list[int]] = [[] for _ in prompts]
    running = [i for i, n in enumerate(max_new_tokens) if n > 0]
    if not running:
        return outputs
    tables, first = {}, 0
    for i in running:
        n_blocks = blocks_for(len(prompts[i]) + max_new_tokens[i], block_size)
        tables[i] = list(range(first, first + n_blocks))
        first += n_blocks
    cache = PagedKVCache.for_model(model, num_blocks=first, block_size=block_size)
    logits = model.prefill([prompts[i] for i in running], cache, [tables[i] for i in running])
    if kv_quantize is not None:
        cache.quantize_all(kv_quantize)
    while True:
        for i, token in zip(running, logits.argmax(-1).tolist()):
            outputs[i].append(token)
        running = [i for i in running if len(outputs[i]) < max_new_tokens[i]]
        if not running:
            return outputs
        logits = model.decode([outputs[i][-1] for i in running],
                              [len(prompts[i]) + len(outputs[i]) - 1 for i in running],
                              cache, [tables[i] for i in running])
