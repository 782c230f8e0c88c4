"""Real-mode serving: a router, prefill workers and decode workers in separate processes.

``tiled_cache`` (the decode side's KV cache in the NPU's tiled, per-bank layout), ``kv_path``
(the KV cache through Algorithm 1 per mechanism), ``engines`` (prefill and decode compute),
``worker`` (the worker processes), ``router`` and ``openai_api`` (the endpoint), ``cluster``
(start them locally), ``run`` (``hawk real run``) and ``speed`` (single-process vs served). Import the submodules directly; this package imports none of them.
"""
