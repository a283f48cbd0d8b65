"""Per-layer gradient norms in Megatron's training log and TensorBoard.

``log_layer_grad_norms`` is called once per iteration from the training loop. Whenever the engine holds a
result not yet logged (a step on the interval, a step a trigger captured, a step a ds_config block
measures on an interval of its own) it writes, on the rank that owns the TensorBoard writer, one run per
layer (``layer-grad-norms/layer00``, beside the writer's own run) holding one scalar per phase
(pre-/post-clip) and statistic, against the step the result belongs to (names in
``deepspeed_patch.tags``); and it returns a compact field for the stdout log line. Otherwise it returns
at once: no collective, no work.

Against the iteration only: Megatron-DeepSpeed writes its headline scalars (loss, learning rate,
grad-norm) also ``vs samples`` and ``vs tokens``, but its per-component diagnostics (timers,
throughput, memory) against the iteration alone, and these statistics are such diagnostics: a
``vs`` copy would triple the cards while ``steps-vs-samples`` already maps iterations to samples.
"""

import argparse
import math
from typing import Dict

from deepspeed_patch.tags import LOGGED_PHASES, LOGGED_STATISTICS, is_layer

from .bucket_runs import bucket_runs
from .tensorboard_layout import custom_scalars_layout, placements


def drawable(value: float) -> float:
    """``value``, or NaN for an infinite one (an fp16 overflow's pre-clip statistics): TensorBoard marks a
    NaN point with a triangle and draws on; an infinite point it leaves unmarked, a gap in the line, and
    its SVG renderer draws nothing of the line after it."""
    return value if math.isfinite(value) else math.nan


def write_tensorboard(writer, stats: Dict) -> None:
    """Every selected bucket's statistics into its run, against their step, then flush those runs."""
    runs, iteration = bucket_runs(writer), stats["step"]
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
    runs.logged_step = iteration
    runs.flush()


def log_string_field(stats: Dict) -> str:
    """`` layer grad norm: 0: 3.1E-01 | 1: 2.9E-01 | ... |`` for the layers, pre-clip (``encoder.0: ...`` in
    a model of several layer stacks)."""
    layers = [(key, values["norm"]) for key, values in stats["pre_clip"].items() if is_layer(key)]
    return " layer grad norm:" + "".join(f" {key}: {norm:.3E} |" for key, norm in layers)


def log_layer_grad_norms(engine, iteration: int, writer, args: argparse.Namespace, loss=None) -> str:
    """Log the engine's newest per-layer statistics, once, at the step they belong to; returns the
    log-line field.

    ``engine`` is the DeepSpeed engine, ``writer`` the TensorBoard writer (``None`` on ranks without
    one). Every result the engine publishes is written to TensorBoard once, whatever the interval that
    measured it, provided the hook runs before the next one replaces it (each iteration, as Megatron
    calls it). The field is returned on ``args.log_interval`` iterations measured at that iteration,
    else ``''``.

    ``loss``: the iteration's loss as Megatron reduces it (``loss_dict["lm loss"]``, the same on every rank),
    reported to the engine for ``trigger.loss_factor``; it is judged at the end of the next optimizer step.
    """
    if not getattr(args, "log_layer_grad_norms", False):
        return ""
    if loss is not None and getattr(engine, "layer_grad_norms", None) is not None:
        engine.layer_grad_norms.report_loss(loss)
    stats = engine.get_layer_grad_norms()
    if stats is None:
        return ""
    if writer is not None and bucket_runs(writer).logged_step != stats["step"]:
        write_tensorboard(writer, stats)
    if stats["step"] != iteration or iteration % getattr(args, "log_interval", 1):
        return ""
    return log_string_field(stats)
