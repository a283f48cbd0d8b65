"""Where DeepSpeed calls the per-layer statistics: the call sites (``CALL_SITES``) both ``install()`` and the
upstream patch follow.

``install()`` places each call site in DeepSpeed's classes at run time (``patching``); ``deepspeed_patch.upstream``
writes the same statements into DeepSpeed's source. One declaration of the call sites keeps the two identical.

A call site is ``(file, class, method, where, statement, needs, unless)``: it applies to the DeepSpeed
releases whose ``capabilities.Capabilities`` record has the capability ``needs`` and lacks ``unless``
(by default all of them). ``where`` is
``START`` (first, after the docstring), ``END`` (last; the method returns nothing), ``RESULT`` (just
before its single ``return``) or ``METHOD`` (a new method of the class). The statements:

- ``AdapterCall(method, arguments)``: ``if self.layer_grad_norms is not None:
  self.layer_grad_norms.<method>(<arguments>)``, ``method`` being the adapter method that is called
  and the arguments parameters of the DeepSpeed method, by name (``RETURNED``: the value it returns);
- ``Assign(attribute, function, arguments)``: ``self.<attribute> = <function>(<arguments>)``, or
  ``self.<attribute> = None`` without a function;
- ``Method(function)``: the class gains a method of ``function``'s name that returns ``function(self, ...)``.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

from .adapters import attach, get_layer_grad_norms, get_layer_grad_norms_history, set_layer_grad_norms
from .adapters.base import LayerGradNormsAdapter as Adapter
from .adapters.fused_fp16 import FusedFP16Adapter
from .adapters.unfused_fp16 import UnfusedFP16Adapter
from .adapters.zero import ZeroAdapter
from .adapters.zero3 import Zero3Adapter
from .capabilities import Capabilities
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
    needs: Optional[str] = None
    """A capability the release must have for this site (a field of ``Capabilities``)."""
    unless: Optional[str] = None
    """A capability the release must lack."""

    @property
    def module(self) -> str:
        return "deepspeed." + self.path.removesuffix(".py").replace("/", ".")

    def applies_to(self, capabilities: Capabilities) -> bool:
        return ((self.needs is None or capabilities.has(self.needs))
                and (self.unless is None or not capabilities.has(self.unless)))


_CONFIG = "runtime/config.py", "DeepSpeedConfig"
_ENGINE = "runtime/engine.py", "DeepSpeedEngine"
_ZERO = "runtime/zero/stage_1_and_2.py", "DeepSpeedZeroOptimizer"
_ZERO3 = "runtime/zero/stage3.py", "DeepSpeedZeroOptimizer_Stage3"
_BF16 = "runtime/bf16_optimizer.py", "BF16_Optimizer"
_FUSED = "runtime/fp16/fused_optimizer.py", "FP16_Optimizer"
_UNFUSED = "runtime/fp16/unfused_optimizer.py", "FP16_UnfusedOptimizer"


def _optimizer(path_and_class: Tuple[str, str], *read_points: tuple) -> Tuple[CallSite, ...]:
    """An optimizer's sites: its adapter attribute (``None`` until the engine attaches one), its read
    points ``(method, where, call[, needs[, unless]])``, ``get_layer_grad_norms`` and
    ``get_layer_grad_norms_history``."""
    attribute = CallSite(*path_and_class, "__init__", END, Assign(ATTRIBUTE))
    getters = (CallSite(*path_and_class, function.__name__, METHOD, Method(function))
               for function in (get_layer_grad_norms, get_layer_grad_norms_history))
    return (attribute, *(CallSite(*path_and_class, *read_point) for read_point in read_points), *getters)


_GROUPS_AND_NORM = ("grad_groups_flat", "total_norm")


def _remedy_state(saving_method: str = "state_dict") -> Tuple[tuple, tuple]:
    """The remedies' state (adaptive clipping's averages) in the optimizer's checkpoint: added to the dict
    ``saving_method`` returns (ZeRO-3's ``state_dict`` returns ``_rigid_state_dict()``'s), read back first thing in
    ``load_state_dict``, from the ZeRO files' state dicts or a universal checkpoint's folder."""
    return (saving_method, RESULT, AdapterCall(Adapter.save_remedies, (RETURNED, ))), \
        ("load_state_dict", START, AdapterCall(Adapter.load_remedies, ("state_dict_list", "checkpoint_folder")))


CALL_SITES = (
    CallSite(*_CONFIG, "_initialize_params", START, Assign("layer_grad_norms_config", load_config, ("param_dict", ))),
    CallSite(*_ENGINE, "__init__", END, Assign(ATTRIBUTE, attach, ("self", ))),
    CallSite(*_ENGINE, "_take_model_step", START, AdapterCall(Adapter.begin_step)),
    CallSite(*_ENGINE, "_take_model_step", END, AdapterCall(Adapter.end_step)),
    CallSite(*_ENGINE, "get_layer_grad_norms", METHOD, Method(get_layer_grad_norms)),
    CallSite(*_ENGINE, "get_layer_grad_norms_history", METHOD, Method(get_layer_grad_norms_history)),
    CallSite(*_ENGINE, "set_layer_grad_norms", METHOD, Method(set_layer_grad_norms)),
    *_optimizer(_ZERO,
                ("unscale_and_clip_grads", START, AdapterCall(ZeroAdapter.unscale_and_clip_grads, _GROUPS_AND_NORM)),
                ("_update_scale", START, AdapterCall(ZeroAdapter.update_scale, ("has_overflow", ))), *_remedy_state()),
    *_optimizer(_ZERO3, ("unscale_and_clip_grads", START,
                         AdapterCall(Zero3Adapter.unscale_and_clip_grads, ("sub_group_id", "total_norm"))),
                ("_update_scale", START, AdapterCall(Zero3Adapter.update_scale,
                                                     ("has_overflow", ))), *_remedy_state("_rigid_state_dict")),
    *_optimizer(_BF16, *_remedy_state()),  # BF16Adapter reads when the engine's step begins and ends
    *_optimizer(
        _FUSED,
        ("unscale_and_clip_grads", START,
         AdapterCall(FusedFP16Adapter.unscale_and_clip_grads, _GROUPS_AND_NORM + ("apply_scale", ))),
        ("unscale_and_clip_grads", RESULT, AdapterCall(Adapter.applied_divisor, (RETURNED, ))),
        # a skipped step's gradients: 0.19.8 drops them in one method; before, after _update_scale
        ("_skip_invalid_grad_norm", START, AdapterCall(FusedFP16Adapter.skip_step), "fp16_skip_method"),
        ("_update_scale", START, AdapterCall(FusedFP16Adapter.update_scale, ("skip", )), None, "fp16_skip_method")),
    *_optimizer(_UNFUSED, ("unscale_and_clip_grads", START,
                           AdapterCall(UnfusedFP16Adapter.unscale_and_clip_grads, ("total_norm", "apply_scale"))),
                ("unscale_and_clip_grads", RESULT, AdapterCall(Adapter.applied_divisor, (RETURNED, ))),
                ("_update_scale", START, AdapterCall(UnfusedFP16Adapter.update_scale, ("skip", )))),
)


def sites_for(capabilities: Capabilities) -> List[CallSite]:
    """The call sites of the release ``capabilities`` describes."""
    return [site for site in CALL_SITES if site.applies_to(capabilities)]
