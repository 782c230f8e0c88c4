"""``hawk devices --check``: the roofline model beside published per-model figures.

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


def register(subparsers) -> None:
    p = subparsers.add_parser("devices", help="devices under the profile's model")
    p.add_argument("--check", action="store_true",
                   help="the model beside published per-model figures, with sources")
    p.add_argument("--profile", default="paper", help="profile name or .toml path")
    p.set_defaults(func=_handler)


def _handler(args) -> int:
    if not args.check:
        print("hawk devices: pass --check to compare the model with published figures")
        return 2
    rows = check(args.profile)
    print(f"{'device':10s} {'quantity':34s} {'setting':22s} {'model':>9s} {'published':>9s} "
          f"{'ratio':>6s}  source")
    for r in rows:
        print(f"{r['device']:10s} {r['what']:34s} {_setting(r['setting']):22s} "
              f"{1e3 * r['model']:7.1f}ms {1e3 * r['published']:7.1f}ms {r['ratio']:6.2f}  "
              f"{r['source']}")
    print(f"ratio = model / published (> 1: the model is slower); profile {args.profile!r}; "
          f"none of these figures is a fit target")
    return 0


def _setting(setting: dict) -> str:
    """``{"batch": 32, "context": 192}`` as ``batch 32, context 192``."""
    if "prefill" in setting:
        return f"prompt {setting['prefill']}, batch 1"
    return f"batch {setting['batch']}, context {setting['context']}"
