"""Per-layer statistics read back from any log a run leaves (``log_sources``: TensorBoard, DeepSpeed's CSV
monitor, the Hugging Face Trainer's ``trainer_state.json``, the JSONL post-mortem dump).

The scalars may follow any layout written so far (names in ``deepspeed_patch.outputs.tags``), under any prefix a
writer adds (``train/``, ``Train/Samples/``):

- one run per bucket, as ``log_layer_grad_norms`` writes now: runs ``layer-grad-norms/layer00``
  (``layer-grad-norms/encoder.layer00`` for a layer of the encoder in a model of several layer stacks), tags
  ``layer-grad-norms/pre-clip`` and ``layer-grad-norms/values/max/pre-clip`` (``/mlp.fc2.weight``
  appended for the parts of a layer with finer buckets);
- the flat form, every bucket in one run: ``layer-grad-norms/pre-clip/layer00``;
- the first release's: one run, ``layer-grad-norms/pre-clip/norm/layer00``, with copies suffixed
  `` vs samples`` and `` vs tokens`` (skipped).

Scalars are read whether written as simple values or as tensors (the bigscience fork's writer adds
``new_style=True``).

The gradient's phases are read, and as phases of their own the ``optimizer_statistics`` kinds and the
update-to-weight ratio (``layer-grad-norms/update``, ``layer-grad-norms/update-to-weight``; the dump's
ratio derived from its lines' ``update`` and ``param``, as its writers derive it): ``series("update", "norm",
layer)``.

A step written more than once (a run resumed or rolled back into the same directory or dump, the demo
run twice into the same ``--out``) is read once: the value written last wins, and the later steps of the run
it replaced are dropped (``latest_per_step``), as in TensorBoard's data server; TensorBoard's Python
``EventMultiplexer``, read here, keeps every point of files written by PyTorch.

The flight recorder's runs (``layer-grad-norms-history/fire-000123/layer00``) add to a layer's series the
steps it lacks: the selected layers' steps were logged live already, the others' were not (the main figure and
the report then show every layer around a fire, as the dump gives them); ``spike`` reads those runs fire by
fire. The dump's recorded steps (lines marked ``"history": true``) are read here as any other line: they repeat
steps written before, and the rule above keeps the last written (all buckets, where the live lines held the
selected ones).

Layers are identified as in the results (``deepspeed_patch.outputs.tags``): by ``int`` index in a model of one
stack, by ``LayerKey`` (``"encoder.3"``) in a model of several; stacks come in the order they were
written.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from deepspeed_patch.config import parse_layer_spec
from deepspeed_patch.outputs.tags import (
    ALL_PHASES,
    HISTORY_ROOT,
    HISTORY_RUN,
    TAG_ROOT,
    UPDATE_TO_WEIGHT,
    VALUES,
    LayerId,
    LayerKey,
    is_layer,
    layer_of_label,
    layer_position,
    logged_result,
    norm_ratio,
    phase_label,
    phase_statistics,
)

from .log_sources import PHASE_PATTERN, LogSourceError, dump_records, is_dump, scalar_series
from .tensorboard_layout import layer_and_family

Points = List[Tuple[int, float]]

_RELEASE_TAG = re.compile(rf"^{TAG_ROOT}/(pre-clip|post-clip)/(norm|min|max)/([^/]+)$")
_TAG = re.compile(rf"^{TAG_ROOT}/(?:{PHASE_PATTERN}|{VALUES}/([^/]+)/{PHASE_PATTERN})(?:/([^/]+))?$")
_RATIO = phase_label(UPDATE_TO_WEIGHT)
BUCKET_RUN = re.compile(rf"(?:^|/){TAG_ROOT}/([^/]+)$")
"""A bucket's run (``layer-grad-norms/layer03``, under any root): the bucket's label is its group."""
_STACK_LAYER_KEY = re.compile(r"^(.+)\.(\d+)$")
_AXIS_COPY = re.compile(r" vs (?:samples|tokens)$")
_WRITER_PREFIX = re.compile(rf"^(?:[^/]+/)+?(?={TAG_ROOT}/)")
"""What a writer puts before the tags: DeepSpeed's monitor ``Train/Samples/``, the HF Trainer's ``train/``."""
_SAMPLES_AXIS = "Samples/"
"""In a writer's prefix: its x axis counts samples (DeepSpeed's monitor), not steps."""


def latest_per_step(points: Iterable[Tuple[int, float]]) -> Points:
    """One value per step, in step order, from ``points`` in the order they were written: a step written
    again (a run resumed or rolled back to an earlier checkpoint) replaces that step and every later one
    written before it, the abandoned run's, as TensorBoard's data server does."""
    kept: Points = []
    for step, value in points:
        while kept and kept[-1][0] >= step:
            kept.pop()
        kept.append((step, value))
    return kept


class NoLayerDataError(LogSourceError):
    """The log holds no per-layer gradient statistics."""


def layer_title(layer: LayerId) -> str:
    """A layer as a legend or a table names it: ``layer 3``, ``encoder layer 3``."""
    stack, index = layer_position(layer)
    return f"layer {index}" if stack is None else f"{stack} layer {index}"


@dataclass
class LayerSeries:
    """``values[(phase, statistic)][layer]`` is a list of ``(step, value)`` in step order, one per step."""

    values: Dict[Tuple[str, str], Dict[LayerId, Points]] = field(default_factory=dict)
    axis: str = "steps"
    """What the log's x axis counts: ``"steps"``, or ``"samples"`` where the writer is DeepSpeed's monitor
    (``Train/Samples/...``, its TensorBoard or CSV files: the global sample count)."""

    def stacks(self) -> List[Optional[str]]:
        """The layer stacks, in the order they were first met; ``[None]`` for a model of one stack."""
        return list(dict.fromkeys(layer_position(layer)[0] for layer in self.values.get(("pre-clip", "norm"), {})))

    def layers(self) -> List[LayerId]:
        """Every layer: stack after stack, each in index order."""
        return [layer for stack in self.stacks() for layer in self.stack_layers(stack)]

    def stack_layers(self, stack: Optional[str]) -> List[LayerId]:
        """The layers of one stack (``None``: of a model of one stack), in index order."""
        found = [layer for layer in self.values.get(("pre-clip", "norm"), {}) if layer_position(layer)[0] == stack]
        return sorted(found, key=lambda layer: layer_position(layer)[1])

    def series(self, phase: str, statistic: str, layer: LayerId) -> Points:
        return self.values.get((phase, statistic), {}).get(layer, [])

    def only(self, layers: Sequence[LayerId]) -> "LayerSeries":
        """The same series, of ``layers`` alone."""
        return LayerSeries({key: {layer: points for layer, points in by_layer.items() if layer in layers}
                            for key, by_layer in self.values.items()})

    def selected(self, spec: str) -> "LayerSeries":
        """The layers a flag's selection (``"0,1,mid,-2,-1"``, ``"all"``) names, in each stack: indices as logged,
        ``mid`` and negative ones counted from the stack's deepest logged layer. A layer the log lacks is an
        error naming those it holds."""
        tokens = parse_layer_spec(spec)
        if tokens is None:
            return self
        chosen = []
        for stack in self.stacks():
            logged = {layer_position(layer)[1]: layer for layer in self.stack_layers(stack)}
            depth = max(logged) + 1
            for token in tokens:
                index = depth // 2 if token == "mid" else token + depth if token < 0 else token
                if index not in logged:
                    raise NoLayerDataError(f"layer {token} ({index}) is not in this log{_of_stack(stack)}; it "
                                           f"holds layers {', '.join(str(index) for index in sorted(logged))}")
                chosen.append(logged[index])
        return self.only(chosen)


class _Collector:
    """Whole-layer series, and the series of finer buckets grouped by the layer their name carries."""

    def __init__(self) -> None:
        self.layers = LayerSeries()
        self.finer: Dict[Tuple[str, str, LayerId], List[Points]] = {}
        self.recorded: Dict[Tuple[str, str, LayerId], Points] = {}

    def bucket(self, phase: str, statistic: str, bucket: Hashable, points: Points) -> None:
        """A bucket's series, in the order written: ``bucket`` is a layer, a label such as ``layer03``, or a
        finer key."""
        layer = bucket if is_layer(bucket) else layer_of_label(bucket)
        if layer is not None:  # a run resumed into a run directory of its own (the HF Trainer's) continues it
            series = self.layers.values.setdefault((phase, statistic), {})
            series[layer] = latest_per_step(series.get(layer, []) + points)
        else:
            self.part(phase, statistic, layer_and_family(bucket)[0], latest_per_step(points))

    def part(self, phase: str, statistic: str, layer: Optional[LayerId], points: Points) -> None:
        if layer is not None:
            self.finer.setdefault((phase, statistic, layer), []).append(latest_per_step(points))

    def record(self, phase: str, statistic: str, layer: LayerId, points: Points) -> None:
        """A layer's steps recorded by the flight recorder at one fire (TensorBoard's history runs)."""
        self.recorded.setdefault((phase, statistic, layer), []).extend(points)

    def result(self) -> LayerSeries:
        if not self.layers.layers() and not self.recorded:
            return _combine_into_layers(self.finer)
        for (phase, statistic, layer), points in self.recorded.items():
            live = self.layers.values.setdefault((phase, statistic), {}).get(layer, [])
            logged = {step for step, _ in live}
            recorded = dict(point for point in points if point[0] not in logged)  # a later fire's copy wins
            self.layers.values[(phase, statistic)][layer] = sorted(live + list(recorded.items()))
        return self.layers


def _of_stack(stack: Optional[str]) -> str:
    return "" if stack is None else f" (stack {stack!r})"


def read_layer_series(source: str) -> LayerSeries:
    """Every per-layer series of ``source``, any log ``log_sources`` reads. Raises ``LogSourceError`` for a
    path that is no such log, ``NoLayerDataError`` if it holds no per-layer statistics."""
    collector = _Collector()
    found, writers = [], set()
    if is_dump(source):
        _collect_jsonl(source, collector)
    else:
        for run, tag, points in scalar_series(source):
            found.append(tag)
            prefix = _WRITER_PREFIX.match(tag)
            if prefix or tag.startswith(f"{TAG_ROOT}/"):
                writers.add(prefix.group(0) if prefix else "")
            _collect_tag(run, tag[prefix.end():] if prefix else tag, points, collector)
        if len(writers) > 1:
            raise LogSourceError(f"{source}: holds the statistics of more than one writer (tags under "
                                 f"{' and '.join(repr(writer or TAG_ROOT) for writer in sorted(writers))}): give the "
                                 "directory of one")
    result = collector.result()
    if any(_SAMPLES_AXIS in writer for writer in writers):
        result.axis = "samples"
    if not result.layers():
        listing = ", ".join(sorted(set(found))[:10]) or "no scalars at all"
        raise NoLayerDataError(f"{source}: no per-layer gradient statistics (runs {TAG_ROOT}/layerNN holding "
                               f"{TAG_ROOT}/pre-clip, or tags {TAG_ROOT}/pre-clip/layerNN); found: {listing}")
    return result


def _collect_tag(run: str, tag: str, points: Points, collector: _Collector) -> None:
    """One series; ``tag`` without the prefix its writer put before ``layer-grad-norms/``."""
    if _AXIS_COPY.search(tag):
        return
    fire = HISTORY_RUN.search(run)
    if fire is not None:
        _collect_recorded(fire.group(2), tag, points, collector)
        return
    release = _RELEASE_TAG.match(tag)
    if release:
        phase, statistic, bucket = release.groups()
        collector.bucket(phase, statistic, bucket, points)
        return
    match = _TAG.match(tag)
    if not match:
        return
    norm_phase, statistic, values_phase, suffix = match.groups()
    phase, statistic = (norm_phase, "norm") if norm_phase else (values_phase, statistic)
    bucket_run = BUCKET_RUN.search(run)
    if bucket_run is None:
        if suffix is not None:  # the flat form: the bucket ends the tag
            collector.bucket(phase, statistic, suffix, points)
    elif suffix is None:
        collector.bucket(phase, statistic, bucket_run.group(1), points)
    else:  # a part of the run's layer, with finer buckets
        collector.part(phase, statistic, layer_of_label(bucket_run.group(1)), points)


def _collect_recorded(label: str, tag: str, points: Points, collector: _Collector) -> None:
    """A layer's series in a fire's run (``layer-grad-norms-history/fire-000150/layer03``)."""
    layer = layer_of_label(label)
    match = _TAG.match(TAG_ROOT + tag[len(HISTORY_ROOT):]) if tag.startswith(f"{HISTORY_ROOT}/") else None
    if layer is None or match is None or match.group(4) is not None:
        return
    norm_phase, statistic, values_phase, _ = match.groups()
    collector.record(norm_phase or values_phase, statistic or "norm", layer, latest_per_step(points))


def json_bucket(key: str, stacked: bool) -> Hashable:
    """A result key from its JSON form: ``"3"`` is layer 3; where no layer is keyed by its index alone
    (``stacked``: a model of several layer stacks), ``"encoder.3"`` is layer 3 of the stack ``encoder``."""
    if key.isdigit():
        return int(key)
    layer = _STACK_LAYER_KEY.match(key) if stacked else None
    return LayerKey(layer.group(1), int(layer.group(2))) if layer else key


def _collect_jsonl(path: str, collector: _Collector) -> None:
    """The dump's results (its rotated files first), in the order written."""
    series: Dict[Tuple[str, str, Hashable], Points] = {}
    for record in dump_records(path):
        logged = logged_result(record)
        for phase in ALL_PHASES:
            buckets = logged.get(phase) or {}
            stacked = not any(key.isdigit() for key in buckets)
            for key, values in buckets.items():
                bucket = json_bucket(key, stacked)  # JSON keys are strings
                for statistic in phase_statistics(phase):
                    series.setdefault((phase_label(phase), statistic, bucket), []).append(
                        (record["step"], values[statistic]))
    for (phase, statistic, bucket), points in series.items():
        collector.bucket(phase, statistic, bucket, points)


