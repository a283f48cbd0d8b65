"""Per-layer statistics read back from a TensorBoard directory written by ``log_layer_grad_norms``."""

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .training_log import TAG_ROOT

_TAG = re.compile(rf"^{TAG_ROOT}/(pre-clip|post-clip)/(norm|min|max)/layer(\d+)$")


class NoLayerDataError(ValueError):
    """The directory holds no per-layer gradient statistics."""


@dataclass
class LayerSeries:
    """``values[(phase, statistic)][layer]`` is a list of ``(step, value)`` in step order."""

    values: Dict[Tuple[str, str], Dict[int, List[Tuple[int, float]]]] = field(default_factory=dict)

    def layers(self) -> List[int]:
        return sorted(self.values.get(("pre-clip", "norm"), {}))

    def series(self, phase: str, statistic: str, layer: int) -> List[Tuple[int, float]]:
        return self.values.get((phase, statistic), {}).get(layer, [])

    def finite_norms(self, layer: int, phase: str = "pre-clip") -> List[float]:
        return [value for _, value in self.series(phase, "norm", layer) if math.isfinite(value)]


def read_layer_series(logdir: str) -> LayerSeries:
    """Every per-layer scalar (against iteration) under ``logdir``; raises ``NoLayerDataError`` if none."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    result = LayerSeries()
    found = set()
    for run, tags in multiplexer.Runs().items():
        for tag in tags.get("scalars", []):
            found.add(tag)
            match = _TAG.match(tag)
            if match:
                phase, statistic, layer = match.group(1), match.group(2), int(match.group(3))
                events = multiplexer.Scalars(run, tag)
                result.values.setdefault((phase, statistic), {})[layer] = [(e.step, e.value) for e in events]
    if not result.layers():
        listing = ", ".join(sorted(found)[:10]) or "no scalars at all"
        raise NoLayerDataError(f"{logdir}: no per-layer gradient statistics ({TAG_ROOT}/pre-clip/norm/layerNN tags); "
                               f"found: {listing}")
    return result
