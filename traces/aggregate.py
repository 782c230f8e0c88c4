"""The summary of ``traces.metrics.summarize`` from records seen a chunk at a time.

``RecordsAggregate.add(frame)`` takes a records DataFrame of any size (a row group of a run
that streams its records) and keeps only what the summary needs: exact counts (per status,
ok, SLO met), exact minima and maxima, running float64 sums (so means agree with the
in-memory ones to rounding), and a DDSketch (the ``ddsketch`` package) per latency, which
answers percentiles with relative error ``relative_accuracy``: the value reported for the
q-th percentile of n values lies within that relative error of the sample's value of rank
floor(q (n - 1)) (``numpy.percentile(..., method="lower")``). ``summary()`` says so in its
``percentiles`` entry. Aggregates of disjoint records merge (``merge``), e.g. cells of a
cluster simulated apart.

Memory: a sketch holds one bin per factor (1 + a) / (1 - a) of value range, so ~1,000 bins
for latencies from microseconds to hours at a = 1%, whatever the number of records.
"""

from __future__ import annotations

import math

import numpy as np

from traces import metrics
from traces.schema import Status

#: the DDSketch relative accuracy of streamed percentiles
RELATIVE_ACCURACY = 0.01
#: a tenant's row (``traces.tenants.TENANT_KEYS``, its throughput apart)
_TENANT_KEYS = ("num_requests", "num_failed", "slo_attainment", "ttft_p50_s", "ttft_p90_s",
                "tpot_p90_s")


class Sketch:
    """A DDSketch fed whole arrays: values are binned with numpy by the sketch's own
    logarithmic mapping and each bin is added once with its count."""

    def __init__(self, relative_accuracy: float = RELATIVE_ACCURACY):
        from ddsketch import DDSketch

        self.sketch = DDSketch(relative_accuracy)
        mapping = self.sketch._mapping
        self._mapping = mapping
        self._multiplier, self._offset = mapping._multiplier, mapping._offset
        probe = np.geomspace(1e-9, 1e6, 997)
        if not np.array_equal(self._keys(probe), [mapping.key(v) for v in probe]):
            raise RuntimeError("ddsketch's logarithmic mapping changed; Sketch bins by it")

    def _keys(self, values: np.ndarray) -> np.ndarray:
        return (np.ceil(np.log2(values) * self._multiplier) + self._offset).astype(np.int64)

    def add(self, values: np.ndarray) -> None:
        """Add the finite values of ``values`` (NaN left out); values <= 0 count as zero."""
        values = values[~np.isnan(values)]
        small = values <= self._mapping.min_possible
        if small.any():
            self.sketch.add(0.0, float(small.sum()))
        keys, counts = np.unique(self._keys(values[~small]), return_counts=True)
        for key, count in zip(keys.tolist(), counts.tolist()):
            self.sketch.add(self._mapping.value(key), float(count))

    def merge(self, other: "Sketch") -> None:
        self.sketch.merge(other.sketch)

    def percentile(self, q: float) -> float:
        value = self.sketch.get_quantile_value(q / 100.0)
        return math.nan if value is None else float(value)


