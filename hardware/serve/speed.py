"""Tokens/s of the tiny model single-process vs served disaggregated, same requests:
``python -m hardware.serve.speed --num-requests 50``.

The requests are the chatbot workload's, scaled to the model's context, all arriving at once
(a burst: both sides run flat out). Single-process: ``greedy_generate`` over all of them in one
batch, one torch thread. Served: a local cluster (one prefill, one decode worker, loopback,
Mooncake TCP) through the replay client; tokens/s = output tokens / (last finish - first
arrival), and the share of mean TTFT spent in the KV transfer, from worker-side instants.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--num-requests", type=int, default=50)
    p.add_argument("--mechanism", default="GN-HAWK")
    args = p.parse_args(argv)

    import torch

    from hardware.model.config import tiny_config
    from hardware.model.generate import greedy_generate
    from hardware.model.llama import LlamaModel
    from hardware.serve.cluster import ClusterConfig
    from hardware.serve.run import RealRunConfig, fit_to_context, real_run
    from traces.prompts import PromptMaker, PromptSpec
    from traces.trace import Trace
    from traces.workloads import make_workload

    base = make_workload("chatbot", 0.5, num_requests=args.num_requests, seed=0)
    burst = Trace.from_columns(np.zeros(len(base)), base.num_prompt_tokens,
                               base.num_output_tokens, name="chatbot-burst")
    trace, scale = fit_to_context(burst, 512)
    spec = PromptSpec(kind="token_ids", token_id_low=0, token_id_high=tiny_config().vocab_size)
    maker = PromptMaker(spec, int(trace.num_prompt_tokens.max()))
    prompts = [maker.prompt(i, int(n)) for i, n in enumerate(trace.num_prompt_tokens)]
    outputs = [int(n) for n in trace.num_output_tokens]

    torch.set_num_threads(1)
    model = LlamaModel.random(tiny_config(), seed=0, device="cpu")
    start = time.perf_counter()
    greedy_generate(model, prompts, outputs)
    single_s = time.perf_counter() - start

    summary = real_run(trace, RealRunConfig(ClusterConfig(mechanism=args.mechanism), 1e9, 1e9,
                                            progress=False))
    total = sum(outputs)
    print(json.dumps({
        "num_requests": len(trace), "output_tokens": total, "length_scale": scale,
        "single_process_tokens_per_s": total / single_s,
        "served_tokens_per_s": summary["output_tokens_per_s"],
        "served_ok": summary["num_finished"], "mechanism": args.mechanism,
        "ttft_mean_s": summary["ttft_mean_s"],
        "transfer_mean_s": summary["ttft_transfer_mean_s"],
        "transfer_share_of_ttft": summary["ttft_transfer_mean_s"] / summary["ttft_mean_s"],
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
