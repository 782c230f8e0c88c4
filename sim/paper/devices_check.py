"""The roofline model beside published per-model figures (``check``; ``hawk devices --check``).

Each row: a published measurement of Llama 3.1 70B on a device the paper uses, the model's
value for the same setting under a profile, and the source. None of these figures is a fit
target (sim/paper/calibrate.py): they test the model from outside the paper.

Published figures (carried here so the package needs nothing else):

- tt-metal README, "LLMs" table (tenstorrent/tt-metal, README.md; release v0.59.0-rc53):
  Llama 3.1 70B (TP=4) on QuietBox (Blackhole) = 4x p150, batch 32: TTFT 195 ms,
  14.9 tokens/s/user, 476.5 tokens/s. The demo prefills one user's 128-token prompt (TTFT)
  and decodes 32 users together (tokens/s/user = 1 / step time). Batch-1 figures for this
  model and board are not published there.
- vLLM on 4x A100 80GB, Llama 3.1 70B, ShareGPT (docs/facts.md 6): TPOT mean 44.9 ms at
  1 req/s and 74 ms at 4 req/s. The batch is not published; we take Little's law with
  ShareGPT's mean output (189 tokens): batch ~ rate x 189 x TPOT, context ~ 750 + 95.
"""

from __future__ import annotations

#: (device, what, setting, published value, unit, source)
PUBLISHED = (
    ("p150a", "TTFT", {"prefill": 128}, 0.195, "s",
     "tt-metal README LLMs table, Llama 3.1 70B TP=4, QuietBox (Blackhole), v0.59.0-rc53"),
    ("p150a", "decode step (1 / tokens/s/user)", {"batch": 32, "context": 128 + 64},
     1 / 14.9, "s", "tt-metal README LLMs table, batch 32: 14.9 tokens/s/user"),
    ("a100-pcie", "TPOT at 1 req/s", {"batch": 8, "context": 845}, 0.0449, "s",
     "vLLM, 4x A100 80GB, ShareGPT (docs/facts.md 6); batch from Little's law"),
    ("a100-pcie", "TPOT at 4 req/s", {"batch": 56, "context": 845}, 0.074, "s",
     "vLLM, 4x A100 80GB, ShareGPT (docs/facts.md 6); batch from Little's law"),
)


def check(profile: str = "paper") -> list[dict]:
    """Model vs published, one row per figure of ``PUBLISHED``."""
    from sim.engine.cluster import make_predictor
    from sim.paper.experiments import base_config

    rows = []
    for device, what, setting, published, unit, source in PUBLISHED:
        name = "GN-HAWK" if device == "p150a" else "GG-Direct"
        config = base_config(name, profile=profile)
        inst = config.cluster.decode
        pred = make_predictor(config, inst)
        if "prefill" in setting:
            ours = pred.prefill_time([setting["prefill"]])
        else:
            b = setting["batch"]
            ours = pred.decode_step_time(b, b * setting["context"])
        rows.append({"device": device, "what": what, "setting": setting, "model": ours,
                     "published": published, "unit": unit, "ratio": ours / published,
                     "source": source})
    return rows
