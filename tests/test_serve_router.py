"""The router's bookkeeping without processes: routing, losing a worker mid-request, and the
drops that keep workers from holding KV for requests that already failed."""

import json
import struct

import pytest

from hardware.serve.router import Router, Worker


class FakeWriter:
    """Collects the frames the router writes to one worker."""

    def __init__(self):
        self.frames = []

    def write(self, data: bytes) -> None:
        (n,) = struct.unpack("!I", data[:4])
        self.frames.append(json.loads(data[4:4 + n]))

    def ops(self):
        return [(f["op"], f.get("rid")) for f in self.frames]


def make_router(num_prefill=2, num_decode=2):
    router = Router("x" * 32, vocab_size=1024, max_context=512, routing="round_robin")
    for role, n in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(n):
            router.workers[role][i] = Worker(role, i, FakeWriter(),
                                             {"pull_address": ["127.0.0.1", 9000 + i]})
    return router


def events(tracked):
    out = []
    while not tracked.events.empty():
        out.append(tracked.events.get_nowait())
    return out


def test_losing_a_prefill_worker_fails_only_the_requests_it_was_prefilling():
    router = make_router()
    a, b = router.submit([1, 2, 3], 4), router.submit([4, 5], 2)      # prefill 0 and 1
    assert (a.prefill, b.prefill) == (0, 1)
    router._lost(router.workers["prefill"][1])
    assert (a.status, b.status) == ("unfinished", "failed_instance_lost")
    assert events(b) == [("error", "failed_instance_lost: prefill worker 1 lost")]
    assert ("drop", b.rid) in router.workers["decode"][b.decode].writer.ops()
    assert router.alive("prefill") == [router.workers["prefill"][0]]
    c = router.submit([7], 1)                                           # the rest still served
    assert c.prefill == 0 and c.status == "unfinished"


def test_losing_a_decode_worker_fails_its_requests_and_frees_kv_held_for_them():
    router = make_router()
    a, b = router.submit([1, 2, 3], 4), router.submit([4, 5], 2)      # decode 0 and 1
    p0 = router.workers["prefill"][0]
    router.on_event(p0, {"ev": "prefilled", "rid": a.rid, "first_token": 9,
                         "prefill_start_at": 1.0, "prefill_end_at": 2.0})
    assert ("decode", a.rid) in router.workers["decode"][0].writer.ops()
    router._lost(router.workers["decode"][0])
    assert a.status == "failed_instance_lost" and "decode worker 0 lost" in a.error
    assert b.status == "unfinished"
    # b's prefill finishes after its decode worker is gone: its KV is dropped, b fails
    router._lost(router.workers["decode"][1])
    p1 = router.workers["prefill"][1]
    router.on_event(p1, {"ev": "prefilled", "rid": b.rid, "first_token": 3,
                         "prefill_start_at": 1.0, "prefill_end_at": 2.0})
    assert b.status == "failed_instance_lost" and ("drop", b.rid) in p1.writer.ops()
    with pytest.raises(LookupError, match="0 decode"):
        router.submit([1], 1)


def test_tokens_and_finish_fill_the_record():
    router = make_router(1, 1)
    r = router.submit([1, 2], 2)
    p, d = router.workers["prefill"][0], router.workers["decode"][0]
    router.on_event(p, {"ev": "prefilled", "rid": r.rid, "first_token": 5,
                        "prefill_start_at": 1.0, "prefill_end_at": 2.0})
    router.on_event(d, {"ev": "transferred", "rid": r.rid, "transfer_start_at": 2.5,
                        "transfer_end_at": 3.0, "kv_bytes": 4096})
    router.on_event(d, {"ev": "tokens", "at": 3.5, "items": [[r.rid, 5]], "finished": []})
    router.on_event(d, {"ev": "tokens", "at": 4.0, "items": [[r.rid, 8]],
                        "finished": [r.rid]})
    rec = router.record(r)
    assert (rec["status"], rec["num_generated_tokens"], rec["kv_bytes"]) == ("ok", 2, 4096)
    assert [rec[k] for k in ("prefill_start_at", "prefill_end_at", "transfer_start_at",
                             "transfer_end_at", "first_token_at", "finished_at")] == \
        [1.0, 2.0, 2.5, 3.0, 3.5, 4.0]
    assert events(r) == [("token", 5), ("token", 8), ("done", None)]
    assert p.load == 0 and d.load == 0


@pytest.mark.parametrize("body, message", [
    ({"prompt": []}, "non-empty list"),
    ({"prompt": [1, 2], "max_tokens": True}, "max_tokens True"),
    ({"messages": "hi"}, "messages"),
    ({"prompt": [1] * 510, "max_tokens": 3}, "context of 512"),
])
def test_bad_bodies_name_the_field(body, message):
    router = make_router(1, 1)
    with pytest.raises(ValueError, match=message):
        router.parse(body, chat="messages" in body)
