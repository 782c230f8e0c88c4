"""Decode-side KV admission: how many blocks a request reserves, and what happens when full.

A decode instance pulls a request's KV cache only once the blocks it reserves are free. The
policies differ in what they reserve and whether anything grows afterwards (``ADMISSION``,
chosen by ``[cluster.decode] admission``):

- ``on-demand-recompute`` (default), ``on-demand-swap``: vLLM's paged allocation. A pull
  reserves the blocks of the context it lands with (prompt + the first token); a running
  request takes one more block each time its context crosses a block boundary. When a step
  cannot get the blocks it needs, the most recently admitted running request is preempted
  (vLLM v1's ``schedule()``), and in a step that preempted nobody new joins the batch. As
  vLLM takes a waiting request only while fewer than ``max_num_seqs`` run, a decode instance
  pulls (or restores) a request only while fewer than its batch size hold KV there.
  A preempted request goes to the head of the instance's queue and, once its whole context
  fits again, gets its KV cache back:

  * *recompute*: the decode instance recomputes the KV of the tokens it had (prompt and the
    tokens generated so far) in one prefill-like pass, priced by the decode instance's own
    predictor (``prefill_time``); the batch waits for it. Re-pulling from the prefill side is
    no option: the prefill instance freed its copy when the first pull landed, and the tokens
    generated on the decode side never existed there.
  * *swap*: the KV is copied to host memory over the decode node's PCIe when preempted and
    back when resumed; each copy stalls the batch for ``bytes / (PCIe bandwidth x tp)``.

- ``reserve-max``: a pull reserves the longest context any request may reach (the model's
  context, or the whole pool if smaller): no preemption, and a batch of one where the pool
  holds one such context. Static reservation as engines without paging did it.
- ``oracle-reserve``: a pull reserves prompt + true output at once; nothing grows and nothing
  is preempted. It needs the output length before it is generated, so no real engine can do
  it; it is kept to reproduce earlier results and for comparison.

GN-Direct's single staging buffer (``sim.engine.memory.SingleBufferPool``) lays each request out
whole when its KV lands, so with it every policy reserves prompt + output (``oracle-reserve``).

The functions here are pure: the simulator keeps the state and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Admission:
    name: str
    on_demand: bool          # blocks grow with the context (and running requests may be preempted)
    preemption: str | None   # "recompute" or "swap" (on-demand policies), else None


ADMISSION: dict[str, Admission] = {
    "on-demand-recompute": Admission("on-demand-recompute", True, "recompute"),
    "on-demand-swap": Admission("on-demand-swap", True, "swap"),
    "reserve-max": Admission("reserve-max", False, None),
    "oracle-reserve": Admission("oracle-reserve", False, None),
}
DEFAULT_ADMISSION = "on-demand-recompute"


def reserve_tokens(admission: Admission, num_prompt_tokens: int, num_output_tokens: int,
                   num_context_tokens: int, max_tokens: int) -> int:
    """Tokens of KV a pull (or a resume) reserves blocks for.

    ``num_context_tokens``: the context the request lands with (prompt + tokens generated so
    far: prompt + 1 on its first pull); ``max_tokens``: the longest context any request may
    reach on this instance."""
    if admission.on_demand:
        return num_context_tokens
    if admission.name == "reserve-max":
        return max(max_tokens, num_context_tokens)
    return num_prompt_tokens + num_output_tokens


def steps_until_full(contexts: np.ndarray, free_blocks: int, block_size: int,
                     max_steps: int) -> int:
    """How many decode steps a fixed batch can run before a step needs a block none is free.

    ``contexts[i]``: the tokens request ``i`` holds KV for in the next step (it already holds
    ``ceil(contexts[i] / block_size)`` blocks); each step adds one token to every request.
    ``free_blocks``: blocks free beyond those. Returns ``s`` in [0, max_steps]: steps 0..s-1
    get their blocks, step ``s`` would not (``s == max_steps``: the whole run fits).

    Request ``i`` takes its next block at step ``r_i + 1``, ``r_i`` the free token slots in
    its last block, then every ``block_size`` steps; so the (F+1)-th block taken, the first
    that does not fit, comes in round ``F // n`` at the ``(F % n)``-th smallest ``r_i + 1``.
    """
    n = len(contexts)
    if n == 0:
        return max_steps
    slack = np.sort((-np.asarray(contexts, dtype=np.int64)) % block_size)
    rounds, rest = divmod(int(free_blocks), n)
    first_short = rounds * block_size + int(slack[rest]) + 1
    return min(max_steps, first_short)


def pick_victim(admitted_in_order) -> int:
    """The running request to preempt: the most recently admitted (vLLM v1)."""
    return next(reversed(admitted_in_order))
