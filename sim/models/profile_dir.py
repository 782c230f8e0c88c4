"""A measured profile directory (``hawk real profile --out DIR``): reading and checking it.

The directory (docs/profile-dir.md has the whole contract)::

    DIR/profile.toml   [meta] format = 1, complete; [machine] ... stands_for_prefill,
                       stands_for_decode; [model] the tiny model's sizes; [serving] what the
                       real workers run with; [sweep], [ranges]
    DIR/prefill.csv    batch_tokens,num_seqs,seconds_p50,seconds_p10,seconds_p90,repeats
    DIR/decode.csv     batch,context_per_request,total_context,seconds_p50,...,repeats
    DIR/transfer.csv   mechanism,bytes,seconds_p50,seconds_p10,seconds_p90,repeats
    DIR/loop.csv       phase,batch,longest,total,seconds   (optional: steps inside the
                       serving loop, hardware.serve.profile_loop)

``load_profile_dir`` reads and checks it (a bad file or field raises ``ProfileDirError`` naming
the file, the line and the field). ``mirror_settings`` gives the cluster settings that make a
simulated run mirror the real mode's (``sim.config.from_dict`` fills every key a config leaves
unset with them; docs/profile-dir.md lists what matches and what does not). What a run takes
from the directory instead of the catalogs is ``sim.engine.measured``. All times are the p50 columns.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from hardware.catalog import DTYPE_BYTES, ModelSpec, devices
from hardware.serve.profile_files import FORMAT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MEASURED_MODEL = "profile"          # cluster.model when the profile is a measured directory
SECONDS = ("seconds_p50", "seconds_p10", "seconds_p90", "repeats")
COLUMNS = {"prefill.csv": ("batch_tokens", "num_seqs") + SECONDS,
           "decode.csv": ("batch", "context_per_request", "total_context") + SECONDS,
           "transfer.csv": ("mechanism", "bytes") + SECONDS}
LOOP_FILE, LOOP_COLUMNS = "loop.csv", ("phase", "batch", "longest", "total", "seconds")
MODEL_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_context")
#: [serving] keys the contract requires, and the optional ones with the real workers' defaults
#: (hardware.serve.worker: --max-batch-size 32, --num-blocks 256 of 16 tokens)
SERVING_FIELDS = ("prefill_max_batch_tokens", "decode_max_batch", "kv_block_tokens",
                  "num_kv_tokens")
SERVING_DEFAULTS = {"prefill_max_batch_size": 32, "prefill_num_blocks": 256,
                    "prefill_block_tokens": 16}
#: [serving] engine: P/D workers (``hawk real profile``), or one engine serving both phases
#: (``hawk profile --endpoint``: vLLM), simulated as an aggregated instance
ENGINES = ("disaggregated", "aggregated")


class ProfileDirError(ValueError):
    """A measured profile directory is missing, or one of its files or fields is bad (the
    configuration reports it as a ``sim.config.ConfigError``)."""


@dataclass(frozen=True)
class MeasuredProfile:
    """A checked profile directory: its tables as arrays, its settings as plain values."""

    path: str
    complete: bool
    stands_for_prefill: str
    stands_for_decode: str
    model: ModelSpec
    kv_dtype: str
    serving: dict                   # every [serving] number, optional ones filled in
    mechanisms: tuple[str, ...]
    prefill: np.ndarray             # [n, 3]: num_seqs, batch_tokens, seconds
    decode: np.ndarray              # [m, 3]: batch, total_context, seconds
    transfer: dict = field(default_factory=dict)   # mechanism -> [k, 2]: bytes, seconds
    machine: dict = field(default_factory=dict)
    #: the serving loop over the tables (loop.csv): {phase: (median ratio, steps)}; 1.0 and 0
    #: steps where the profile has no session
    loop: dict = field(default_factory=lambda: {"prefill": (1.0, 0), "decode": (1.0, 0),
                                                "transfer": (1.0, 0)})

    def kv_bytes(self, num_tokens: int) -> float:
        """One request's KV as transfer.csv counts bytes: [serving] kv_bytes_per_token per
        token where given (``hawk real profile``: the prefill worker's paged cache, every
        layer's K and V in the model's dtype), else 2 x layers x KV heads x head_dim x the
        bytes of [serving] kv_dtype."""
        per_token = self.serving.get("kv_bytes_per_token") or self.model.kv_bytes_per_token(
            self.kv_dtype)
        return per_token * num_tokens

    @property
    def default_mechanism(self) -> str:
        """The mechanism the decode table was measured with, else GN-HAWK, else the first."""
        chosen = self.serving.get("decode_mechanism")
        if chosen in self.transfer:
            return chosen
        return "GN-HAWK" if "GN-HAWK" in self.transfer else sorted(self.transfer)[0]

    def predictor(self, batch_padding: str | None = None, loop: bool = True):
        """A fresh ``TablePredictor`` of prefill.csv and decode.csv (its ``seen`` is per run),
        pricing batches as [serving] batch_padding says unless ``batch_padding`` is given,
        and (``loop``) scaled to the serving loop's step costs (``loop``)."""
        from sim.models.table import TablePredictor

        table = TablePredictor.from_points(self.prefill, self.decode,
                                           batch_padding or self.serving["batch_padding"])
        if loop:
            table.with_loop_factors(self.loop["prefill"][0], self.loop["decode"][0])
        return table


