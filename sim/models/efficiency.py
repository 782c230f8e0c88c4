"""Named efficiency factors of one device and the profile files that hold them
(``sim/profiles/*.toml``): what ``sim.models.predictor``'s roofline prices steps with."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Efficiency:
    """Named efficiency factors of one device (a profile file's table).

    The last seven default so that a profile without them times steps as before:
    ``prefill_step_overhead_s`` (None: ``step_overhead_s``), the fixed cost of a step with a
    prompt chunk; ``prefill_attention_efficiency`` (None: ``prefill_compute_efficiency``),
    the causal attention's FLOPs rate in prefill; ``decode_per_seq_s``, host work per sequence
    per decode step (sampling, input and block-table preparation); ``allreduce_hop_latency_s``,
    the latency of each of a ring all-reduce's 2 (tp - 1) steps (the alpha of the alpha-beta
    model; ``allreduce_latency_s`` is paid once per all-reduce); ``allreduce_overlap``, the share
    of the all-reduce time hidden under the step's compute and memory time (0: issued on the
    same stream after its matmul, as vLLM and tt-metal do); ``host_overlap``, whether the
    host's work of a step (``step_overhead_s`` or ``prefill_step_overhead_s``, and
    ``decode_per_seq_s`` per sequence) runs ahead of the device's, asynchronously, so that a
    step takes the longer of the two (``sim.models.rooflines.HostBoundRoofline``) instead of
    their sum."""

    prefill_compute_efficiency: float
    prefill_memory_efficiency: float
    decode_compute_efficiency: float
    decode_memory_efficiency: float
    step_overhead_s: float
    allreduce_latency_s: float
    allreduce_bus_gb_s: float = 0.0          # ring all-reduce bus bandwidth; 0: the catalog's
                                             # tp_link_gb_s
    decode_attention_efficiency: float = 0.0  # KV reads in decode attention; 0: as the weights
                                             # (decode_memory_efficiency)
    prefill_step_overhead_s: float | None = None
    prefill_attention_efficiency: float | None = None
    decode_per_seq_s: float = 0.0
    allreduce_hop_latency_s: float = 0.0
    allreduce_overlap: float = 0.0
    host_overlap: bool = False

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if value is None and name in _OPTIONAL:
                continue
            if name == "host_overlap":
                if not isinstance(value, bool):
                    raise ValueError(f"profile: host_overlap = {value!r} must be true or false")
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"profile: {name} = {value!r} must be a number")
            if name in _ZERO_DEFAULT:
                if not 0.0 <= value <= 1e4:
                    raise ValueError(f"profile: {name} = {value} must be >= 0 (0: the default)")
                if name.endswith("efficiency") and value > 1.0:
                    raise ValueError(f"profile: {name} = {value} must be in (0, 1]")
                continue
            if name == "allreduce_overlap" and not 0.0 <= value <= 1.0:
                raise ValueError(f"profile: {name} = {value} must be in [0, 1]")
            if name.endswith("efficiency") and not 0.0 < value <= 1.0:
                raise ValueError(f"profile: {name} = {value} must be in (0, 1]")
            if name.endswith("_s") and not 0.0 <= value <= 10.0:
                raise ValueError(f"profile: {name} = {value} must be in [0, 10] seconds")

    @property
    def prefill_overhead_s(self) -> float:
        """The fixed cost of a step that holds a prompt chunk."""
        return (self.step_overhead_s if self.prefill_step_overhead_s is None
                else self.prefill_step_overhead_s)


_OPTIONAL = ("prefill_step_overhead_s", "prefill_attention_efficiency")
_ZERO_DEFAULT = ("allreduce_bus_gb_s", "decode_attention_efficiency")


@lru_cache(maxsize=None)
def load_profile_table(name: str = "paper") -> dict:
    """The raw tables of profile ``name`` (``sim/profiles/<name>.toml``) or of a TOML path."""
    if name.endswith(".toml"):
        try:
            with open(name, "rb") as f:
                return tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"profile file {name!r} not found") from None
    path = resources.files("sim").joinpath("profiles", f"{name}.toml")
    if not path.is_file():
        raise ValueError(f"unknown profile {name!r}")
    return tomllib.loads(path.read_text())


def load_profile(name: str = "paper") -> dict[str, Efficiency]:
    """Efficiency factors per device key: the ``[efficiency.<device>]`` tables of a profile."""
    table = load_profile_table(name).get("efficiency", {})
    fields = Efficiency.__dataclass_fields__
    return {key: Efficiency(**{k: v for k, v in value.items() if k in fields})
            for key, value in table.items()}
