"""What a fork run must show, read back from its stdout and its TensorBoard directory.

TensorBoard is read through ``megatron_integration.tensorboard_reader`` (the per-layer series) and an
``EventMultiplexer`` over every run under the directory (the raw tags), so that both the run-per-bucket
layout (run ``layer-grad-norms/layer00``, tag ``layer-grad-norms/pre-clip``) and the flat form of one
run (``layer-grad-norms/pre-clip/layer00``) are understood (``deepspeed_patch.outputs.tags``): a bucket's series
is identified by its run and tag.
"""

import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from deepspeed_patch.outputs.tags import OUTSIDE_LAYERS_ROOT, TAG_ROOT, scalar_tag

from ..tensorboard_reader import NoLayerDataError, read_layer_series

GRAD_NORM_TAG = "grad-norm/grad-norm"  # the fork's own scalar, written by its training_log
# The pre-clip norm of the buckets in the layers and of those outside them; in the flat form the
# bucket's label follows after a "/".
PRE_CLIP_NORMS = (scalar_tag("pre_clip", "norm"), scalar_tag("pre_clip", "norm", root=OUTSIDE_LAYERS_ROOT))
LOG_ITERATION = re.compile(r" iteration\s+(\d+)/\s*\d+ \|")
LOG_GRAD_NORM = re.compile(r" grad norm: ([-+0-9.eEinfa]+) \|")
LOG_LAYER_FIELD = re.compile(r" layer grad norm:((?: \d+: [-+0-9.eEinfa]+ \|)+)")
LOG_LAYER = re.compile(r" (\d+): ([-+0-9.eEinfa]+) \|")
LOG_DIGITS_REL = 5e-4  # the field prints 4 significant digits (%.3E)
LOG_GRAD_NORM_ABS = 5e-4  # the fork prints its grad norm with 3 decimals

Series = Dict[int, float]


@dataclass
class LogLine:
    iteration: int
    grad_norm: Optional[float]
    layers: Dict[int, float]
    text: str


def parse_log(stdout: str) -> List[LogLine]:
    """The fork's training log lines that carry the per-layer field, one per iteration."""
    lines = {}
    for text in stdout.splitlines():
        iteration, field_match = LOG_ITERATION.search(text), LOG_LAYER_FIELD.search(text)
        if iteration is None or field_match is None:
            continue
        grad_norm = LOG_GRAD_NORM.search(text)
        layers = {int(key): float(value) for key, value in LOG_LAYER.findall(field_match.group(1))}
        lines[int(iteration.group(1))] = LogLine(int(iteration.group(1)), grad_norm and float(grad_norm.group(1)),
                                                 layers, text.strip())
    return [lines[iteration] for iteration in sorted(lines)]


@dataclass
class TensorBoardData:
    scalars: Dict[Tuple[str, str], Series]
    """``(run, tag) -> {step: value}`` for every scalar of every run."""
    layouts: List[Dict[str, Dict[str, List[str]]]] = field(default_factory=list)
    """Every custom-scalars layout written: ``{category: {chart: [tag regexes]}}``."""
    layer_norms: Dict[int, Series] = field(default_factory=dict)
    """Each transformer layer's pre-clip norm as ``tensorboard_reader.read_layer_series`` reads it."""

    def tags(self) -> List[str]:
        return sorted({tag for _, tag in self.scalars})

    def layer_grad_norm_tags(self) -> List[str]:
        return sorted(f"{run}: {tag}" if run != "." else tag for run, tag in self.scalars
                      if tag.startswith((TAG_ROOT, OUTSIDE_LAYERS_ROOT)))

    def bucket_norms(self) -> Dict[str, Series]:
        """Each bucket's pre-clip norm against the iteration, named by run and tag."""
        return {f"{run}: {tag}": series for (run, tag), series in self.scalars.items()
                if tag in PRE_CLIP_NORMS or tag.startswith(tuple(norm + "/" for norm in PRE_CLIP_NORMS))}

    def fork_grad_norm(self) -> Series:
        found = [series for (_, tag), series in self.scalars.items() if tag == GRAD_NORM_TAG]
        return found[0] if found else {}


def read_tensorboard(logdir: str) -> TensorBoardData:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.util import tensor_util

    multiplexer = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    data = TensorBoardData({})
    for run, tags in multiplexer.Runs().items():
        for tag in tags.get("scalars", []):
            data.scalars[(run, tag)] = {event.step: event.value for event in multiplexer.Scalars(run, tag)}
        for tag in tags.get("tensors", []):  # add_scalar(new_style=True), as the bigscience fork's writer does
            if multiplexer.SummaryMetadata(run, tag).plugin_data.plugin_name == "scalars":
                data.scalars[(run, tag)] = {event.step: tensor_util.make_ndarray(event.tensor_proto).item()
                                            for event in multiplexer.Tensors(run, tag)}
        if metadata.CONFIG_SUMMARY_TAG in tags.get("tensors", []):
            for event in multiplexer.Tensors(run, metadata.CONFIG_SUMMARY_TAG):
                data.layouts.append(_layout_dict(layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])))
    try:
        layers = read_layer_series(logdir)
    except NoLayerDataError:
        return data
    data.layer_norms = {layer: dict(layers.series("pre-clip", "norm", layer)) for layer in layers.layers()}
    return data


def _layout_dict(layout) -> Dict[str, Dict[str, List[str]]]:
    """A ``layout_pb2.Layout`` as ``{category: {chart: [tag regexes]}}`` (multiline or margin charts)."""
    return {category.title: {chart.title: _chart_regexes(chart) for chart in category.chart}
            for category in layout.category}


def _chart_regexes(chart) -> List[str]:
    return list(chart.multiline.tag) or [series.value for series in chart.margin.series]


def root_sum_square_errors(data: TensorBoardData, grad_norm: Optional[Series] = None,
                           ) -> Dict[int, Tuple[float, float, float]]:
    """``step -> (root-sum-square of the bucket norms, the grad norm, relative error)`` on every step where
    ``grad_norm`` (by default the fork's own) has a value and every bucket was measured."""
    buckets = data.bucket_norms().values()
    grad_norm = data.fork_grad_norm() if grad_norm is None else grad_norm
    result = {}
    for step, norm in sorted(grad_norm.items()):
        if buckets and all(step in series for series in buckets):
            rss = math.sqrt(sum(series[step] ** 2 for series in buckets))
            result[step] = (rss, norm, abs(rss - norm) / abs(norm) if norm else abs(rss))
    return result


def log_line_errors(lines: List[LogLine], data: TensorBoardData) -> List[str]:
    """Where a log line disagrees with TensorBoard: its layer norms (4 digits) and its grad norm (3 decimals)."""
    rss = root_sum_square_errors(data)
    errors = []
    for line in lines:
        for layer, value in line.layers.items():
            logged = data.layer_norms.get(layer, {}).get(line.iteration)
            if logged is None or not math.isclose(value, logged, rel_tol=LOG_DIGITS_REL):
                errors.append(f"iteration {line.iteration} layer {layer}: log {value} vs TensorBoard {logged}")
        if line.grad_norm is not None and line.iteration in rss:
            if abs(line.grad_norm - rss[line.iteration][0]) > LOG_GRAD_NORM_ABS:
                errors.append(f"iteration {line.iteration}: log grad norm {line.grad_norm} vs root-sum-square "
                              f"{rss[line.iteration][0]}")
    return errors