def is_profile_dir(name) -> bool:
    """Whether ``cluster.profile`` names a directory (a measured profile) rather than a
    bundled profile (``sim/profiles/<name>.toml``) or a TOML file."""
    if not isinstance(name, str) or name.endswith(".toml"):
        return False
    bundled = Path(__file__).resolve().parents[1] / "profiles" / f"{name}.toml"
    return not bundled.is_file() and Path(name).is_dir()


def load_profile_dir(path) -> MeasuredProfile:
    """Read and check ``path`` (re-read when one of its files changes: profiles are resumable)."""
    root = Path(path)
    if not root.is_dir():
        raise ProfileDirError(f"{root}: no such profile directory (hawk real profile --out "
                              f"{root} writes one)")
    stamps = tuple((name, _mtime(root / name)) for name in ("profile.toml", LOOP_FILE, *COLUMNS))
    return _load(str(root), stamps)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return -1


@lru_cache(maxsize=16)
def _load(root: str, _stamps: tuple) -> MeasuredProfile:
    base = Path(root)
    toml_path = base / "profile.toml"
    try:
        with toml_path.open("rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ProfileDirError(f"{toml_path}: missing (a profile directory holds profile.toml, "
                              f"prefill.csv, decode.csv and transfer.csv)") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileDirError(f"{toml_path}: {exc}") from None
    where = str(toml_path)
    meta = _section(doc, "meta", where)
    if meta.get("format") != FORMAT:
        raise ProfileDirError(f"{where}: [meta] format = {meta.get('format')!r}; this version "
                              f"reads format {FORMAT}")
    complete = meta.get("complete", False)
    if not isinstance(complete, bool):
        raise ProfileDirError(f"{where}: [meta] complete must be true or false, got {complete!r}")
    machine = _section(doc, "machine", where)
    stands = {}
    for role in ("prefill", "decode"):
        key = machine.get(f"stands_for_{role}")
        if key not in devices():
            raise ProfileDirError(f"{where}: [machine] stands_for_{role} = {key!r} must name a "
                                  f"catalog device: {sorted(devices())}")
        stands[role] = key
    model, kv_dtype, serving, mechanisms = _model_and_serving(doc, where)
    aggregated = serving["engine"] == "aggregated"
    tables = {name: [rec for _, rec in _read_csv(base / name, columns)]
              for name, columns in COLUMNS.items()
              if not (aggregated and name == "transfer.csv")}
    tables.setdefault("transfer.csv", [])
    prefill = np.array([[r["num_seqs"], r["batch_tokens"], r["seconds_p50"]]
                        for r in tables["prefill.csv"]], dtype=np.float64).reshape(-1, 3)
    decode = np.array([[r["batch"], r["total_context"], r["seconds_p50"]]
                       for r in tables["decode.csv"]], dtype=np.float64).reshape(-1, 3)
    transfer: dict[str, list] = {}
    for r in tables["transfer.csv"]:
        transfer.setdefault(r["mechanism"], []).append((r["bytes"], r["seconds_p50"]))
    for name, rows in (("prefill.csv", prefill), ("decode.csv", decode)):
        if len(rows) == 0:
            raise ProfileDirError(f"{base / name}: no measured points")
    if not transfer and not aggregated:
        raise ProfileDirError(f"{base / 'transfer.csv'}: no measured points")
    from sim.models.table import TablePredictor

    try:
        table = TablePredictor.from_points(prefill, decode, serving["batch_padding"])
    except ValueError as exc:
        raise ProfileDirError(f"{base}: {exc}") from None
    arrays = {}
    for mech, points in transfer.items():
        a = np.array(sorted(points), dtype=np.float64)
        if np.any(np.diff(a[:, 0]) <= 0):
            raise ProfileDirError(f"{base / 'transfer.csv'}: mechanism {mech} measures one "
                                  f"byte count twice")
        arrays[mech] = a
    profile = MeasuredProfile(root, complete, stands["prefill"], stands["decode"], model,
                              kv_dtype, serving, mechanisms, prefill, decode, arrays,
                              dict(machine))
    if aggregated:                  # one engine serves both phases: no transfer rows
        return dataclasses.replace(profile, loop=loop_factors(base / LOOP_FILE, table, None))
    transfer_table = TransferTable(arrays[profile.default_mechanism])
    return dataclasses.replace(profile, loop=loop_factors(
        base / LOOP_FILE, table, lambda tokens: transfer_table(profile.kv_bytes(tokens))))


def loop_factors(path: Path, table, transfer_time) -> dict:
    """{phase: (median of seconds / the tables' time for that step, steps)} over loop.csv's
    rows (a missing file: 1.0 and 0 steps per phase); bad rows are named by line and column.
    A transfer row is priced by ``transfer_time(tokens)`` (the session's mechanism; None:
    an aggregated profile, which has none)."""
    out = {"prefill": [], "decode": [], "transfer": []}
    rows = _read_csv(path, LOOP_COLUMNS) if path.is_file() else []
    for line, rec in rows:
        phase = rec["phase"]
        phases = "prefill or decode" if transfer_time is None else "prefill, decode or transfer"
        if phase not in out or (phase == "transfer" and transfer_time is None):
            raise ProfileDirError(f"{path}:{line}: expected {','.join(LOOP_COLUMNS)} with "
                                  f"phase {phases}, got {phase!r}")
        priced = (transfer_time(int(rec["total"])) if phase == "transfer"
                  else table.step_cost(phase, int(rec["batch"]), rec["longest"], rec["total"]))
        if priced > 0:
            out[phase].append(rec["seconds"] / priced)
    return {phase: (float(np.median(r)) if r else 1.0, len(r)) for phase, r in out.items()}


def _section(doc: dict, name: str, where: str) -> dict:
    table = doc.get(name)
    if not isinstance(table, dict):
        raise ProfileDirError(f"{where}: missing table [{name}]")
    return table


def _whole(table: dict, section: str, key: str, where: str, low: int = 1) -> int:
    value = table.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ProfileDirError(f"{where}: [{section}] {key} must be a whole number >= {low}, "
                              f"got {value!r}")
    return value


def _seconds(table: dict, key: str, where: str) -> float:
    value = table.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise ProfileDirError(f"{where}: [serving] {key} must be seconds >= 0, got {value!r}")
    return float(value)


def _model_and_serving(doc: dict, where: str):
    from sim.models.transfer import MECHANISMS

    m = _section(doc, "model", where)
    s = _section(doc, "serving", where)
    engine = s.get("engine", "disaggregated")
    if engine not in ENGINES:
        raise ProfileDirError(f"{where}: [serving] engine = {engine!r} must be one of "
                              f"{list(ENGINES)}")
    # an engine measured from outside (hawk profile --endpoint) need not know its sizes:
    # nothing in an aggregated run is priced by them (one head of one dimension stands in)
    optional = engine == "aggregated"
    sizes = {k: (_whole(m, "model", k, where) if k in m or not optional or k == "max_context"
                 else 1) for k in MODEL_FIELDS}
    if sizes["num_heads"] % sizes["num_kv_heads"]:
        raise ProfileDirError(f"{where}: [model] num_kv_heads = {sizes['num_kv_heads']} must "
                              f"divide num_heads = {sizes['num_heads']}")
    model = ModelSpec(key=MEASURED_MODEL, name=f"tiny Llama ({Path(where).parent})",
                      num_layers=sizes["num_layers"], hidden_size=sizes["hidden_size"],
                      num_heads=sizes["num_heads"], num_kv_heads=sizes["num_kv_heads"],
                      head_dim=sizes["head_dim"], ffn_size=sizes["intermediate_size"],
                      vocab_size=sizes["vocab_size"], max_context=sizes["max_context"])
    serving = {k: _whole(s, "serving", k, where) for k in SERVING_FIELDS}
    serving["engine"] = engine
    serving["api_latency_s"] = _seconds(s, "api_latency_s", where)
    serving["frontend_request_s"] = _seconds(s, "frontend_request_s", where)
    serving["frontend_token_s"] = _seconds(s, "frontend_token_s", where)
    samples = s.get("api_latency_samples_s", [])
    if not isinstance(samples, list) or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or not (
                math.isfinite(x) and x >= 0) for x in samples):
        raise ProfileDirError(f"{where}: [serving] api_latency_samples_s must be a list of "
                              f"seconds >= 0, got {samples!r:.80}")
    serving["api_latency_samples_s"] = [float(x) for x in samples]
    # the churn point (traces.endpoint_costs): what a request's coming and going costs the
    # others' steps; absent, nothing is added
    serving["request_churn_s"] = _seconds(s, "request_churn_s", where)
    for key in ("churn_batch", "churn_context"):
        serving[key] = _whole(s, "serving", key, where) if key in s else 1
    for key, default in SERVING_DEFAULTS.items():
        serving[key] = _whole(s, "serving", key, where) if key in s else default
    if "kv_bytes_per_token" in s:         # the bytes transfer.csv counts per token
        serving["kv_bytes_per_token"] = _whole(s, "serving", "kv_bytes_per_token", where)
    decode_mechanism = s.get("decode_mechanism")
    if decode_mechanism is not None and decode_mechanism not in MECHANISMS:
        raise ProfileDirError(f"{where}: [serving] decode_mechanism = {decode_mechanism!r} "
                              f"must be one of {sorted(MECHANISMS)}")
    serving["decode_mechanism"] = decode_mechanism
    from sim.models.predictor import BATCH_PADDINGS

    padding = s.get("batch_padding", "none")      # "none": older profiles, catalog devices
    if padding not in BATCH_PADDINGS:
        raise ProfileDirError(f"{where}: [serving] batch_padding = {padding!r} must be one of "
                              f"{list(BATCH_PADDINGS)}")
    serving["batch_padding"] = padding
    kv_dtype = s.get("kv_dtype")
    if kv_dtype not in DTYPE_BYTES:
        raise ProfileDirError(f"{where}: [serving] kv_dtype = {kv_dtype!r} must be one of "
                              f"{sorted(DTYPE_BYTES)}")
    mechanisms = s.get("mechanisms", [])
    if optional and mechanisms == []:
        return model, kv_dtype, serving, ()
    if (not isinstance(mechanisms, list) or not mechanisms
            or any(x not in MECHANISMS for x in mechanisms)):
        raise ProfileDirError(f"{where}: [serving] mechanisms = {mechanisms!r} must be a "
                              f"non-empty list of {sorted(MECHANISMS)}")
    return model, kv_dtype, serving, tuple(mechanisms)


