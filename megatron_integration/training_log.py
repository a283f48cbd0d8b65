"""Per-layer gradient norms in Megatron's training log and TensorBoard.

``log_layer_grad_norms`` is called once per iteration from the training loop. On iterations the
statistics were measured it writes, on the rank that owns the TensorBoard writer, one run per layer
(``layer-grad-norms/layer00``, beside the writer's own run) holding one scalar per phase (pre-/post-clip)
and statistic, against the iteration (names in ``deepspeed_patch.tags``); and it returns a compact
field for the stdout log line. On other iterations it returns at once: no collective, no work.

Against the iteration only: Megatron-DeepSpeed writes its headline scalars (loss, learning rate,
grad-norm) also ``vs samples`` and ``vs tokens``, but its per-component diagnostics (timers,
throughput, memory) against the iteration alone, and these statistics are such diagnostics: a
``vs`` copy would triple the cards while ``steps-vs-samples`` already maps iterations to samples.
"""

import argparse
import math
import re
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Tuple

from deepspeed_patch.tags import (
    LOGGED_PHASES,
    LOGGED_STATISTICS,
    OUTSIDE_LAYERS_ROOT,
    TAG_ROOT,
    phase_label,
    run_name,
    scalar_tag,
)

from .arguments import layer_grad_norms_interval
from .bucket_runs import bucket_runs

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_and_family(key: Hashable) -> Tuple[Optional[int], Optional[str]]:
    """Where a finer bucket (``granularity: param`` or ``group_by``) lies: ``(3, "mlp.fc2.weight")`` for
    ``layers.3.mlp.fc2.weight``, ``(3, "dense_4h_to_h")`` for ``3.dense_4h_to_h``, ``(None, None)``
    for a bucket with no layer index in its name."""
    match = _LAYER_INDEX.search(key) if isinstance(key, str) else None
    if match is None:
        return None, None
    return int(match.group(1)), key[match.end():] or None


@dataclass(frozen=True)
class Placement:
    """Where one bucket's statistics go: the run, the root of its tags, and the name the tags end with
    (a finer bucket's part of its layer; ``None`` for a whole bucket)."""

    run: str
    root: str
    name: Optional[str]
    layer: Optional[int]

    def tag(self, phase: str, statistic: str) -> str:
        return scalar_tag(phase, statistic, self.name, root=self.root)


def placements(keys: Iterable[Hashable]) -> Dict[Hashable, Placement]:
    """Each bucket's place: a layer in its layer's run under ``layer-grad-norms``, finer buckets in the
    run of the layer their name carries (when no bucket is a whole layer), any other bucket in a run of
    its own under ``non-layer-grad-norms``, so that it shares no chart, nor its colours, with the layers."""
    keys = list(keys)
    finer = not any(isinstance(key, int) for key in keys)
    placed = {}
    for key in keys:
        layer, family = (key, None) if isinstance(key, int) else layer_and_family(key) if finer else (None, None)
        if layer is None:
            placed[key] = Placement(run_name(key), OUTSIDE_LAYERS_ROOT, None, None)
        else:
            placed[key] = Placement(run_name(layer), TAG_ROOT, family, layer)
    return placed


def custom_scalars_layout(keys: Iterable[Hashable] = ()) -> Dict[str, Dict[str, List]]:
    """For the Custom Scalars tab: one multi-line chart per phase and statistic, the selected layers
    together (NormFormer's figure); one more per part of a layer with finer buckets, and per phase for
    the buckets outside the layers."""
    placed = placements(keys).values()
    names = sorted({place.name for place in placed if place.name is not None})
    layout = {}
    for phase in LOGGED_PHASES:
        title = f"{TAG_ROOT} {phase_label(phase)}"
        layout[title] = _charts(phase, None, TAG_ROOT)
        for name in names:
            layout[f"{title}: {name}"] = _charts(phase, name, TAG_ROOT)
        if any(place.root == OUTSIDE_LAYERS_ROOT for place in placed):
            layout[f"{OUTSIDE_LAYERS_ROOT} {phase_label(phase)}"] = _charts(phase, None, OUTSIDE_LAYERS_ROOT)
    return layout


def _charts(phase: str, name: Optional[str], root: str) -> Dict[str, List]:
    return {
        statistic: ["Multiline", [f"^{re.escape(scalar_tag(phase, statistic, name, root=root))}$"]]
        for statistic in LOGGED_STATISTICS
    }


def drawable(value: float) -> float:
    """``value``, or NaN for an infinite one (an fp16 overflow's pre-clip statistics): TensorBoard marks a
    NaN point with a triangle and draws on; an infinite point it leaves unmarked, a gap in the line, and
    its SVG renderer draws nothing of the line after it."""
    return value if math.isfinite(value) else math.nan


def write_tensorboard(writer, stats: Dict, iteration: int) -> None:
    """Every selected bucket's statistics into its run, against the iteration, then flush those runs."""
    runs = bucket_runs(writer)
    placed = placements(stats["pre_clip"])
    if not runs.layout_written:
        writer.add_custom_scalars(custom_scalars_layout(stats["pre_clip"]))
        runs.layout_written = True
    for place in sorted(placed.values(), key=lambda place: (place.layer is None, place.layer or 0)):
        runs.writer(place.run)  # layers first: TensorBoard colours runs in the order they start
    for phase in LOGGED_PHASES:
        for key, values in (stats[phase] or {}).items():
            place = placed[key]
            for statistic in LOGGED_STATISTICS:
                runs.writer(place.run).add_scalar(place.tag(phase, statistic), drawable(values[statistic]), iteration)
    runs.flush()


def log_string_field(stats: Dict) -> str:
    """`` layer grad norm: 0: 3.1E-01 | 1: 2.9E-01 | ... |`` for the layers, pre-clip."""
    layers = [(key, values["norm"]) for key, values in stats["pre_clip"].items() if isinstance(key, int)]
    return " layer grad norm:" + "".join(f" {key}: {norm:.3E} |" for key, norm in layers)


def log_layer_grad_norms(engine, iteration: int, writer, args: argparse.Namespace) -> str:
    """Log this iteration's per-layer statistics, if it was measured; returns the log-line field.

    ``engine`` is the DeepSpeed engine, ``writer`` the TensorBoard writer (``None`` on ranks without
    one). The field is returned on ``args.log_interval`` iterations, else ``''``.
    """
    if not getattr(args, "log_layer_grad_norms", False) or iteration % layer_grad_norms_interval(args):
        return ""
    stats = engine.get_layer_grad_norms()
    if stats is None or stats["step"] != iteration:
        return ""
    if writer is not None:
        write_tensorboard(writer, stats, iteration)
    if iteration % getattr(args, "log_interval", 1):
        return ""
    return log_string_field(stats)
