"""Where DeepSpeed calls ``call_sites``: the table both ``install()`` and the upstream patch follow.

``install()`` wraps each listed method at run time; ``deepspeed_patch.upstream`` writes the same
calls into DeepSpeed's source. One table keeps the two identical.

A call site is ``(file, class, method, where, function)``:

- ``START``: ``function(self, <the method's arguments>)`` runs first;
- ``END``: ``function(self)`` runs last (the method returns nothing);
- ``RESULT``: ``function(self, <returned value>)`` runs before the method's single ``return``;
- ``METHOD``: the class gains a method of that name that returns ``function(self, ...)``.
"""

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

from . import call_sites

START, END, RESULT, METHOD = "start", "end", "result", "method"


@dataclass(frozen=True)
class CallSite:
    path: str
    """The source file, relative to the ``deepspeed`` package."""
    cls: str
    method: str
    where: str
    function: str
    """The name of the function in ``call_sites``."""

    @property
    def module(self) -> str:
        return "deepspeed." + self.path.removesuffix(".py").replace("/", ".")


_CONFIG = "runtime/config.py", "DeepSpeedConfig"
_ENGINE = "runtime/engine.py", "DeepSpeedEngine"
_ZERO = "runtime/zero/stage_1_and_2.py", "DeepSpeedZeroOptimizer"
_BF16 = "runtime/bf16_optimizer.py", "BF16_Optimizer"
_FUSED = "runtime/fp16/fused_optimizer.py", "FP16_Optimizer"
_UNFUSED = "runtime/fp16/unfused_optimizer.py", "FP16_UnfusedOptimizer"

CALL_SITES = (
    CallSite(*_CONFIG, "_initialize_params", START, "read_config"),
    CallSite(*_ENGINE, "__init__", END, "attach_engine"),
    CallSite(*_ENGINE, "_configure_fp16_optimizer", RESULT, "attach_fp16"),
    CallSite(*_ENGINE, "_configure_bf16_optimizer", RESULT, "attach_bf16"),
    CallSite(*_ENGINE, "_configure_zero_optimizer", RESULT, "attach_zero"),
    CallSite(*_ENGINE, "_take_model_step", START, "before_model_step"),
    CallSite(*_ENGINE, "_take_model_step", END, "after_model_step"),
    CallSite(*_ENGINE, "get_layer_grad_norms", METHOD, "get_layer_grad_norms"),
    CallSite(*_ENGINE, "set_layer_grad_norms", METHOD, "set_layer_grad_norms"),
    CallSite(*_ZERO, "unscale_and_clip_grads", START, "zero_unscale_and_clip_grads"),
    CallSite(*_ZERO, "_update_scale", START, "zero_update_scale"),
    CallSite(*_ZERO, "get_layer_grad_norms", METHOD, "optimizer_layer_grad_norms"),
    CallSite(*_BF16, "get_layer_grad_norms", METHOD, "optimizer_layer_grad_norms"),
    CallSite(*_FUSED, "unscale_and_clip_grads", START, "fused_unscale_and_clip_grads"),
    CallSite(*_FUSED, "unscale_and_clip_grads", RESULT, "applied_scale"),
    CallSite(*_FUSED, "_skip_invalid_grad_norm", START, "fused_skip_step"),
    CallSite(*_FUSED, "get_layer_grad_norms", METHOD, "optimizer_layer_grad_norms"),
    CallSite(*_UNFUSED, "unscale_and_clip_grads", START, "unfused_unscale_and_clip_grads"),
    CallSite(*_UNFUSED, "unscale_and_clip_grads", RESULT, "applied_scale"),
    CallSite(*_UNFUSED, "_update_scale", START, "unfused_update_scale"),
    CallSite(*_UNFUSED, "get_layer_grad_norms", METHOD, "optimizer_layer_grad_norms"),
)


def _wrapper(original: Callable, where: str, function: Callable) -> Callable:
    """``original`` with ``function`` called as the call site's ``where`` says."""

    def wrapper(self, *args, **kwargs):
        if where == START:
            function(self, *args, **kwargs)
        result = original(self, *args, **kwargs)
        if where == END:
            function(self)
        elif where == RESULT:
            function(self, result)
        return result

    return functools.wraps(original)(wrapper)


def apply() -> bool:
    """Place every call site once; returns False when they were already placed."""
    from deepspeed.runtime.engine import DeepSpeedEngine as engine_class

    marker = "_layer_grad_norms_installed"
    if getattr(engine_class, marker, False):
        return False
    for site in CALL_SITES:
        cls = getattr(importlib.import_module(site.module), site.cls)
        function = getattr(call_sites, site.function)
        if site.where == METHOD:
            setattr(cls, site.method, function)
        else:
            setattr(cls, site.method, _wrapper(getattr(cls, site.method), site.where, function))
    setattr(engine_class, marker, True)
    return True
