# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The readers of the per-layer values in a Hugging Face Trainer, each guarded, for ``hf.LayerGradNormsCallback``.

The callback adds the values to the Trainer's logs; from there other callbacks read them. Each such reader goes
through ``publish.Consumer``: adding them to the logs (``TrainerLogs``), and each ``report_to`` integration
writing a log that holds them (``IntegrationLogs``: the values multiply what it writes, so a full disk under its
TensorBoard directory comes sooner). A failure logs one traceback and stops that reader on its rank; training and
the other readers go on. An integration writing a log without the values is left alone: it fails as it would
without the callback. The Trainer's console callbacks print the line without the values, or when asked with a
short summary of them (the largest and the smallest bucket: ``guard_readers``). A module apart from the callback:
it wraps callbacks the Trainer owns, the callback only measures and hands over the values.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, PrinterCallback, ProgressCallback

from .publish import Consumer, Reader
from .tags import TAG_ROOT, scalar_tag

__all__ = ["LogStep", "TrainerLogs", "guard_readers"]


class LogStep(NamedTuple):
    """A training step's log, as the Trainer hands it to ``on_log``."""

    args: Any
    state: Any
    logs: Dict[str, Any]


class TrainerLogs(Reader):
    """The values of each logging step into the Trainer's logs: ``logs`` (what the ``report_to`` integrations
    write) and its copy in ``state.log_history``."""

    def __init__(self, values: Callable[[Any, Any, Dict[str, Any]], Dict[str, float]]) -> None:
        self.values = values

    def write(self, log: LogStep) -> None:
        values = self.values(log.args, log.state, log.logs)
        if not values:
            return
        log.logs.update(values)
        history = log.state.log_history
        if history and history[-1].get("step") == log.state.global_step:
            history[-1].update(values)  # the Trainer appended a copy of the logs before on_log


_VALUES = f"{TAG_ROOT}/"
"""How the names of the values begin in the logs (``tags.flat_scalars``)."""


def _holds_values(logs: Optional[Dict[str, Any]]) -> bool:
    return any(key.startswith(_VALUES) for key in logs or ())


class IntegrationLogs(Reader):
    """A ``report_to`` integration's ``on_log``, called with a log that holds the values."""

    def __init__(self, on_log: Callable) -> None:
        self.on_log = on_log

    def write(self, call: Tuple[tuple, Dict[str, Any]]) -> None:
        self.on_log(*call[0], **call[1])


class _GuardedIntegration:
    """An integration's ``on_log``: through ``publish.Consumer`` on the logs that hold the values; as it is on
    any other log. A failure there switches the integration off on this rank: each of its events (its
    ``on_train_end`` would close the writer that failed) does nothing from then on."""

    def __init__(self, integration: TrainerCallback) -> None:
        self.integration, self.on_log = integration, integration.on_log
        self.consumer = Consumer(f"the Trainer's {type(integration).__name__}", IntegrationLogs(self.on_log))

    def __call__(self, args, state, control, logs=None, **kwargs):
        if not _holds_values(logs):
            return self.on_log(args, state, control, logs=logs, **kwargs)
        self.consumer(((args, state, control), dict(kwargs, logs=logs)), state.global_step)
        if self.consumer.failed:
            for event in [name for name in vars(TrainerCallback) if name.startswith("on_")]:
                setattr(self.integration, event, _switched_off)
        return None


def _switched_off(*args, **kwargs) -> None:
    """An event of an integration switched off."""


class _ConsoleLine:
    """A console callback's ``on_log`` that does not see the values: they leave ``logs`` for its call and come
    back after it, so the callbacks after it (a user's) still see them. With ``summary`` it sees one short entry
    in their place (``summary_of``), gone again after the call."""

    def __init__(self, on_log: Callable, summary: bool) -> None:
        self.on_log = on_log
        self.summary = summary

    def __call__(self, args, state, control, logs=None, **kwargs):
        hidden = {key: logs.pop(key) for key in [key for key in logs or () if key.startswith(_VALUES)]}
        shown = summary_of(hidden) if self.summary else {}
        if logs is not None:
            logs.update(shown)
        try:
            return self.on_log(args, state, control, logs=logs, **kwargs)
        finally:
            if logs is not None:
                for key in shown:
                    logs.pop(key, None)
                logs.update(hidden)


SUMMARY_KEY = f"{TAG_ROOT} pre-clip"
"""The console's one entry of the values (``LayerGradNormsCallback(console=True)``)."""
_PRE_CLIP_NORMS = f"{scalar_tag('pre_clip', 'norm')}/"


def summary_of(values: Dict[str, Any]) -> Dict[str, str]:
    """The largest and the smallest bucket's pre-clip norm of a step's values, as one short entry; none without
    them. The line stays short whatever the model's depth: every value is in the logs."""
    norms = {
        key.removeprefix(_PRE_CLIP_NORMS): value
        for key, value in values.items() if key.startswith(_PRE_CLIP_NORMS)
    }
    if not norms:
        return {}
    largest, smallest = max(norms, key=norms.get), min(norms, key=norms.get)
    return {SUMMARY_KEY: f"max {largest} {norms[largest]:.3e}, min {smallest} {norms[smallest]:.3e}"}


def guard_readers(handler: CallbackHandler, console: bool) -> None:
    """Guard each ``report_to`` integration (the callbacks of ``transformers.integrations``), and let the Trainer's
    console callbacks (``PrinterCallback``, its progress bar, in a notebook too) print a summary of the values or
    none (``console``); each ``on_log`` wrapped once, whatever the training runs and callbacks that pass here."""
    from transformers.trainer import DEFAULT_PROGRESS_CALLBACK

    for callback in handler.callbacks:
        if isinstance(callback, (PrinterCallback, ProgressCallback, DEFAULT_PROGRESS_CALLBACK)):
            original = callback.on_log.on_log if isinstance(callback.on_log, _ConsoleLine) else callback.on_log
            callback.on_log = _ConsoleLine(original, summary=console)
        elif (type(callback).__module__.startswith("transformers.integrations")
              and not isinstance(callback.on_log, _GuardedIntegration)):
            callback.on_log = _GuardedIntegration(callback)
