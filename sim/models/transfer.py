"""Transfer pricing: what moving one request's KV cache costs under each mechanism.

A mechanism (``hardware.mechanism_specs.MECHANISMS``, the one table of them) is one of the
transfer plans of ``hardware.mechanism_plans`` plus the copies around it. ``GN-Host`` re-lays
out on the destination host (``relayout_at = "host"``) or on the NPU (``"npu"``).

``MechanismPricing.price(num_tokens)`` returns a ``TransferCost``: seconds the prefill engine
spends saving the KV for a host-staged mechanism (``save_s``: device-to-host copy and the copy
into the network buffer; vLLM's KV connector API blocks the forward pass on them, its
``wait_for_save``, so the prefill instance pays them before its next batch), seconds before the
bytes go on the NIC, bytes through the NIC, seconds after they land, and which of those seconds queue
on a node's host (``source_host_s``, ``dest_host_s``: the host CPU and the node's PCIe root are
one FIFO server per node, ``sim.engine.link.HostQueue``, so concurrent host-staged copies and host
re-layouts wait for each other instead of overlapping for free), host CPU seconds that disturb
decode on the destination node, and the write count. Counts and bytes come from
``plan_counts``, a closed form of the plans' counts for a contiguous allocation (tests check
it equal to ``hardware.mechanism_plans``); prices are memoised per token count.

Every device-side step runs on the ``tp`` devices of an instance in parallel; the host copies
of a node are serial on its host. One time base: each resource has its own cost, from the
profile's ``[transfer]`` table, and nothing multiplies them all. The wire runs at
``TransferParams.wire_gb_s(mechanism)``: the NIC's line rate when it reads host memory, and
``rdma_read_gb_s`` when it reads GPU memory directly (GPUDirect RDMA through the node's PCIe
root complex, where GPU and NIC share no PCIe switch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache

from hardware.catalog import DeviceSpec, ModelSpec, dtype_bytes, lookup
from hardware.dram import DramConfig, GiB
from hardware.kv_layout import blocks_for
from hardware.mechanism_specs import MECHANISMS, Mechanism
from hardware.tiles import TILE, tile_format

GB = 1e9


def mechanism(name: str) -> Mechanism:
    return lookup(MECHANISMS, name, "transfer mechanism")


@dataclass(frozen=True)
class TransferParams:
    """The profile's ``[transfer]`` table (units in the names; see sim/profiles/paper.toml)."""

    nic_bandwidth_gb_s: float = 22.5
    request_setup_s: float = 0.005
    per_write_s: float = 1e-7
    gpu_pcie_gb_s: float = 25.0
    npu_pcie_gb_s: float = 25.0
    host_copy_gb_s: float = 8.0
    host_copy_setup_s: float = 5e-5
    transform_fixed_s: float = 8e-4
    transform_memory_efficiency: float = 0.5
    relayout_at: str = "host"
    host_relayout_gb_s: float = 1.2
    host_relayout_fixed_s: float = 0.05
    npu_relayout_memory_efficiency: float = 0.3
    npu_relayout_fixed_s: float = 0.01
    host_slowdown: float = 1.5
    single_buffer_bank_gb: float = 3.98
    rdma_read_gb_s: float = 22.5

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "relayout_at":
                if value not in ("host", "npu"):
                    raise ValueError(f"[transfer] relayout_at must be 'host' or 'npu', got "
                                     f"{value!r}")
            elif not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"[transfer] {f.name} must be a number >= 0, got {value!r}")
        if self.host_slowdown < 1.0:
            raise ValueError(f"[transfer] host_slowdown {self.host_slowdown} must be >= 1")
        for name in ("nic_bandwidth_gb_s", "rdma_read_gb_s", "gpu_pcie_gb_s", "npu_pcie_gb_s",
                     "host_copy_gb_s", "host_relayout_gb_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"[transfer] {name} must be > 0 GB/s, got {getattr(self, name)}")

    @property
    def link_gb_s(self) -> float:
        """The NIC's line rate (GB/s): what a node's NIC moves from host memory."""
        return self.nic_bandwidth_gb_s

    def wire_gb_s(self, name: str) -> float:
        """The rate one transfer of mechanism ``name`` can use on the wire: the NIC's line rate
        from host memory; for a direct mechanism the NIC reads GPU memory through the PCIe root
        complex, at ``rdma_read_gb_s`` (never above the line rate)."""
        if mechanism(name).host_staged:
            return self.nic_bandwidth_gb_s
        return min(self.nic_bandwidth_gb_s, self.rdma_read_gb_s)

    @classmethod
    def from_table(cls, table: dict) -> "TransferParams":
        names = {f.name for f in fields(cls)}
        if "time_scale" in table:
            raise ValueError("[transfer] time_scale is gone: every resource has its own cost "
                             "(rdma_read_gb_s, host_copy_gb_s, ...); remove the key")
        unknown = set(table) - names - {"sources"}
        if unknown:
            raise ValueError(f"[transfer]: unknown key(s) {sorted(unknown)}; allowed: "
                             f"{sorted(names)}")
        return cls(**{k: v for k, v in table.items() if k in names})


@dataclass(frozen=True)
class InstanceFacts:
    """What pricing needs to know of one side: its devices, TP degree and KV cache format."""

    device: DeviceSpec
    tp: int
    kv_dtype: str
    block_size: int

    @property
    def num_banks(self) -> int:
        return self.device.dram_channels


@dataclass(frozen=True)
class TransferCost:
    """One request's transfer, split where the simulator needs it (seconds and bytes)."""

    before_s: float      # source side before the NIC: setup, posting, transformation, D2H copy
    wire_bytes: float    # bytes through the NIC (bandwidth shared among concurrent transfers)
    after_s: float       # destination side after landing: H2D copy, re-layout
    host_cpu_s: float    # host CPU work on the destination node that slows its decode steps
    num_writes: int      # writes (RDMA requests or host sends) over all devices
    source_host_s: float = 0.0   # the part of before_s that queues on the source node's host
    dest_host_s: float = 0.0     # the part of after_s that queues on the destination's host
    save_s: float = 0.0          # paid by the prefill engine before its batch ends (host-staged)


@dataclass(frozen=True)
class PlanCounts:
    """Counts and bytes of one device's plan (``hardware.mechanism_plans``) for a contiguous
    allocation."""

    num_writes: int
    wire_bytes: int            # bytes the plan moves (per device)
    token_bytes: int           # the request's raw tokens in the GPU dtype (per device)
    transform_in_bytes: int    # read by the GPU transformation (whole GPU blocks)
    relayout_out_bytes: int    # TILE pages the NPU tensor takes (0 for a GPU destination)


def plan_counts(mech: Mechanism, model: ModelSpec, prefill: InstanceFacts,
                decode: InstanceFacts, num_tokens: int, bank_bytes: int = 0) -> PlanCounts:
    """Closed form of one destination device's plan counts for ``num_tokens`` tokens; a
    sliding-window layer sends only the last ``min(num_tokens, window)`` of them (the decode
    side attends to no others; its plan counted as one more run of tensors).

    Assumes contiguous block tables on both sides (each allocator tries one run). For the
    single buffer the staging buffer starts at address 0 of a chip with ``bank_bytes`` per bank.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens {num_tokens} must be > 0")
    window, sliding = model.window, model.num_sliding_layers
    if window and num_tokens > window:     # sliding layers send only their window's tokens
        per_layer = model.kv_tensors_per_layer
        part = _counts(mech, model, prefill, decode, window, per_layer * sliding, bank_bytes)
        if sliding == model.num_layers:
            return part
        full = _counts(mech, model, prefill, decode, num_tokens,
                       per_layer * (model.num_layers - sliding), bank_bytes)
        return PlanCounts(*(getattr(full, f.name) + getattr(part, f.name)
                            for f in fields(PlanCounts)))
    return _counts(mech, model, prefill, decode, num_tokens,
                   model.kv_tensors_per_layer * model.num_layers, bank_bytes)


def _counts(mech: Mechanism, model: ModelSpec, prefill: InstanceFacts, decode: InstanceFacts,
            num_tokens: int, tensors: int, bank_bytes: int) -> PlanCounts:
    """``plan_counts`` for ``tensors`` KV tensors (of all layers) of ``num_tokens`` tokens."""
    heads = 1 if model.kv_replicated else _heads_per_device(model.num_kv_heads, decode.tp)
    d = model.kv_head_size
    elem = dtype_bytes(prefill.kv_dtype)
    gpu_blocks = blocks_for(num_tokens, prefill.block_size)
    gpu_block_bytes = int(prefill.block_size * heads * d * elem)
    token_bytes = int(tensors * num_tokens * heads * d * elem)
    transform_in = tensors * gpu_blocks * gpu_block_bytes
    if mech.destination == "gpu":
        if mech.plan == "host_staged":
            return PlanCounts(tensors, token_bytes, token_bytes, 0, 0)
        return PlanCounts(tensors, transform_in, token_bytes, transform_in, 0)
    page = tile_format(decode.kv_dtype).tile_bytes
    pages = blocks_for(num_tokens, decode.block_size) * heads * (decode.block_size // TILE) * -(-d // TILE)
    out = tensors * pages * page
    if mech.plan == "hawk":
        stride = DramConfig(max(decode.num_banks, 1)).aligned(page)
        return PlanCounts(tensors * min(decode.num_banks, pages), tensors * pages * stride,
                          token_bytes, transform_in, out)
    if mech.plan == "per_page":
        return PlanCounts(tensors * pages, out, token_bytes, transform_in, out)
    if mech.plan == "single_buffer":
        writes = tensors + _bank_cuts(token_bytes, token_bytes // tensors, bank_bytes)
        return PlanCounts(writes, token_bytes, token_bytes, 0, out)
    return PlanCounts(tensors, token_bytes, token_bytes, 0, out)        # host_staged


def _heads_per_device(num_kv_heads: int, tp: int) -> int:
    if num_kv_heads % tp:
        raise ValueError(f"num_kv_heads {num_kv_heads} is not divisible by decode tp {tp}")
    return num_kv_heads // tp


def _bank_cuts(total: int, tensor: int, bank_bytes: int) -> int:
    """Bank boundaries strictly inside [0, total) that are not also tensor boundaries."""
    if bank_bytes <= 0:
        return 0
    inside = (total - 1) // bank_bytes
    both = (total - 1) // _lcm(bank_bytes, tensor)
    return inside - both


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


class MechanismPricing:
    """Prices one mechanism between a prefill and a decode instance; ``price`` is memoised."""

    def __init__(self, name: str, model: ModelSpec, prefill: InstanceFacts,
                 decode: InstanceFacts, params: TransferParams):
        self.mechanism = mechanism(name)
        if self.mechanism.destination == "npu" and decode.device.kind != "npu":
            raise ValueError(f"mechanism {name} needs an NPU decode device, got "
                             f"{decode.device.key!r}")
        if self.mechanism.destination == "gpu" and decode.device.kind != "gpu":
            raise ValueError(f"mechanism {name} needs a GPU decode device, got "
                             f"{decode.device.key!r}")
        self.model, self.prefill, self.decode, self.params = model, prefill, decode, params
        self._bank_bytes = int(params.single_buffer_bank_gb * GiB)
        # unbounded: the keys are prompt lengths, so the memo stays as small as the longest
        # context (and a hit skips the bounded cache's bookkeeping)
        self.price = cache(self._price)
        #: prompt tokens -> seconds the prefill engine spends saving them (host-staged only)
        self.save_time = self._save_time if self.mechanism.host_staged else None

    def _save_time(self, num_tokens: int) -> float:
        return self.price(num_tokens).save_s

    def counts(self, num_tokens: int) -> PlanCounts:
        return plan_counts(self.mechanism, self.model, self.prefill, self.decode, num_tokens,
                           self._bank_bytes)

    def _price(self, num_tokens: int) -> TransferCost:
        m, p, tp = self.mechanism, self.params, self.decode.tp
        c = self.counts(int(num_tokens))
        before = p.request_setup_s + c.num_writes * p.per_write_s
        after = host = src_host = dst_host = 0.0   # src_host: none queue at pull time now
        save = 0.0
        if m.host_staged:
            save = p.host_copy_setup_s + c.token_bytes / (p.gpu_pcie_gb_s * GB)
            save += tp * c.token_bytes / (p.host_copy_gb_s * GB)
            after = host = dst_host = self._host_after(c)
            if p.relayout_at == "npu" and m.destination == "npu":
                dst_host -= self._npu_relayout(c)      # that part runs on the NPU
        elif m.layout == "gpu_transform":
            gpu_bw = self.prefill.device.memory_bandwidth_gb_s * GB
            moved = c.transform_in_bytes + c.wire_bytes
            before += p.transform_fixed_s + moved / (gpu_bw * p.transform_memory_efficiency)
        elif m.layout == "npu_relayout":
            after = self._npu_relayout(c)
        return TransferCost(before, float(tp * c.wire_bytes), after, host, tp * c.num_writes,
                            src_host, dst_host, save)

    def _host_after(self, c: PlanCounts) -> float:
        """Destination host: copy out of the receive buffer, H2D, and the re-layout if any."""
        p, tp = self.params, self.decode.tp
        t = p.host_copy_setup_s + tp * c.token_bytes / (p.host_copy_gb_s * GB)
        if self.mechanism.destination == "gpu":
            return t + c.token_bytes / (p.gpu_pcie_gb_s * GB)
        if p.relayout_at == "host":
            t += p.host_relayout_fixed_s + tp * c.token_bytes / (p.host_relayout_gb_s * GB)
            return t + c.relayout_out_bytes / (p.npu_pcie_gb_s * GB)
        return t + c.token_bytes / (p.npu_pcie_gb_s * GB) + self._npu_relayout(c)

    def _npu_relayout(self, c: PlanCounts) -> float:
        npu_bw = self.decode.device.memory_bandwidth_gb_s * GB
        moved = c.token_bytes + c.relayout_out_bytes
        return self.params.npu_relayout_fixed_s + moved / (
            npu_bw * self.params.npu_relayout_memory_efficiency)

    @property
    def host_slowdown(self) -> float:
        return host_slowdown(self.mechanism.name, self.params)


def isolated_latency(cost: TransferCost, nic_bandwidth_bytes_s: float) -> float:
    """One transfer alone on the link: from the decode side's request to the KV in its pool.
    ``nic_bandwidth_bytes_s``: the mechanism's wire rate (``TransferParams.wire_gb_s``). A
    host-staged mechanism's save (done by the prefill engine) counts: the KV is not in the
    decode pool until it has been staged, sent and copied in."""
    if not nic_bandwidth_bytes_s > 0:
        raise ValueError(f"NIC bandwidth must be > 0 bytes/s, got {nic_bandwidth_bytes_s}")
    return (cost.save_s + cost.before_s + cost.wire_bytes / nic_bandwidth_bytes_s
            + cost.after_s)


def host_slowdown(name: str, params: TransferParams) -> float:
    """Factor on decode step time while host-staged transfers run on the destination node."""
    return params.host_slowdown if mechanism(name).host_staged else 1.0


def instance_facts(inst) -> InstanceFacts:
    """``InstanceFacts`` of a ``sim.config.InstanceConfig``."""
    from hardware import catalog

    return InstanceFacts(catalog.device(inst.device), inst.tp, inst.kv_dtype, inst.block_size)


def transfer_params(profile: str) -> TransferParams:
    """The ``[transfer]`` table of a profile (``sim/profiles/<name>.toml``)."""
    from sim.models.predictor import load_profile_table

    return TransferParams.from_table(load_profile_table(profile).get("transfer", {}))


def pricing_for(config, name: str | None = None) -> MechanismPricing:
    """The pricing of a ``RunConfig``'s mechanism (or ``name``) under its profile."""
    from hardware import catalog

    cl = config.cluster
    return MechanismPricing(name or cl.link.mechanism, catalog.model(cl.model),
                            instance_facts(cl.prefill), instance_facts(cl.decode),
                            transfer_params(cl.profile))
