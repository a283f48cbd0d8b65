# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Per-layer gradient statistics in the Hugging Face Trainer's logs: ``LayerGradNormsCallback``.

Under DeepSpeed the engine steps inside the Trainer's ``training_step``: no callback ever sees a gradient,
so the statistics are measured inside DeepSpeed's optimizer (the ds_config's ``layer_grad_norms`` block)
and only read here. Without DeepSpeed (one process, DDP) the callback measures ``param.grad`` itself
(``plain.LayerGradNorms``) in ``on_pre_optimizer_step``, the only event between backward and the
optimizer step; the Trainer has clipped the gradient by then, so the pre-clip values are the measured ones
divided by the Trainer's clip factor (``max_grad_norm / (grad_norm + 1e-6)``, at most 1, as
``torch.nn.utils.clip_grad_norm_`` multiplies by), using the ``grad_norm`` the Trainer logs for that step.

Either way the values go into the logs of the Trainer's logging steps, in the flat form of ``tags``
(``layer-grad-norms/pre-clip/layer00``), so they reach ``trainer.state.log_history`` and every
``report_to`` integration (TensorBoard and W&B show them as ``train/layer-grad-norms/pre-clip/layer00``); the
console line (the Trainer's ``PrinterCallback`` or progress bar) stays the Trainer's own unless asked for them:
a 32-layer model's values would add some 20 kB to each line.

The readers of the values (the Trainer's logs, each ``report_to`` integration, the console) are guarded in
``hf_readers``.
"""

import math
import sys
import warnings
from typing import Any, Dict, Optional, Sequence, Set, Tuple

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler
from transformers.trainer_utils import IntervalStrategy

from .config import CONFIG_KEY
from .outputs.hf_readers import LogStep, TrainerLogs, guard_readers
from .outputs.publish import Consumer
from .outputs.tags import LOGGED_STATISTICS, WRITTEN_PHASES, flat_scalars
from .statistics.clipping import torch_clip_divisor

__all__ = ["LayerGradNormsCallback"]


class LayerGradNormsCallback(TrainerCallback):
    """Adds each selected bucket's gradient statistics to the Trainer's logs at its logging steps.

    ``statistics``: any of ``"norm"``, ``"min"``, ``"max"`` (the norm by default); ``phases``: any of
    ``tags.WRITTEN_PHASES`` (all by default): ``"pre_clip"``, ``"post_clip"``, the block's ``optimizer_statistics``
    kinds ``"param"``, ``"update"``, ``"exp_avg"``, ``"exp_avg_sq"`` (under DeepSpeed) and ``"update_to_weight"``
    (the norm of the update over that of the weights, with both kinds on), ``"adaptive_clip"`` (each bucket's
    factor, with the block's ``adaptive_clipping``); a phase a step's result lacks is
    not logged. Under DeepSpeed the buckets, layers and interval come from the ``layer_grad_norms``
    block of the DeepSpeed config given to the Trainer (``TrainingArguments(deepspeed=...)``), which needs
    ``enabled: true``; a logging step the block's ``interval`` does not measure logs no statistics (a
    warning at the start of training says so when ``logging_steps`` is not a multiple of it). Without
    DeepSpeed, ``options`` are those of ``plain.LayerGradNorms`` (``layers``, ``layer_pattern``,
    ``granularity``, ``group_by``), and only the logging steps are measured. With ``layers: "all"`` the
    root-sum-square of the pre-clip norms is the ``grad_norm`` the Trainer logs. ``console``: print a summary of
    the values in the Trainer's console line too, the largest and the smallest bucket's pre-clip norm (off by
    default: the line stays the Trainer's own); every value still reaches ``log_history`` and every ``report_to``
    integration.

    Constructing it calls ``deepspeed_patch.install()`` (when DeepSpeed is installed), which must precede
    ``deepspeed.initialize``; the Trainer calls that inside ``train()``. It may be given to the Trainer or
    added with ``trainer.add_callback``, and serve several Trainers in turn: each training run starts
    afresh, with the callback moved ahead of the ``report_to`` integrations.
    """

    def __init__(self,
                 statistics: Sequence[str] = ("norm", ),
                 phases: Sequence[str] = WRITTEN_PHASES,
                 console: bool = False,
                 **options: Any) -> None:
        self.statistics = _checked("statistics", statistics, LOGGED_STATISTICS)
        self.phases = _checked("phases", phases, WRITTEN_PHASES)
        if not isinstance(console, bool):
            raise ValueError(f"LayerGradNormsCallback(console={console!r}): must be True or False")
        self.console = console
        self.options = options
        self._optimizer = None  # under DeepSpeed: its optimizer, which holds the engine's result
        self._plain = None  # without DeepSpeed: a plain.LayerGradNorms
        self._measured: Optional[Tuple[int, Optional[dict]]] = None  # plain: (step, result of the clipped gradient)
        self._warned: Set[str] = set()  # the problems warned of in this training run
        self._logs: Optional[Consumer] = None  # this training run's reader, guarded
        _install_deepspeed_patch()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Start of a training run: forget the previous run (a callback may serve several Trainers), move
        ahead of the ``report_to`` integrations, quiet the console, and find what this run measures."""
        self._optimizer, self._plain, self._measured, self._warned = None, None, None, set()
        self._logs = Consumer("LayerGradNormsCallback's logging", TrainerLogs(self._values))
        handler = _calling_handler(self)
        if handler is None:
            self._warn(
                "order", "could not find the Trainer's callback list; callbacks listed before it (the "
                "report_to integrations) will not see the statistics, trainer.state.log_history will, and "
                "the console line may print them")
        else:
            self._move_first(handler)
            guard_readers(handler, self.console)
        from accelerate.utils import DeepSpeedOptimizerWrapper

        if not isinstance(optimizer, DeepSpeedOptimizerWrapper):
            from .plain import LayerGradNorms

            self._plain = LayerGradNorms(model, **self.options)
        elif getattr(optimizer.optimizer, CONFIG_KEY, None) is None:
            self._warn(
                "block", f"the DeepSpeed config has no '{CONFIG_KEY}' block with \"enabled\": true (or the "
                f"optimizer, {type(optimizer.optimizer).__name__}, keeps no statistics), so nothing is "
                f"measured; add \"{CONFIG_KEY}\": {{\"enabled\": true}} to TrainingArguments(deepspeed=...)")
        else:
            self._optimizer = optimizer.optimizer
            self._check_interval(args, state)

    def _move_first(self, handler: CallbackHandler) -> None:
        """Move to the head of the running Trainer's callback list, wherever this callback was added (the
        Trainer's ``callbacks``, ``trainer.add_callback``): the ``report_to`` integrations, listed before the
        callbacks a user adds, write the logs as ``on_log`` reaches them, so this callback must add its
        values first. Called from an event: moving from position i to 0 leaves the callbacks after i where
        they are, so each of them still gets this event once."""
        handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)

    def _check_interval(self, args, state) -> None:
        """Under DeepSpeed only the steps the block's ``interval`` measures have values to log."""
        interval = getattr(getattr(getattr(self._optimizer, CONFIG_KEY), "schedule", None), "interval", 1)
        steps = int(state.logging_steps)  # TrainingArguments takes a float (a ratio below 1)
        if args.logging_strategy == IntervalStrategy.STEPS and steps % interval:
            self._warn(
                "interval", f"logging_steps={steps} is not a multiple of the '{CONFIG_KEY}' block's "
                f"interval={interval}: only the steps that are multiples of {math.lcm(steps, interval)} "
                "log the statistics; make logging_steps a multiple of the interval")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        """Without DeepSpeed: measure the (clipped) gradient of a step the Trainer will log."""
        if self._plain is not None and _logs_step(args, state, state.global_step + 1):
            self._measured = (state.global_step + 1, self._plain.measure())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._logs is None:  # not a training step's log (evaluation,
            return  # the run's summary), or not in a training run
        self._logs(LogStep(args, state, logs), state.global_step)

    def _values(self, args, state, logs: Dict[str, Any]) -> Dict[str, float]:
        """The values of this logging step, by flat tag; none where nothing is measured."""
        if self._optimizer is not None:
            return self._engine_values(state)
        if self._plain is not None:
            return self._plain_values(args, state, logs.get("grad_norm"))
        return {}

    def _engine_values(self, state) -> Dict[str, float]:
        result = self._optimizer.get_layer_grad_norms()
        if result is None or result["step"] != state.global_step:
            return {}
        return flat_scalars(result, self.phases, self.statistics)

    def _plain_values(self, args, state, grad_norm: Optional[float]) -> Dict[str, float]:
        """The measured statistics are of the clipped gradient (post-clip); pre-clip is them times the
        factor the Trainer divided by, unknown when its global norm is not finite."""
        if self._measured is None or self._measured[0] != state.global_step or self._measured[1] is None:
            return {}
        clipped = self._measured[1]["pre_clip"]
        result = {"pre_clip": None, "post_clip": clipped}
        if grad_norm is not None and math.isfinite(grad_norm):
            divisor = torch_clip_divisor(grad_norm, args.max_grad_norm)
            result["pre_clip"] = {
                key: {
                    name: value * divisor
                    for name, value in stats.items() if name in self.statistics
                }
                for key, stats in clipped.items()
            }
        return flat_scalars(result, self.phases, self.statistics)

    def _warn(self, key: str, problem: str) -> None:
        """Warn of ``problem`` once per training run."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"LayerGradNormsCallback: {problem}", stacklevel=3)


def _checked(key: str, values: Sequence[str], allowed: Sequence[str]) -> Tuple[str, ...]:
    values = (values, ) if isinstance(values, str) else tuple(values)
    unknown = [value for value in values if value not in allowed]
    if unknown or not values:
        raise ValueError(f"LayerGradNormsCallback({key}={values!r}): choose from {', '.join(allowed)}")
    return values


def _logs_step(args, state, step: int) -> bool:
    """Whether the Trainer logs optimizer step ``step`` (``DefaultFlowCallback``'s rule; any step when it
    logs at epoch ends, which no step number tells)."""
    if args.logging_strategy == IntervalStrategy.NO:
        return False
    if args.logging_strategy != IntervalStrategy.STEPS:
        return True
    return (step == 1 and args.logging_first_step) or step % state.logging_steps == 0


def _calling_handler(callback: TrainerCallback) -> Optional[CallbackHandler]:
    """The ``CallbackHandler`` whose event is running: the caller of the caller of this callback's method."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and callback in owner.callbacks:
            return owner
        frame = frame.f_back
    return None


def _install_deepspeed_patch() -> None:
    """``deepspeed_patch.install()`` where DeepSpeed is installed (the Trainer runs without it too)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        from . import install

        install()
