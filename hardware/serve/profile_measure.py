"""The measurements of ``hawk real profile``, on the workers' own code paths.

- Prefill: ``PrefillEngine.step`` over a batch of ``num_seqs`` prompts of equal length; the time
  is the engine's own ``start..end`` (what a prefill worker reports as ``prefill_start_at`` and
  ``prefill_end_at``).
- Decode: ``DecodeEngine.step`` with ``batch`` running requests, each at ``context`` tokens
  (the step attends every request's ``context`` tokens and writes its newest one), in the
  decode cache the workers build for the serving mechanism. The cache holds zeros: a step's
  cost does not depend on the values it reads. (A step pads every request's block table to
  the batch's longest, so with mixed lengths its cost follows batch x the longest context;
  the table holds the uniform case, where that is the total context.)
- Transfer: a prefill process (``python -m hardware.serve.profile_measure --serve-kv``) prefills
  requests of the swept lengths with its ``PrefillEngine`` and serves their pulls
  (``PrefillServer`` over Mooncake TCP on loopback, the workers' send buffer); this process
  pulls each one into a ``DecodeEngine``'s sink with a ``DecodeClient``, as a decode worker's
  puller does, timing ``pull`` (the span a decode worker reports as ``transfer_start_at ..
  transfer_end_at``: the prefill side's preparation, the HAWK transformation where the
  mechanism has it, the transfer and the decode side's rebuild). The process is started and
  its failures reported by ``hardware.transfer_bench.spawn``.

Every point runs once unmeasured (warm-up), then ``repeats`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np

from hardware.kv_layout import blocks_for

START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Serving:
    """What the real workers use (``hardware.serve.worker``'s defaults, which ``hawk real run``
    keeps): prefill batch budget and size, caches, send buffer, threads."""

    prefill_max_batch_tokens: int
    prefill_max_batch_size: int
    prefill_num_blocks: int
    decode_max_batch: int
    num_kv_tokens: int
    max_request_tokens: int
    kv_dtype: str
    send_buffer_mb: float
    threads: int
    transfer_timeout_s: float

    @classmethod
    def of_workers(cls) -> "Serving":
        from hardware.serve import worker
        p = argparse.ArgumentParser(allow_abbrev=False)
        worker.add_arguments(p)
        d = p.parse_args(["--role", "prefill", "--router", "127.0.0.1:1"])
        return cls(d.max_batch_tokens, d.max_batch_size, d.num_blocks, d.max_batch_size,
                   d.num_tokens, d.max_request_tokens, d.kv_dtype, d.send_buffer_mb, d.threads,
                   d.transfer_timeout_s)


def percentiles(times: list[float]) -> tuple[float, float, float]:
    """``(p50, p10, p90)`` of measured seconds."""
    p50, p10, p90 = np.percentile(np.asarray(times, np.float64), [50, 10, 90])
    return float(p50), float(p10), float(p90)


def prompts(rng: np.random.Generator, vocab: int, num_seqs: int, tokens: int) -> list[list[int]]:
    return rng.integers(0, vocab, (num_seqs, tokens)).tolist()


# -- prefill ---------------------------------------------------------------------------------
def prefill_times(engine, rng, num_seqs: int, tokens: int, repeats: int) -> list[float]:
    """``repeats`` prefills of ``num_seqs`` x ``tokens`` in one batch, after one warm-up."""
    from hardware.serve.engines import PrefillJob

    vocab, ids, times = engine.model.config.vocab_size, count(), []
    for run in range(repeats + 1):
        jobs = [PrefillJob(f"p{next(ids)}", p) for p in prompts(rng, vocab, num_seqs, tokens)]
        engine.queue.extend(jobs)
        done = engine.step()
        for j in jobs:
            engine.source.drop(j.request_id)
        assert len(done) == num_seqs, (num_seqs, tokens, len(done))   # the sweep fits budgets
        _, _, start, end = done[0]
        if run:
            times.append(end - start)
    return times


# -- decode ----------------------------------------------------------------------------------
def decode_times(engine, batch: int, context: int, repeats: int) -> list[float]:
    """``repeats`` steps of ``batch`` requests at ``context`` tokens each, after one warm-up."""
    from hardware.serve.engines import Sequence

    pool, times = engine.sink.pool, []
    seqs = [Sequence(f"d{i}", context - 1, 1, 1 << 30) for i in range(batch)]
    for s in seqs:
        if pool.alloc(s.request_id, blocks_for(context, engine.cache.block_size)) is None:
            raise MemoryError(f"decode cache too small for {batch} x {context} tokens")
    engine.running = seqs
    try:
        for run in range(repeats + 1):
            for s in seqs:
                s.tokens = [1]             # the step's position: context - 1, every time
            start = time.perf_counter()
            engine.step()
            if run:
                times.append(time.perf_counter() - start)
    finally:
        engine.running = []
        for s in seqs:
            pool.free(s.request_id)
    return times


def decode_engine(model, mechanism: str, transport, serving: Serving, num_tokens: int):
    from hardware.serve.engines import DecodeEngine
    return DecodeEngine(model, mechanism, transport, max(num_tokens, serving.num_kv_tokens),
                        serving.max_request_tokens, serving.decode_max_batch, serving.kv_dtype)


# -- transfer --------------------------------------------------------------------------------
class KVServer:
    """The prefill process holding ``lengths[L]`` prefilled requests ``"L/0"..`` of each length;
    ``pull_times`` takes them in order."""

    def __init__(self, model_dir: Path, lengths: dict[int, int], device: str, serving: Serving,
                 timeout_s: float = START_TIMEOUT_S):
        import tempfile

        from hardware.transfer_bench import spawn
        from hardware.wire import TOKEN_ENV, new_token

        self.token, self.next = new_token(), {n: 0 for n in lengths}
        self.timeout_s = serving.transfer_timeout_s
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, TOKEN_ENV: self.token, "OMP_NUM_THREADS": str(serving.threads),
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "hardware.serve.profile_measure", "--serve-kv",
               "--model", str(model_dir), "--device", device,
               "--lengths", ",".join(f"{n}:{k}" for n, k in sorted(lengths.items()))]
        self.log = tempfile.TemporaryFile()
        self.proc, hello = spawn(cmd, env, timeout_s, self.log, "the profile's prefill process")
        self.address = tuple(hello["address"])

    def pull_times(self, engine, tokens: int, repeats: int) -> list[float]:
        """``repeats`` pulls of ``tokens``-token requests into ``engine``'s sink, after one
        warm-up."""
        from hardware.protocol import DecodeClient

        sink, times = engine.sink, []
        with DecodeClient(sink.transport, sink, self.address, self.token,
                          timeout_s=self.timeout_s) as client:
            for run in range(repeats + 1):
                rid = f"{tokens}/{self.next[tokens]}"
                self.next[tokens] += 1
                sink.expect(rid, tokens, tokens + 1)
                start = time.perf_counter()
                client.pull(rid)
                elapsed = time.perf_counter() - start
                sink.free(rid)
                if run:
                    times.append(elapsed)
        return times

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def serve_kv(model_dir: str, lengths: dict[int, int], device: str) -> None:
    """The prefill process: prefill every request, print ``{"address"}``, serve pulls until
    stopped or its parent is gone (a killed profile leaves no server behind)."""
    import threading

    import torch

    from hardware.model.llama import LlamaModel
    from hardware.protocol import PrefillServer
    from hardware.serve.engines import PrefillEngine, PrefillJob
    from hardware.transport import make_transport
    from hardware.wire import token_from_env

    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    serving = Serving.of_workers()
    torch.set_num_threads(serving.threads)
    model = LlamaModel.load(model_dir, device=device)
    num_blocks = sum(k * blocks_for(n, 16) for n, k in lengths.items())
    engine = PrefillEngine(model, num_blocks, max(serving.prefill_max_batch_tokens,
                                                  max(lengths)), serving.prefill_max_batch_size)
    rng = np.random.default_rng(0)
    for n, k in sorted(lengths.items()):
        for i, p in enumerate(prompts(rng, model.config.vocab_size, k, n)):
            engine.queue.append(PrefillJob(f"{n}/{i}", p))
    while engine.queue:
        engine.step()
    transport = make_transport("mooncake", host="127.0.0.1")
    send = np.zeros(int(serving.send_buffer_mb * (1 << 20)), np.uint8)
    server = PrefillServer(transport, send, engine.source, token_from_env())
    print(json.dumps({"address": list(server.address)}), flush=True)
    server.serve_forever()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def _lengths(text: str) -> dict[int, int]:
    out = {}
    for part in text.split(","):
        n, _, k = part.partition(":")
        out[int(n)] = int(k)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--serve-kv", action="store_true")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=_lengths, required=True, help="TOKENS:COUNT,...")
    args = p.parse_args(argv)
    if not args.serve_kv:
        p.error("only --serve-kv is run this way; use `hawk real profile`")
    serve_kv(args.model, args.lengths, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