#: text columns; every other column is a number > 0 (>= 0 for the context columns)
TEXT_COLUMNS, ZERO_OK = ("mechanism", "phase"), ("total_context", "context_per_request")


def _read_csv(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line, row) of one table, every number checked; errors name the file, line and
    column."""
    try:
        with path.open(newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            rows = list(enumerate(reader, start=2))
    except FileNotFoundError:
        raise ProfileDirError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ProfileDirError(f"{path}: {exc}") from None
    if header is None or [h.strip() for h in header] != list(columns):
        raise ProfileDirError(f"{path}:1: header {header!r}; expected {','.join(columns)}")
    out = []
    for line, row in rows:
        if not row:
            continue
        if len(row) != len(columns):
            raise ProfileDirError(f"{path}:{line}: {len(row)} fields, expected {len(columns)}")
        rec: dict = {}
        for name, text in zip(columns, row):
            if name in TEXT_COLUMNS:
                rec[name] = text.strip()
                continue
            try:
                value = float(text)
            except ValueError:
                value = math.nan
            if not math.isfinite(value) or value < 0 or (name not in ZERO_OK and value == 0):
                raise ProfileDirError(f"{path}:{line}: {name} = {text!r} must be a number > 0")
            rec[name] = value
        out.append((line, rec))
    return out


def mirror_settings(profile: MeasuredProfile) -> dict:
    """Dotted config keys that make the simulated cluster the real mode's: one worker per phase
    on the catalog devices they stand for (power), tp 1, the workers' batch limits and block
    sizes, a decode pull reserving prompt + output up front (the real decode worker reserves
    prompt + max_tokens, and emits exactly max_tokens), least-work routing (the router's
    default), the measured mechanism, no extra network latency (the table includes it)."""
    s = profile.serving
    if s["engine"] == "aggregated":
        return _mirror_aggregated(profile)
    out = {"cluster.model": MEASURED_MODEL, "cluster.routing": "least_work",
           "cluster.decode_routing": "least_work",
           "cluster.link.mechanism": profile.default_mechanism, "cluster.link.latency_s": 0.0}
    roles = {"prefill": (profile.stands_for_prefill, s["prefill_max_batch_size"],
                         s["prefill_block_tokens"]),
             "decode": (profile.stands_for_decode, s["decode_max_batch"], s["kv_block_tokens"])}
    for role, (device, batch, block) in roles.items():
        allowed = devices()[device].serving.kv_dtypes
        out.update({f"cluster.{role}.device": device, f"cluster.{role}.tp": 1,
                    f"cluster.{role}.num_instances": 1, f"cluster.{role}.max_batch_size": batch,
                    f"cluster.{role}.block_size": block,
                    f"cluster.{role}.kv_dtype": (profile.kv_dtype if profile.kv_dtype in allowed
                                                 else allowed[0])})
    out["cluster.prefill.max_batch_tokens"] = s["prefill_max_batch_tokens"]
    out["cluster.decode.admission"] = "oracle-reserve"
    return out


def _mirror_aggregated(profile: MeasuredProfile) -> dict:
    """One aggregated instance with the engine's scheduler limits (max_num_seqs,
    max_num_batched_tokens) and KV blocks, on the catalog device it stands for (power)."""
    s, device = profile.serving, profile.stands_for_prefill
    allowed = devices()[device].serving.kv_dtypes
    return {"cluster.model": MEASURED_MODEL, "cluster.kind": "aggregated",
            "cluster.aggregated.device": device, "cluster.aggregated.tp": 1,
            "cluster.aggregated.num_instances": 1,
            "cluster.aggregated.max_batch_size": s["decode_max_batch"],
            "cluster.aggregated.max_batch_tokens": s["prefill_max_batch_tokens"],
            "cluster.aggregated.block_size": s["kv_block_tokens"],
            "cluster.aggregated.kv_dtype": (profile.kv_dtype if profile.kv_dtype in allowed
                                            else allowed[0])}


class TransferTable:
    """Seconds to move ``bytes`` under one mechanism: piecewise-linear through the measured
    points, extrapolated by the end segments; ``seen`` keeps the span of bytes asked for."""

    def __init__(self, points: np.ndarray):
        self.bytes, self.seconds = points[:, 0], points[:, 1]
        self.range = (float(self.bytes[0]), float(self.bytes[-1]))
        self.seen: list[float] | None = None

    def __call__(self, nbytes: float) -> float:
        from sim.models.table import _line

        self.seen = [nbytes, nbytes] if self.seen is None else [
            min(self.seen[0], nbytes), max(self.seen[1], nbytes)]
        return max(0.0, float(_line(np.array([float(nbytes)]), self.bytes, self.seconds)[0]))


def describe_ranges(config) -> list[str]:
    """The measured range of every axis beside what the configured cluster can ask for (for
    ``hawk simulate --show-config``), each line ending "extrapolates" where it can go past."""
    cl = config.cluster
    profile = load_profile_dir(cl.profile)
    ranges = profile.predictor().ranges
    context = profile.model.max_context
    mech = cl.link.mechanism
    asks = [("prefill_batch_tokens", cl.prefill.max_batch_tokens, "prefill max_batch_tokens"),
            ("prefill_num_seqs", cl.prefill.max_batch_size, "prefill max_batch_size"),
            ("decode_batch", cl.decode.max_batch_size, "decode max_batch_size"),
            ("decode_total_context", cl.decode.max_batch_size * context,
             f"a full batch at the model's context {context}")]
    lines = []
    for axis, most, what in asks:
        low, high = ranges[axis]
        note = "; extrapolates" if most > high else ""
        lines.append(f"{axis}: {low:g}..{high:g} (up to {most:g}: {what}{note})")
    if mech in profile.transfer:
        points = profile.transfer[mech][:, 0]
        most = profile.kv_bytes(context)
        note = "; extrapolates" if most > points[-1] else ""
        lines.append(f"transfer_bytes ({mech}): {points[0]:g}..{points[-1]:g} (up to {most:g}: "
                     f"one request at the model's context{note})")
    for phase, (factor, steps) in profile.loop.items():
        lines.append(f"serving loop, {phase}: x{factor:.3g} the table (median of {steps} steps "
                     f"in {LOOP_FILE})" if steps else f"serving loop, {phase}: not measured "
                     f"(the table's engine time)")
    if mech != profile.default_mechanism and profile.loop["transfer"][1]:
        lines.append(f"serving loop, transfer: measured with {profile.default_mechanism}; "
                     f"{mech} is timed by its table alone")
    if not profile.complete:
        lines.append("profile incomplete (complete = false): points are still missing")
    return lines
