"""The call sites inside DeepSpeed, applied at run time by ``install()``.

Each wrapper adds one call into ``LayerGradNormTracker`` around an existing method of
``DeepSpeedEngine`` or ``DeepSpeedZeroOptimizer``; the logic itself lives in the tracker.
"""

import functools
import logging
from typing import Callable, Dict, Optional

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .config import CONFIG_KEY, LayerGradNormsConfig, load_config
from .layer_map import build_layer_map
from .partition_slices import zero_partition_slices
from .tracker import LayerGradNormTracker

logger = logging.getLogger(__name__)

TRACKER_ATTR = "layer_grad_norm_tracker"
_INSTALLED_ATTR = "_layer_grad_norms_installed"


class UnsupportedSetupError(RuntimeError):
    """``layer_grad_norms`` is enabled on a set-up it cannot measure correctly (yet)."""


def engine_config(engine: DeepSpeedEngine) -> LayerGradNormsConfig:
    """The validated ``layer_grad_norms`` block of the engine's ds_config."""
    return load_config(engine._config._param_dict)


def attach_tracker(engine: DeepSpeedEngine, optimizer: DeepSpeedZeroOptimizer) -> None:
    """Build the layer map and partition slices once, at start-up, if the config asks for it."""
    config = engine_config(engine)
    if not config.enabled:
        return
    _check_supported(engine, optimizer)
    names = optimizer.param_names
    trainable = [(names[param], param) for group in optimizer.bit16_groups for param in group]
    layer_map = build_layer_map(trainable, names.values(), config.layer_pattern)
    if layer_map.num_layers == 0:
        examples = ", ".join(name for name, _ in trainable[:5])
        logger.warning(
            "%s: no parameter name matches the layer pattern %r (examples: %s); every parameter is "
            "reported in a bucket named after its module", CONFIG_KEY, config.layer_pattern or "default", examples)
    device = optimizer.single_partition_of_fp32_groups[0].device
    slices = [
        zero_partition_slices(optimizer, index, layer_map.bucket_of, device)
        for index in range(len(optimizer.bit16_groups))
    ]
    tracker = LayerGradNormTracker(config, layer_map, slices, optimizer.dp_process_group, device)
    setattr(optimizer, TRACKER_ATTR, tracker)


def _check_supported(engine: DeepSpeedEngine, optimizer: DeepSpeedZeroOptimizer) -> None:
    refusals = {
        "pipeline parallelism (PipelineModule)": isinstance(engine.module, PipelineModule),
        "tensor/model parallelism (mpu)": engine.mpu is not None and engine.mpu.get_model_parallel_world_size() > 1,
        "MoE expert parameter groups": optimizer.has_moe_layers,
        "ZenFlow": bool(getattr(optimizer, "zenflow", False)),
        "torch autocast": optimizer.torch_autocast_gradscaler is not None,
        "the Muon optimizer": "muon" in type(optimizer.optimizer).__name__.lower(),
    }
    refused = [what for what, present in refusals.items() if present]
    if refused:
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support {', '.join(refused)} yet; "
                                    f"remove the '{CONFIG_KEY}' block or set enabled=false")


def check_engine(engine: DeepSpeedEngine) -> None:
    """Fail at initialize when the block is enabled but the engine has no ZeRO-1/2 optimizer to measure."""
    if engine_config(engine).enabled and getattr(engine.optimizer, TRACKER_ATTR, None) is None:
        raise UnsupportedSetupError(
            f"{CONFIG_KEY} needs the ZeRO stage 1 or 2 optimizer (DeepSpeedZeroOptimizer); this engine uses "
            f"{type(engine.optimizer).__name__} (zero_optimization.stage={engine.zero_optimization_stage()}, "
            f"bf16={engine.bfloat16_enabled()}, fp16={engine.fp16_enabled()}). bf16 under ZeRO-1 with fp32 "
            "gradient accumulation selects BF16_Optimizer, which is not supported yet")


def _tracker(optimizer) -> Optional[LayerGradNormTracker]:
    return getattr(optimizer, TRACKER_ATTR, None)


