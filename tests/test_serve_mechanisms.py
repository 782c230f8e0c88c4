"""Every mechanism through Algorithm 1 on the loopback transport, in one process: greedy outputs
of prefill -> pull -> decode equal the single-process reference token for token (the tiled
decode caches: the reference whose KV was quantised the same way), and nothing leaks."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hardware.mechanisms import MECHANISMS  # noqa: E402
from hardware.model.config import tiny_config  # noqa: E402
from hardware.model.generate import greedy_generate, quantize_kv  # noqa: E402
from hardware.model.llama import LlamaModel  # noqa: E402
from hardware.protocol import DecodeClient, PrefillServer, new_token  # noqa: E402
from hardware.serve.engines import DecodeEngine, PrefillEngine, PrefillJob, Sequence  # noqa: E402
from hardware.serve.kv_path import TILED  # noqa: E402
from hardware.transport.loopback import LoopbackFabric, LoopbackTransport  # noqa: E402

PROMPT_LENS = (5, 40, 17, 64, 3)
MAX_NEW = (9, 20, 1, 13, 30)


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def model(one_thread):
    return LlamaModel.random(tiny_config(), seed=11, device="cpu")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(2)
    return [rng.integers(0, 1024, n).tolist() for n in PROMPT_LENS]


def serve(model, prompts, mechanism, tt_dtype="bfloat8_b"):
    fabric = LoopbackFabric()
    p_t, d_t = LoopbackTransport(fabric), LoopbackTransport(fabric)
    token = new_token()
    prefill = PrefillEngine(model, num_blocks=24, max_batch_tokens=80, max_batch_size=3)
    send = np.zeros(1 << 20, np.uint8)
    server = PrefillServer(p_t, send, prefill.source, token).start()
    decode = DecodeEngine(model, mechanism, d_t, num_tokens=600, max_request_tokens=128,
                          max_batch_size=2, tt_dtype=tt_dtype)
    client = DecodeClient(d_t, decode.sink, server.address, token)
    outputs = {str(i): [] for i in range(len(prompts))}
    try:
        for i, p in enumerate(prompts):
            prefill.queue.append(PrefillJob(str(i), p))
            decode.sink.expect(str(i), len(p), len(p) + MAX_NEW[i])
        pending = {}
        while prefill.queue:
            for rid, first, _, _ in prefill.step():
                pending[rid] = first
        for rid, first in pending.items():
            client.pull(rid)
            decode.landed(Sequence(rid, len(prompts[int(rid)]), first, MAX_NEW[int(rid)]))
        while decode.waiting or decode.running:
            tokens, _ = decode.step()
            for rid, t in tokens:
                outputs[rid].append(t)
        leaks = (server.reserved(), client.peer_reserved(), prefill.pool.held,
                 decode.sink.pool.held, p_t.open_to_peers())
    finally:
        client.close()
        server.stop()
        decode.sink.close()
    assert leaks == ({}, [], {}, {}, [])
    assert d_t.live_regions() == [] and prefill.pool.num_free == 24
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_every_mechanism_gives_the_single_process_tokens(model, prompts, mechanism):
    got = serve(model, prompts, mechanism)
    quantise = quantize_kv("bfloat8_b") if mechanism in TILED else None
    assert got == greedy_generate(model, prompts, list(MAX_NEW), kv_quantize=quantise)


def test_bfloat16_tiles_give_the_bfloat16_quantised_tokens(model, prompts):
    got = serve(model, prompts, "GN-HAWK", tt_dtype="bfloat16")
    assert got == greedy_generate(model, prompts, list(MAX_NEW),
                                  kv_quantize=quantize_kv("bfloat16"))
