"""Per-layer gradient norms in Megatron's training log and TensorBoard.

``log_layer_grad_norms`` is called once per iteration from the training loop. Whenever the engine holds a
result not yet logged (a step on the interval, a step a trigger captured, a step a ds_config block
measures on an interval of its own) it writes, on the rank that owns the TensorBoard writer, one run per
layer (``layer-grad-norms/layer00``, beside the writer's own run) holding one scalar per phase
(pre-/post-clip; the ``optimizer_statistics`` kinds and the update-to-weight ratio where the result holds
them) and statistic, against the step the result belongs to (names in ``deepspeed_patch.tags``); and it
returns a compact field for the stdout log line. Otherwise it returns at once: no collective, no work.

When the trigger fires with a flight recorder (``trigger.history``), the recorded steps of every bucket go,
once per fire, to runs of their own (``layer-grad-norms-history/fire-000123/layer00``): written into the
runs above, steps going backwards would make TensorBoard purge the later points of those runs.

Against the iteration only: Megatron-DeepSpeed writes its headline scalars (loss, learning rate,
grad-norm) also ``vs samples`` and ``vs tokens``, but its per-component diagnostics (timers,
throughput, memory) against the iteration alone, and these statistics are such diagnostics: a
``vs`` copy would triple the cards while ``steps-vs-samples`` already maps iterations to samples.
"""

import argparse
import math
from dataclasses import replace
from typing import Dict, Hashable, List

from deepspeed_patch.tags import (
    HISTORY_ROOT,
    SKIPPED,
    WRITTEN_PHASES,
    history_root,
    history_run_name,
    is_layer,
    logged_result,
    phase_statistics,
    step_scalars,
)

from .bucket_runs import BucketRuns, bucket_runs
from .tensorboard_layout import Placement, custom_scalars_layout, placements


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
        writer.add_custom_scalars(custom_scalars_layout(stats["pre_clip"], _logged_phases(stats)))
        runs.layout_written = True
    for place in sorted(placed.values(), key=lambda place: place.layer is None):
        runs.writer(place.run)  # layers first, in the result's order: TensorBoard colours runs in the order they start
    _write_scalars(runs, placed, stats)
    for tag, value in step_scalars(stats).items():  # skip_step's decision: the writer's own run
        writer.add_scalar(tag, value, iteration)
    runs.logged_step = iteration
    runs.flush()


def _logged_phases(stats: Dict) -> List[str]:
    """The phases of a result its logs hold: the gradient's, and the kinds and ratio it carries."""
    return [phase for phase in WRITTEN_PHASES if phase in logged_result(stats)]


def _write_scalars(runs: BucketRuns, placed: Dict[Hashable, Placement], stats: Dict) -> None:
    """Each bucket's statistics of one result into its run, against the result's step."""
    logged = logged_result(stats)
    for phase in WRITTEN_PHASES:
        for key, values in (logged.get(phase) or {}).items():
            place = placed[key]
            for statistic in phase_statistics(phase):
                runs.writer(place.run).add_scalar(place.tag(phase, statistic), drawable(values[statistic]),
                                                  stats["step"])


def write_history(writer, history: List[Dict]) -> None:
    """A fire's recorded steps (``get_layer_grad_norms_history()``, oldest first), each bucket into its run
    of that fire, then those runs closed: they are written once, their steps in order."""
    fired_at = history[-1]["trigger"]["fired_at"]
    placed = {
        key: replace(place,
                     run=history_run_name(fired_at, key if place.layer is None else place.layer),
                     root=history_root(place.root))
        for key, place in placements(history[-1]["pre_clip"]).items()
    }
    runs = bucket_runs(writer)
    for stats in history:
        _write_scalars(runs, placed, stats)
    runs.close_runs(f"{HISTORY_ROOT}/fire-{fired_at:06d}/")
    runs.logged_fire = fired_at


def log_string_field(stats: Dict) -> str:
    """`` layer grad norm: 0: 3.1E-01 | 1: 2.9E-01 | ... |`` for the layers, pre-clip (``encoder.0: ...`` in
    a model of several layer stacks)."""
    layers = [(key, values["norm"]) for key, values in stats["pre_clip"].items() if is_layer(key)]
    skipped = " step skipped (skip_step) |" if stats.get(SKIPPED) else ""
    return " layer grad norm:" + "".join(f" {key}: {norm:.3E} |" for key, norm in layers) + skipped


def _write_new_history(engine, writer) -> None:
    """The recorded steps of the engine's last fire, if not written yet."""
    history = getattr(engine, "get_layer_grad_norms_history", lambda: None)()
    if history and bucket_runs(writer).logged_fire != history[-1]["trigger"]["fired_at"]:
        write_history(writer, history)


def log_layer_grad_norms(engine, iteration: int, writer, args: argparse.Namespace, loss=None) -> str:
    """Log the engine's newest per-layer statistics, once, at the step they belong to; returns the
    log-line field.

    ``engine`` is the DeepSpeed engine, ``writer`` the TensorBoard writer (``None`` on ranks without
    one). Every result the engine publishes is written to TensorBoard once, whatever the interval that
    measured it, provided the hook runs before the next one replaces it (each iteration, as Megatron
    calls it). The field is returned on ``args.log_interval`` iterations measured at that iteration,
    else ``''``.

    A fire's recorded steps (``trigger.history``) are written once, when the hook first sees them.

    ``loss``: the iteration's loss as Megatron reduces it (``loss_dict["lm loss"]``, the same on every rank),
    reported to the engine for ``trigger.loss_factor``; it is judged at the end of the next optimizer step. It
    comes after its step, so ``skip_step`` judges the global norm alone here (``report_loss``'s ``before_step``).
    Without a ``loss_factor`` it is not touched: Megatron's loss stays on the device, and an iteration the hook
    does not log costs no host synchronisation.
    """
    if not getattr(args, "log_layer_grad_norms", False):
        return ""
    adapter = getattr(engine, "layer_grad_norms", None)
    if loss is not None and adapter is not None and adapter.wants_loss:
        adapter.report_loss(loss, before_step=False)  # the hook runs after the step: not for skip_step
    if writer is not None:
        _write_new_history(engine, writer)
    stats = engine.get_layer_grad_norms()
    if stats is None:
        return ""
    if writer is not None and bucket_runs(writer).logged_step != stats["step"]:
        write_tensorboard(writer, stats)
    if stats["step"] != iteration or iteration % getattr(args, "log_interval", 1):
        return ""
    return log_string_field(stats)