def overflow_partitions(optimizer: DeepSpeedZeroOptimizer) -> Dict[int, torch.Tensor]:
    """Each group's flat gradient partition, as it stands when the loss scaler skips a step."""
    flat = {}
    for index in range(len(optimizer.bit16_groups)):
        if optimizer.cpu_offload:
            flat[index] = optimizer.single_partition_of_fp32_groups[index].grad
            continue
        grads = optimizer.averaged_gradients[index]
        flat[index] = getattr(grads, "flat_partition", None)
        if flat[index] is None:
            flat[index] = torch.cat([grad.reshape(-1) for grad in grads])
    return flat


def _group_of(optimizer: DeepSpeedZeroOptimizer, flat_grad: torch.Tensor) -> int:
    for index, partition in enumerate(optimizer.single_partition_of_fp32_groups):
        if partition.grad is flat_grad:
            return index
    raise RuntimeError(f"{CONFIG_KEY}: unscale_and_clip_grads got a gradient of no known parameter group")


# --- wrappers -------------------------------------------------------------------------------------


def _wrap(cls, name: str, make_wrapper: Callable[[Callable], Callable]) -> None:
    original = getattr(cls, name)
    setattr(cls, name, functools.wraps(original)(make_wrapper(original)))


def _configure_zero_optimizer(original):

    def wrapper(self, *args, **kwargs):
        optimizer = original(self, *args, **kwargs)
        if isinstance(optimizer, DeepSpeedZeroOptimizer):
            attach_tracker(self, optimizer)
        return optimizer

    return wrapper


def _engine_init(original):

    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        check_engine(self)

    return wrapper


def _step(original):

    def wrapper(self, *args, **kwargs):
        tracker = _tracker(self)
        if tracker is None:
            return original(self, *args, **kwargs)
        tracker.begin_step()
        result = original(self, *args, **kwargs)
        tracker.end_step()
        return result

    return wrapper


def _unscale_and_clip_grads(original):

    def wrapper(self, grad_groups_flat, total_norm):
        tracker = _tracker(self)
        if tracker is not None and tracker.measuring:
            flat_grad = grad_groups_flat[0]
            tracker.observe_partition(_group_of(self, flat_grad), flat_grad, total_norm, self.clip_grad,
                                      self.loss_scale)
        return original(self, grad_groups_flat, total_norm)

    return wrapper


def _update_scale(original):

    def wrapper(self, has_overflow=False):
        tracker = _tracker(self)
        if tracker is not None and tracker.measuring:
            tracker.observe_loss_scale(self.loss_scale, overflow_partitions(self) if has_overflow else None)
        return original(self, has_overflow)

    return wrapper


def get_layer_grad_norms(self) -> Optional[dict]:
    """Per-layer gradient statistics of the last measured step, or ``None``; see DESIGN.md section 2."""
    tracker = _tracker(self)
    return None if tracker is None else tracker.get()


def engine_get_layer_grad_norms(self) -> Optional[dict]:
    """Per-layer gradient statistics of the last measured step, or ``None``; see DESIGN.md section 2."""
    getter = getattr(self.optimizer, "get_layer_grad_norms", None)
    return None if getter is None else getter()


def apply() -> bool:
    """Apply the wrappers once; returns False when they were already applied."""
    if getattr(DeepSpeedZeroOptimizer, _INSTALLED_ATTR, False):
        return False
    _wrap(DeepSpeedEngine, "__init__", _engine_init)
    _wrap(DeepSpeedEngine, "_configure_zero_optimizer", _configure_zero_optimizer)
    _wrap(DeepSpeedZeroOptimizer, "step", _step)
    _wrap(DeepSpeedZeroOptimizer, "unscale_and_clip_grads", _unscale_and_clip_grads)
    _wrap(DeepSpeedZeroOptimizer, "_update_scale", _update_scale)
    DeepSpeedZeroOptimizer.get_layer_grad_norms = get_layer_grad_norms
    DeepSpeedEngine.get_layer_grad_norms = engine_get_layer_grad_norms
    setattr(DeepSpeedZeroOptimizer, _INSTALLED_ATTR, True)
    return True