def _combine_into_layers(finer: Dict[Tuple[str, str, LayerId], List[Points]]) -> LayerSeries:
    """Per-layer series from per-parameter ones (``granularity: param``): the norm is the root of the
    summed squares, min and max the extremes, step by step; the update-to-weight ratio, which does not add
    up so, is the layer's update norm over its weights' norm."""
    combine = {"norm": lambda values: math.sqrt(sum(v * v for v in values)), "min": min, "max": max}
    result = LayerSeries()
    for (phase, statistic, layer), series in finer.items():
        if phase == _RATIO:
            continue
        steps = sorted(set.intersection(*(set(step for step, _ in points) for points in series)))
        by_step = [dict(points) for points in series]
        combined = [(step, combine[statistic]([values[step] for values in by_step])) for step in steps]
        result.values.setdefault((phase, statistic), {})[layer] = combined
    _derive_ratio(result)
    return result


def _derive_ratio(series: LayerSeries) -> None:
    """Each layer's update-to-weight ratio, at the steps holding both its update and its weights' norms."""
    weights = series.values.get(("param", "norm"), {})
    for layer, updates in series.values.get(("update", "norm"), {}).items():
        param = dict(weights.get(layer, []))
        ratio = [(step, norm_ratio(update, param[step])) for step, update in updates if step in param]
        if ratio:
            series.values.setdefault((_RATIO, "norm"), {})[layer] = ratio
