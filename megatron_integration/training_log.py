"""Per-layer gradient norms in Megatron's training log and TensorBoard.

``log_layer_grad_norms`` is called once per iteration from the training loop. Whenever the engine holds a
result not yet logged (a step on the interval, a step a trigger captured, a step a ds_config block
measures on an interval of its own) it writes, on the rank that owns the TensorBoard writer, one run per
layer (``layer-grad-norms/layer00``, beside the writer's own run) holding one scalar per phase
(pre-/post-clip; the ``optimizer_statistics`` kinds and the update-to-weight ratio where the result holds
them) and statistic, against the step the result belongs to (names in ``deepspeed_patch.outputs.tags``); and it
returns a compact field for the stdout log line. Otherwise it returns at once: no collective, no work.

When the trigger fires with a flight recorder (``trigger.history``), the recorded steps of every bucket go,
once per fire, to runs of their own (``layer-grad-norms-history/fire-000123/layer00``): written into the
runs above, steps going backwards would make TensorBoard purge the later points of those runs.

Both are readers of the results behind ``publish.Consumer`` (``bucket_runs``): each writes its runs from one
thread, and a failure (a full disk, a writer's error) logs one traceback and stops that reader on this rank;
training, the log line and the other reader go on.

Against the iteration only: Megatron-DeepSpeed writes its headline scalars (loss, learning rate,
grad-norm) also ``vs samples`` and ``vs tokens``, but its per-component diagnostics (timers,
throughput, memory) against the iteration alone, and these statistics are such diagnostics: a
``vs`` copy would triple the cards while ``steps-vs-samples`` already maps iterations to samples.
"""

import argparse
from typing import Dict, List

from deepspeed_patch.outputs.tags import SKIPPED, is_layer

from .bucket_runs import bucket_runs


def write_tensorboard(writer, stats: Dict) -> None:
    """Every selected bucket's statistics into its run, against their step (the live runs' reader)."""
    runs = bucket_runs(writer)
    runs.live(stats, stats["step"])
    runs.logged_step = stats["step"]


def write_history(writer, history: List[Dict]) -> None:
    """A fire's recorded steps (``get_layer_grad_norms_history()``, oldest first), each bucket into its run
    of that fire (the history runs' reader)."""
    runs = bucket_runs(writer)
    fired_at = history[-1]["trigger"]["fired_at"]
    runs.history(history, fired_at)
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
