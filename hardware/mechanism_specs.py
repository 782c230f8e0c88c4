"""The KV transfer mechanisms, named once: the paper's four (Figure 9) and the two designs it
compares HAWK against.

Each entry says where the KV cache goes, which way it travels, what happens to its layout and
which transfer plan of ``hardware.mechanism_plans`` moves it. The simulator prices these entries
(``sim.models.transfer``); the real path runs the ones marked ``real`` on actual bytes
(``hardware.mechanisms``, ``hardware.serve``).

- ``GG-Host``: GPU -> host -> network -> host -> GPU (host staging, same layout).
- ``GN-Host``: GPU -> host -> network -> host -> NPU, with the TILE re-layout on the
  destination side.
- ``GG-Direct``: GPU -> GPU one-sided RDMA, one write per run of adjacent GPU blocks (Mooncake).
- ``GN-HAWK``: the GPU tilizes, packs and regroups by NPU DRAM bank, then one write per bank.
- ``GN-Direct``: the raw tokens into one contiguous NPU buffer, then a re-layout on the NPU.
- ``GN-PerPage``: tilized and packed on the GPU, then one write per tile page (priced only).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mechanism:
    """How one mechanism moves the KV cache. ``plan`` names its builder in
    ``hardware.mechanism_plans``."""

    name: str
    source: str          # "gpu"
    destination: str     # "gpu" or "npu"
    path: str            # "host" (staged through both hosts) or "direct" (RDMA device to device)
    layout: str          # "same", "gpu_transform", "npu_relayout" or "relayout" (host or NPU)
    plan: str
    pool: str            # decode-side memory pool: "block", "hawk" or "single_buffer"
    real: bool = True    # runs on real bytes (hardware.mechanisms), not only priced

    @property
    def host_staged(self) -> bool:
        return self.path == "host"


MECHANISMS: dict[str, Mechanism] = {
    "GG-Host": Mechanism("GG-Host", "gpu", "gpu", "host", "same", "host_staged", "block"),
    "GN-Host": Mechanism("GN-Host", "gpu", "npu", "host", "relayout", "host_staged", "block"),
    "GG-Direct": Mechanism("GG-Direct", "gpu", "gpu", "direct", "same", "per_gpu_block_merged",
                           "block"),
    "GN-HAWK": Mechanism("GN-HAWK", "gpu", "npu", "direct", "gpu_transform", "hawk", "hawk"),
    "GN-Direct": Mechanism("GN-Direct", "gpu", "npu", "direct", "npu_relayout", "single_buffer",
                           "single_buffer"),
    "GN-PerPage": Mechanism("GN-PerPage", "gpu", "npu", "direct", "gpu_transform", "per_page",
                            "hawk", real=False),
}

#: the mechanisms the real path runs, in the order the transfer benchmark reports them
REAL_MECHANISMS: tuple[str, ...] = ("GG-Host", "GN-Host", "GG-Direct", "GN-Direct", "GN-HAWK")
assert set(REAL_MECHANISMS) == {n for n, m in MECHANISMS.items() if m.real}
