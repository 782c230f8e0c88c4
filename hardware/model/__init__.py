"""A Llama-architecture model for real mode: ``config`` (no torch), ``llama`` (the model and its
checkpoints), ``cache`` (vLLM's paged KV cache) and ``generate`` (the greedy reference run).
Import the submodules directly; this package imports none of them, so no torch."""
