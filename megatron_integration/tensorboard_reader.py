"""Per-layer statistics read back from a TensorBoard directory written by ``log_layer_grad_norms``,
or from the JSONL post-mortem dump."""

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from deepspeed_patch.layer_map import DEFAULT_LAYER_PATTERN, bucket_key

from .training_log import TAG_ROOT, scalar_tag

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


def read_layer_series(source: str) -> LayerSeries:
    """Every per-layer series of ``source``: a TensorBoard directory written by ``log_layer_grad_norms``,
    or a JSONL file written by the ``dump`` option. Raises ``NoLayerDataError`` if it holds none."""
    scalars = _jsonl_scalars(source) if os.path.isfile(source) else _tensorboard_scalars(source)
    layers, finer = LayerSeries(), {}
    for tag, points in scalars.items():
        match = _TAG.match(tag)
        if not match:
            continue
        phase, statistic, bucket = match.groups()
        layer = _LAYER_BUCKET.match(bucket)
        if layer:
            layers.values.setdefault((phase, statistic), {})[int(layer.group(1))] = points
        elif isinstance(bucket_key(bucket, _PATTERN), int):
            finer.setdefault((phase, statistic, bucket_key(bucket, _PATTERN)), []).append(points)
    result = layers if layers.layers() else _combine_into_layers(finer)
    if not result.layers():
        listing = ", ".join(sorted(scalars)[:10]) or "no scalars at all"
        raise NoLayerDataError(f"{source}: no per-layer gradient statistics ({TAG_ROOT}/pre-clip/norm/layerNN "
                               f"tags, or per-parameter tags with a layer index); found: {listing}")
    return result


def _tensorboard_scalars(logdir: str) -> Dict[str, List[Tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0})
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    return {tag: [(event.step, event.value) for event in multiplexer.Scalars(run, tag)]
            for run, tags in multiplexer.Runs().items() for tag in tags.get("scalars", [])}


def _jsonl_scalars(path: str) -> Dict[str, List[Tuple[int, float]]]:
    """The dump's results as TensorBoard-style tags; a last line cut short by a killed job is skipped."""
    scalars: Dict[str, List[Tuple[int, float]]] = {}
    with open(path) as dump:
        for line in dump:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            for phase in ("pre_clip", "post_clip"):
                for key, values in (record.get(phase) or {}).items():
                    bucket = int(key) if key.isdigit() else key  # JSON keys are strings
                    for statistic in ("norm", "min", "max"):
                        tag = scalar_tag(phase, statistic, bucket)
                        scalars.setdefault(tag, []).append((record["step"], values[statistic]))
    return scalars


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
