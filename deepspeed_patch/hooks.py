"""Where DeepSpeed calls the per-layer statistics: the table both ``install()`` and the upstream patch follow.

``install()`` applies each entry to DeepSpeed's classes at run time; ``deepspeed_patch.upstream`` writes
the same statements into DeepSpeed's source. One table keeps the two identical.

A call site is ``(file, class, method, where, statement)``. ``where`` is ``START`` (first, after the
docstring), ``END`` (last; the method returns nothing), ``RESULT`` (just before its single ``return``)
or ``METHOD`` (a new method of the class). The statements:

- ``AdapterCall(method, arguments)``: ``if self.layer_grad_norms is not None:
  self.layer_grad_norms.<method>(<arguments>)``, ``method`` being the adapter method that is called
  and the arguments parameters of the DeepSpeed method, by name (``RETURNED``: the value it returns);
- ``Assign(attribute, function, arguments)``: ``self.<attribute> = <function>(<arguments>)``, or
  ``self.<attribute> = None`` without a function;
- ``Method(function)``: the class gains a method of ``function``'s name that returns ``function(self, ...)``.
"""

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

from .adapters import attach, get_layer_grad_norms, set_layer_grad_norms
from .adapters.base import LayerGradNormsAdapter as Adapter
from .adapters.fused_fp16 import FusedFP16Adapter
from .adapters.unfused_fp16 import UnfusedFP16Adapter
from .adapters.zero import ZeroAdapter
from .config import load_config

START, END, RESULT, METHOD = "start", "end", "result", "method"
ATTRIBUTE = "layer_grad_norms"
RETURNED = "<returned>"


@dataclass(frozen=True)
class AdapterCall:
    method: Callable
    arguments: Tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.method.__name__


@dataclass(frozen=True)
class Assign:
    attribute: str
    function: Optional[Callable] = None
    arguments: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Method:
    function: Callable


Statement = Union[AdapterCall, Assign, Method]


@dataclass(frozen=True)
class CallSite:
    path: str
    """The source file, relative to the ``deepspeed`` package."""
    cls: str
    method: str
    where: str
    statement: Statement

    @property
    def module(self) -> str:
        return "deepspeed." + self.path.removesuffix(".py").replace("/", ".")


_CONFIG = "runtime/config.py", "DeepSpeedConfig"
_ENGINE = "runtime/engine.py", "DeepSpeedEngine"
_ZERO = "runtime/zero/stage_1_and_2.py", "DeepSpeedZeroOptimizer"
_BF16 = "runtime/bf16_optimizer.py", "BF16_Optimizer"
_FUSED = "runtime/fp16/fused_optimizer.py", "FP16_Optimizer"
_UNFUSED = "runtime/fp16/unfused_optimizer.py", "FP16_UnfusedOptimizer"


def _optimizer(path_and_class: Tuple[str, str], *read_points: Tuple[str, str, AdapterCall]) -> Tuple[CallSite, ...]:
    """An optimizer's sites: its adapter attribute (``None`` until the engine attaches one), its read
    points, and ``get_layer_grad_norms``."""
    return (CallSite(*path_and_class, "__init__", END,
                     Assign(ATTRIBUTE)), *(CallSite(*path_and_class, method, where, call)
                                           for method, where, call in read_points),
            CallSite(*path_and_class, "get_layer_grad_norms", METHOD, Method(get_layer_grad_norms)))


_GROUPS_AND_NORM = ("grad_groups_flat", "total_norm")

CALL_SITES = (
    CallSite(*_CONFIG, "_initialize_params", START, Assign("layer_grad_norms_config", load_config, ("param_dict", ))),
    CallSite(*_ENGINE, "__init__", END, Assign(ATTRIBUTE, attach, ("self", ))),
    CallSite(*_ENGINE, "_take_model_step", START, AdapterCall(Adapter.begin_step)),
    CallSite(*_ENGINE, "_take_model_step", END, AdapterCall(Adapter.end_step)),
    CallSite(*_ENGINE, "get_layer_grad_norms", METHOD, Method(get_layer_grad_norms)),
    CallSite(*_ENGINE, "set_layer_grad_norms", METHOD, Method(set_layer_grad_norms)),
    *_optimizer(_ZERO,
                ("unscale_and_clip_grads", START, AdapterCall(ZeroAdapter.unscale_and_clip_grads, _GROUPS_AND_NORM)),
                ("_update_scale", START, AdapterCall(ZeroAdapter.update_scale, ("has_overflow", )))),
    *_optimizer(_BF16),  # BF16Adapter reads when the engine's step begins and ends
    *_optimizer(_FUSED,
                ("unscale_and_clip_grads", START,
                 AdapterCall(FusedFP16Adapter.unscale_and_clip_grads, _GROUPS_AND_NORM + ("apply_scale", ))),
                ("unscale_and_clip_grads", RESULT, AdapterCall(Adapter.applied_scale, (RETURNED, ))),
                ("_skip_invalid_grad_norm", START, AdapterCall(FusedFP16Adapter.skip_step))),
    *_optimizer(_UNFUSED,
                ("unscale_and_clip_grads", START,
                 AdapterCall(UnfusedFP16Adapter.unscale_and_clip_grads, ("total_norm", "apply_scale"))),
                ("unscale_and_clip_grads", RESULT, AdapterCall(Adapter.applied_scale, (RETURNED, ))),
                ("_update_scale", START, AdapterCall(UnfusedFP16Adapter.update_scale, ("skip", )))),
)


def _arguments(signature: inspect.Signature, names: Tuple[str, ...], args: tuple, kwargs: dict, returned=None) -> list:
    """The values of the parameters ``names`` in a call ``(args, kwargs)`` of a method of ``signature``."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return [returned if name == RETURNED else bound.arguments[name] for name in names]


def _wrapped(original: Callable, where: str, statement: Union[AdapterCall, Assign]) -> Callable:
    """``original`` with ``statement`` run where the call site says."""
    signature = inspect.signature(original)

    def run(args: tuple, kwargs: dict, returned=None) -> None:
        self = args[0]
        if isinstance(statement, Assign):
            setattr(self, statement.attribute,
                    statement.function(*_arguments(signature, statement.arguments, args, kwargs)))
            return
        adapter = getattr(self, ATTRIBUTE)
        if adapter is not None:
            getattr(adapter, statement.name)(*_arguments(signature, statement.arguments, args, kwargs, returned))

    def wrapper(*args, **kwargs):
        if where == START:
            run(args, kwargs)
        result = original(*args, **kwargs)
        if where in (END, RESULT):
            run(args, kwargs, result)
        return result

    return functools.wraps(original)(wrapper)


def apply() -> bool:
    """Place every call site once; returns False when they were already placed."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    marker = "_layer_grad_norms_installed"
    if getattr(DeepSpeedEngine, marker, False):
        return False
    for site in CALL_SITES:
        cls = getattr(importlib.import_module(site.module), site.cls)
        statement = site.statement
        if isinstance(statement, Method):
            setattr(cls, site.method, statement.function)
            continue
        if isinstance(statement, Assign):
            setattr(cls, statement.attribute, None)  # the default, also for objects made before install()
        if not isinstance(statement, Assign) or statement.function is not None:
            setattr(cls, site.method, _wrapped(getattr(cls, site.method), site.where, statement))
    setattr(DeepSpeedEngine, marker, True)
    return True
