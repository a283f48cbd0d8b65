"""Per-layer statistics read back from a TensorBoard directory written by ``log_layer_grad_norms``."""

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from deepspeed_patch.layer_map import DEFAULT_LAYER_PATTERN, bucket_key

from .training_log import TAG_ROOT

_TAG = re.compile(rf"^{TAG_ROOT}/(pre-clip|post-clip)/(norm|min|max)/(.+)$")
_LAYER_BUCKET = re.compile(r"^layer(\d+)$")


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
    layers, finer = LayerSeries(), {}
    found = set()
    for run, tags in multiplexer.Runs().items():
        for tag in tags.get("scalars", []):
            found.add(tag)
            match = _TAG.match(tag)
            if not match:
                continue
            phase, statistic, bucket = match.groups()
            points = [(event.step, event.value) for event in multiplexer.Scalars(run, tag)]
            layer = _LAYER_BUCKET.match(bucket)
            if layer:
                layers.values.setdefault((phase, statistic), {})[int(layer.group(1))] = points
            elif isinstance(bucket_key(bucket, _PATTERN), int):
                finer.setdefault((phase, statistic, bucket_key(bucket, _PATTERN)), []).append(points)
    result = layers if layers.layers() else _combine_into_layers(finer)
    if not result.layers():
        listing = ", ".join(sorted(found)[:10]) or "no scalars at all"
        raise NoLayerDataError(f"{logdir}: no per-layer gradient statistics ({TAG_ROOT}/pre-clip/norm/layerNN "
                               f"tags, or per-parameter tags with a layer index); found: {listing}")
    return result


_PATTERN = re.compile(DEFAULT_LAYER_PATTERN)


def _combine_into_layers(finer: Dict[Tuple[str, str, int], List[List[Tuple[int, float]]]]) -> LayerSeries:
    """Per-layer series from per-parameter ones (``granularity: param``): the norm is the root of the
    summed squares, min and max the extremes, step by step."""
    combine = {"norm": lambda values: math.sqrt(sum(v * v for v in values)), "min": min, "max": max}
    result = LayerSeries()
    for (phase, statistic, layer), series in finer.items():
        steps = sorted(set.intersection(*(set(step for step, _ in points) for points in series)))
        by_step = [dict(points) for points in series]
        combined = [(step, combine[statistic]([values[step] for values in by_step])) for step in steps]
        result.values.setdefault((phase, statistic), {})[layer] = combined
    return result
