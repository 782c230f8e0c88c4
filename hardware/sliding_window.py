"""What a model's sliding-window layers hold and attend to: ``SlidingWindowLayers``, mixed
into ``hardware.catalog.ModelSpec``.

A sliding layer attends to the last ``sliding_window`` tokens of a sequence; vLLM frees its
blocks once they fall out of the window. Each quantity is averaged or pooled over the layers,
so that it multiplies the all-layer sizes (``kv_bytes_per_token``, ``kv_block_bytes``,
``attention_flops_per_context_token``); without sliding layers each is the plain count.
"""

from __future__ import annotations


class SlidingWindowLayers:
    """Needs ``num_layers``, ``sliding_window`` and ``num_sliding_layers``."""

    @property
    def window(self) -> int:
        """The sliding window in tokens where some layers slide (0: every layer is full)."""
        return self.sliding_window if self.num_sliding_layers else 0

    def attended_tokens(self, context, num_seqs: int = 1):
        """Tokens of KV a layer holds and attends to, averaged over the layers, for
        ``num_seqs`` sequences of ``context`` tokens in all: every token on a full layer,
        min(its context, window) per sequence on a sliding one. Sequences are taken at the
        mean context: exact when all lie on one side of the window, else an upper bound (min
        is concave). ``context``: a number or a numpy array; unchanged without a window."""
        if not self.window:
            return context
        over = context - num_seqs * self.window
        return context - over * (over > 0) * (self.num_sliding_layers / self.num_layers)

    def attended_pairs(self, num_tokens: int, num_before: int = 0) -> float:
        """Causal (query, key) pairs of a prompt chunk of ``num_tokens`` after ``num_before``
        computed ones, averaged over the layers: the token at position p (from 1) attends to
        p keys on a full layer, min(p, window) on a sliding one."""
        full = num_tokens * (2 * num_before + num_tokens + 1) // 2
        w = self.window
        if not w:
            return float(full)

        def upto(x: int) -> int:          # sum of min(p, w) for p = 1..x
            return x * (x + 1) // 2 if x <= w else w * (w + 1) // 2 + (x - w) * w

        sliding = upto(num_before + num_tokens) - upto(num_before)
        return full - (full - sliding) * (self.num_sliding_layers / self.num_layers)

    def kv_blocks(self, num_tokens, block_size: int):
        """Blocks of ``block_size`` tokens over all layers that a sequence reaching
        ``num_tokens`` tokens holds at its peak (an int or an integer numpy array): a full
        layer's for every token, a sliding layer's ceil(min(n, window + block_size) /
        block_size), as vLLM frees a sliding layer's blocks once they fall before the window
        (``SlidingWindowManager.get_num_skipped_tokens``: n - window + 1 tokens skipped, in
        vllm/v1/core/single_type_kv_cache_manager.py; at most cdiv(window, block_size) + 1
        blocks, ``SlidingWindowSpec.max_admission_blocks_per_request`` in
        vllm/v1/kv_cache_interface.py, decoding one token a step). The layers' blocks are
        pooled: the ceiling of their mean."""
        full = -(-num_tokens // block_size)
        if not self.window:
            return full
        cap = self.window + block_size
        kept = -(-(num_tokens - (num_tokens - cap) * (num_tokens > cap)) // block_size)
        s, n = self.num_sliding_layers, self.num_layers
        return -(-((n - s) * full + s * kept) // n)

