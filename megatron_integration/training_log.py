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
from typing import Dict

from deepspeed_patch.tags import LOGGED_PHASES, LOGGED_STATISTICS, is_layer

from .arguments import layer_grad_norms_interval
from .bucket_runs import bucket_runs
from .tensorboard_layout import custom_scalars_layout, placements


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
    for place in sorted(placed.values(), key=lambda place: place.layer is None):
        runs.writer(place.run)  # layers first, in the result's order: TensorBoard colours runs in the order they start
    for phase in LOGGED_PHASES:
        for key, values in (stats[phase] or {}).items():
            place = placed[key]
            for statistic in LOGGED_STATISTICS:
                runs.writer(place.run).add_scalar(place.tag(phase, statistic), drawable(values[statistic]), iteration)
    runs.flush()


def log_string_field(stats: Dict) -> str:
    """`` layer grad norm: 0: 3.1E-01 | 1: 2.9E-01 | ... |`` for the layers, pre-clip (``encoder.0: ...`` in
    a model of several layer stacks)."""
    layers = [(key, values["norm"]) for key, values in stats["pre_clip"].items() if is_layer(key)]
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
