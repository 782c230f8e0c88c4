"""The roofline predictor of an efficiency (``roofline``): ``RooflinePredictor``, or
``HostBoundRoofline`` for an engine whose host work runs ahead of its devices, where a step
takes max(host, device) instead of their sum (``Efficiency.host_overlap``)."""

from __future__ import annotations

import numpy as np

from hardware.catalog import DeviceSpec, ModelSpec
from sim.models.efficiency import Efficiency
from sim.models.predictor import Predictor, RooflinePredictor


class HostBoundRoofline(RooflinePredictor):
    """The roofline of an engine whose host work runs ahead of the devices (asynchronous
    launches): a step takes max(host, device), host = the step overhead (+ per sequence in
    decode), device = the roofline with its all-reduces. Decode sums take the generic
    cumulative sum (the step is a maximum of three lines, not two)."""

    def _step(self, device: float, host: float) -> float:
        return device if device > host else host

    def _decode_const(self, comm: float, batch: int) -> float:
        return comm                                   # the host is the other side of max()

    def decode_step_times(self, batch: int, contexts: np.ndarray) -> np.ndarray:
        return np.maximum(self._decode_host(batch), super().decode_step_times(batch, contexts))

    def decode_step_time(self, batch: int, context: int) -> float:
        return max(self._decode_host(batch), super().decode_step_time(batch, context))

    def decode_time(self, batch: int, context: int, steps: int) -> float:
        return Predictor.decode_time(self, batch, context, steps)

    def decode_steps_within(self, batch: int, context: int, steps: int, elapsed: float) -> int:
        return Predictor.decode_steps_within(self, batch, context, steps, elapsed)

    def decode_next_boundary(self, batch: int, context: int, steps: int,
                             elapsed: float) -> tuple[int, float]:
        return Predictor.decode_next_boundary(self, batch, context, steps, elapsed)


def roofline(model: ModelSpec, device: DeviceSpec, tp: int, efficiency: Efficiency,
             weight_format: str = "bfloat16", kv_dtype: str = "bfloat16") -> RooflinePredictor:
    """The roofline predictor for ``efficiency``: host-bound when its host work overlaps."""
    cls = HostBoundRoofline if efficiency.host_overlap else RooflinePredictor
    return cls(model, device, tp, efficiency, weight_format, kv_dtype)
