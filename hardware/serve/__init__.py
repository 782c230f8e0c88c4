"""Real-mode serving: a router, prefill workers and decode workers in separate processes.

``tiled_cache`` (the decode side's KV cache in the NPU's tiled, per-bank layout), ``kv_path``
(the KV cache through Algorithm 1 per mechanism), ``prefill`` and ``decode`` (the workers),
``router`` (the OpenAI-compatible endpoint), ``cluster`` (start them locally) and ``run``
(``hawk real run``). Import the submodules directly; this package imports none of them.
"""
