"""The run's ledger: per-request facts as plain lists indexed by request position.

Components write instants here as they happen; at the end the ledger becomes the records
table (``traces.schema``). Lists indexed by position keep the hot path free of objects.
"""

from __future__ import annotations

import bisect
from array import array
import math

import numpy as np

from traces.schema import Status, records_frame
from traces.trace import Trace

NAN = math.nan
INSTANTS = ("prefill_start_at", "prefill_end_at", "transfer_start_at", "transfer_end_at",
            "first_token_at", "finished_at")
#: the router's rejection codes (``Router.reject_codes``) as statuses; 0: it can be served
REJECTIONS = (None, Status.REJECTED_PROMPT_TOO_LONG, Status.REJECTED_PREFILL_CAPACITY,
              Status.REJECTED_DECODE_CAPACITY)
#: a status's code (its position among ``Status``) and the records' value of each code
_CODES = {status: code for code, status in enumerate(Status)}
_VALUES = np.array([status.value for status in Status], dtype=object)
_OK_CODE = _CODES[Status.OK]
#: read once: a member read through its Enum class costs ~10x a module global (per request)
OK = Status.OK


class Ledger:
    def __init__(self, trace: Trace):
        n = len(trace)
        self.n = n
        self.trace = trace
        self.prompt: list[int] = trace.num_prompt_tokens.tolist()
        self.output: list[int] = trace.num_output_tokens.tolist()
        self.arrival_at: list[float] = trace.arrival_at.tolist()
        self.status: list[Status | None] = [None] * n
        self.prefill_instance = array("q", [-1]) * n   # integer columns, read as arrays too
        self.decode_instance = array("q", [-1]) * n
        # Instants are written once each and read back as whole columns: flat float arrays
        # turn into the records table without a per-element conversion.
        nans = array("d", [NAN]) * n
        self.prefill_start_at = array("d", nans)
        self.prefill_end_at = array("d", nans)
        self.transfer_start_at = array("d", nans)
        self.transfer_end_at = array("d", nans)
        self.first_token_at = array("d", nans)
        self.finished_at = nans
        self.join_iteration = [0] * n   # decode iteration at which the request joined
        self.num_ended = 0              # requests in a final state
        self.num_rejected = 0           # of which rejected at their arrival
        self.rejected = np.zeros(n, dtype=bool)   # rejected at arrival (the router's verdict)
        self._admitted_by: list[int] | None = None  # admitted among the first k + 1 arrivals
        self.kv_bytes = array("q", bytes(8 * n))

    def judge(self, reject_codes) -> list[Status | None]:
        """Per request, why no instance could ever serve it (``REJECTIONS``), from the
        router's ``reject_codes(prompt lengths, output lengths) -> codes`` over the trace."""
        code = reject_codes(self.trace.num_prompt_tokens, self.trace.num_output_tokens)
        self.rejected = code != 0
        if not self.rejected.any():
            return [None] * self.n
        return [REJECTIONS[c] for c in code.tolist()]

    def fail(self, i: int, status: Status, now: float) -> None:
        assert self.status[i] is None, f"request {i} already ended as {self.status[i]}"
        self.status[i] = status
        self.finished_at[i] = now
        self.num_ended += 1
        if status.value.startswith("rejected"):
            self.num_rejected += 1

    def finish(self, i: int, now: float) -> None:
        assert self.status[i] is None, f"request {i} already ended as {self.status[i]}"
        self.status[i] = OK
        self.finished_at[i] = now
        self.num_ended += 1

    def num_in_system(self, now: float) -> int:
        """Requests admitted by ``now`` and not yet ended (for Little's law). Requests rejected
        at their arrival (``rejected``, set by the router) never enter the system; the router
        may record them before or after their instant, so they are left out of the count."""
        if self._admitted_by is None:
            self._admitted_by = np.cumsum(~self.rejected).tolist()
        k = bisect.bisect_right(self.arrival_at, now)
        admitted = self._admitted_by[k - 1] if k else 0
        return admitted - (self.num_ended - self.num_rejected)

    def frame(self, cut_at: float | None = None):
        """Records table. Requests still open become ``unfinished`` only when the run was cut
        at ``cut_at``; otherwise an open request is a bug and raises. A cut run shows what had
        happened by ``cut_at``: components plan some instants ahead (a batch admitted before
        its arrival, a run of decode iterations), so later instants are blanked and a request
        that ended after the cut is ``unfinished``."""
        status = self.status
        columns = {name: getattr(self, name) for name in INSTANTS}
        if cut_at is not None:
            status = list(status)
            ended = self.finished_at
            for i, s in enumerate(status):
                if s is not None and ended[i] > cut_at:
                    status[i] = None
            columns = {name: np.where(np.frombuffer(values) > cut_at, NAN, values)
                       for name, values in columns.items()}
        try:
            codes = np.fromiter(map(_CODES.__getitem__, status), np.int8, len(status))
        except KeyError:                          # some request is in no final state
            status = list(status)
            for i, s in enumerate(status):
                if s is None:
                    if cut_at is None:
                        raise RuntimeError(f"request {self.trace.request_id[i]} ended in no "
                                           f"state") from None
                    status[i] = Status.UNFINISHED
            codes = np.fromiter(map(_CODES.__getitem__, status), np.int8, len(status))
        values = _VALUES[codes]
        outputs = self.trace.num_output_tokens
        generated = np.where(codes == _OK_CODE, outputs, 0)   # all or nothing
        return records_frame({
            "request_id": self.trace.request_id,
            "arrival_at": self.trace.arrival_at,
            "num_prompt_tokens": self.trace.num_prompt_tokens,
            "num_output_tokens": outputs,
            "status": values,
            "prefill_instance": self.prefill_instance,
            "decode_instance": self.decode_instance,
            **columns,
            "num_generated_tokens": generated,
            "kv_bytes": self.kv_bytes,
            "tenant": self.trace.tenant,              # None: the trace has no tenants
        })