class RecordsAggregate:
    """Streaming aggregates of records: ``add`` chunks, then ``summary`` (the keys of
    ``traces.metrics.summarize``, plus ``tenants`` when records carry one)."""

    LATENCIES = ("ttft", "tpot", "e2e") + tuple(f"ttft_{s}" for s, _, _ in metrics.TTFT_STAGES)

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float,
                 relative_accuracy: float = RELATIVE_ACCURACY, per_tenant: bool = True):
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.relative_accuracy = relative_accuracy
        self.num_requests = self.num_met = self.num_generated_ok = self.kv_bytes = 0
        self.statuses = {s.value: 0 for s in Status}
        self.first_arrival_at, self.last_ok_finish_at = math.inf, -math.inf
        self.decode_span_s = 0.0           # summed first token .. finish spans (Little's law)
        self.sums = {name: 0.0 for name in self.LATENCIES}
        self.counts = {name: 0 for name in self.LATENCIES}
        self.sketches = {name: Sketch(relative_accuracy) for name in self.LATENCIES}
        self.tenants: dict[str, RecordsAggregate] | None = {} if per_tenant else None

    def add(self, frame) -> None:
        """Fold in a records DataFrame (``traces.schema`` columns)."""
        if len(frame) == 0:
            return
        ok = metrics.ok_mask(frame)
        self.num_requests += len(frame)
        for status, count in metrics.status_counts(frame).items():
            self.statuses[status] += count
        self.num_met += int(metrics.slo_met(frame, self.ttft_slo_s, self.tpot_slo_s).sum())
        self.num_generated_ok += int(frame["num_generated_tokens"].to_numpy()[ok].sum())
        self.kv_bytes += int(frame["kv_bytes"].sum())
        self.first_arrival_at = min(self.first_arrival_at, float(frame["arrival_at"].min()))
        if ok.any():
            self.last_ok_finish_at = max(self.last_ok_finish_at, float(
                np.nanmax(frame["finished_at"].to_numpy()[ok])))
        spans = (frame["finished_at"] - frame["first_token_at"]).to_numpy(dtype=float)
        self.decode_span_s += float(np.nansum(spans))
        values = {"ttft": metrics.ttft(frame), "tpot": metrics.tpot(frame),
                  "e2e": metrics.e2e(frame)}
        for stage, start, end in metrics.TTFT_STAGES:
            values[f"ttft_{stage}"] = (frame[end] - frame[start]).to_numpy(dtype=float)
        for name, v in values.items():
            v = v[ok]
            v = v[~np.isnan(v)]
            self.sums[name] += float(v.sum())
            self.counts[name] += len(v)
            self.sketches[name].add(v)
        if self.tenants is not None and "tenant" in frame.columns:
            tenants = frame["tenant"].astype(str).to_numpy()
            for tenant in np.unique(tenants).tolist():
                part = self.tenants.get(tenant)
                if part is None:
                    part = self.tenants[tenant] = RecordsAggregate(
                        self.ttft_slo_s, self.tpot_slo_s, self.relative_accuracy, False)
                part.add(frame[tenants == tenant])

    def merge(self, other: "RecordsAggregate") -> None:
        """Fold in the aggregate of other, disjoint records under the same SLOs."""
        if (other.ttft_slo_s, other.tpot_slo_s) != (self.ttft_slo_s, self.tpot_slo_s):
            raise ValueError("aggregates under different SLOs do not merge")
        for name in ("num_requests", "num_met", "num_generated_ok", "kv_bytes",
                     "decode_span_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for status, count in other.statuses.items():
            self.statuses[status] += count
        self.first_arrival_at = min(self.first_arrival_at, other.first_arrival_at)
        self.last_ok_finish_at = max(self.last_ok_finish_at, other.last_ok_finish_at)
        for name in self.LATENCIES:
            self.sums[name] += other.sums[name]
            self.counts[name] += other.counts[name]
            self.sketches[name].merge(other.sketches[name])
        if self.tenants is not None and other.tenants:
            for tenant, part in other.tenants.items():
                if tenant in self.tenants:
                    self.tenants[tenant].merge(part)
                else:
                    self.tenants[tenant] = part

    @property
    def span_s(self) -> float:
        """First arrival to the last ok request's finish (``metrics.output_tokens_per_s``)."""
        return self.last_ok_finish_at - self.first_arrival_at

    def summary(self) -> dict:
        """``metrics.summarize``'s keys, in its order; percentiles from the sketches."""
        ok = self.statuses[Status.OK.value]
        unfinished = self.statuses[Status.UNFINISHED.value]
        out = {"num_requests": self.num_requests, "num_finished": ok,
               "num_failed": self.num_requests - ok - unfinished,
               "num_unfinished": unfinished,
               "statuses": {s: n for s, n in self.statuses.items() if n},
               "ttft_slo_s": self.ttft_slo_s, "tpot_slo_s": self.tpot_slo_s,
               "slo_attainment": (self.num_met / self.num_requests if self.num_requests
                                  else math.nan)}
        for name in ("ttft", "tpot", "e2e"):
            for q in metrics.PERCENTILES:
                out[f"{name}_p{q}_s"] = self._percentile(name, q)
            out[f"{name}_mean_s"] = self._mean(name)
        span = self.span_s
        if ok:
            out["output_tokens_per_s"] = self.num_generated_ok / span if span > 0 else math.nan
            out["requests_per_s"] = ok / span if span > 0 else math.nan
        else:
            out["output_tokens_per_s"] = out["requests_per_s"] = 0.0
        out["kv_bytes_total"] = self.kv_bytes
        for stage, _, _ in metrics.TTFT_STAGES:
            out[f"ttft_{stage}_mean_s"] = self._mean(f"ttft_{stage}")
            out[f"ttft_{stage}_p90_s"] = self._percentile(f"ttft_{stage}", 90)
        out["percentiles"] = self.percentile_note()
        return out

    def tenant_rows(self) -> dict[str, dict] | None:
        """``traces.tenants.by_tenant``'s rows; None when no record carried a tenant."""
        if not self.tenants:
            return None
        span, rows = self.span_s, {}
        for tenant in sorted(self.tenants):
            part = self.tenants[tenant]
            s = part.summary()
            row = {key: s[key] for key in _TENANT_KEYS}
            row["output_tokens_per_s"] = (part.num_generated_ok / span if ok_span(span)
                                          else math.nan)
            rows[tenant] = row
        return rows

    def percentile_note(self) -> dict:
        keys = [f"{n}_p{q}_s" for n in ("ttft", "tpot", "e2e") for q in metrics.PERCENTILES]
        keys += [f"ttft_{s}_p90_s" for s, _, _ in metrics.TTFT_STAGES]
        return {"method": "ddsketch", "relative_accuracy": self.relative_accuracy,
                "approximate": keys,
                "bound": f"within {self.relative_accuracy:.0%} relative error of the sample's "
                         f"value of rank floor(q (n - 1)); counts, minima and maxima are exact, "
                         f"means are float64 running sums over the records"}

    def _mean(self, name: str) -> float:
        n = self.counts[name]
        return self.sums[name] / n if n else math.nan

    def _percentile(self, name: str, q: float) -> float:
        return self.sketches[name].percentile(q) if self.counts[name] else math.nan


def ok_span(span: float) -> bool:
    return math.isfinite(span) and span > 0
