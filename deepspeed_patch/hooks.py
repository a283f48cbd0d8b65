"""The call sites inside DeepSpeed, applied at run time by ``install()``.

Each wrapper adds a call or two into ``LayerGradNormTracker`` around an existing method of
``DeepSpeedEngine`` or of the optimizer that holds the gradient: ``DeepSpeedZeroOptimizer`` (ZeRO-1/2),
``BF16_Optimizer``, ``FP16_UnfusedOptimizer`` (no ZeRO, fp16/bf16), or the engine itself (no ZeRO,
fp32). The logic lives in the tracker and the modules it uses.
"""

import functools
import logging
import weakref
from typing import Callable, Dict, List, Optional

import torch
from deepspeed import comm as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from .config import CONFIG_KEY, LayerGradNormsConfig, LayerGradNormsConfigError, load_config
from .layer_map import LayerMap, bucket_label, build_layer_map, build_pipeline_layer_map
from .partition_slices import bf16_partition_slices, zero_partition_slices
from .plain import LayerGradNorms
from .statistics import REPLICATED, bf16_clip_divisor, zero_unscale_divisor
from .tracker import LayerGradNormTracker

logger = logging.getLogger(__name__)

TRACKER_ATTR = "layer_grad_norm_tracker"
_INSTALLED_ATTR = "_layer_grad_norms_installed"


class UnsupportedSetupError(RuntimeError):
    """``layer_grad_norms`` is enabled on a set-up it cannot measure correctly (yet)."""


def engine_config(engine: DeepSpeedEngine) -> LayerGradNormsConfig:
    """The validated ``layer_grad_norms`` block of the engine's ds_config."""
    return load_config(engine._config._param_dict)


def wanted(config: LayerGradNormsConfig) -> bool:
    """Measure now, or be ready to: a trigger or a control file can switch measuring on later."""
    return config.enabled or config.trigger is not None or config.control_file is not None


def attach_tracker(engine: DeepSpeedEngine, optimizer, param_groups: List[List[torch.nn.Parameter]],
                   build_slices: Callable, device) -> None:
    """Build the layer map and partition slices once, at start-up, if the config asks for it.

    ``param_groups`` are the optimizer's trainable parameters in flat-buffer order, one list per
    group; ``build_slices(optimizer, group_index, bucket_of, device)`` lays out one group.
    """
    config = engine_config(engine)
    if not wanted(config):
        return
    _check_supported(engine, optimizer)
    names = optimizer.param_names
    trainable = [(names[param], param) for group in param_groups for param in group]
    layer_map = _layer_map(engine, config, trainable, names.values())
    tensor_rank = bwc_tensor_model_parallel_rank(engine.mpu)

    def bucket_of(param) -> Optional[int]:
        # DeepSpeed's global-norm rule: a pipeline-tied copy, and a tensor-parallel replica off
        # TP rank 0, are counted on another rank.
        counted_elsewhere = getattr(param, "ds_pipe_replicated", False) or (
            tensor_rank != 0 and not is_model_parallel_parameter(param))
        return None if counted_elsewhere else layer_map.bucket_of(param)

    slices = [build_slices(optimizer, index, bucket_of, device) for index in range(len(param_groups))]
    engine_ref = weakref.ref(engine)
    tracker = LayerGradNormTracker(config, layer_map, slices, _stats_group(engine, optimizer), device,
                                   completed_steps=lambda: engine_ref().global_steps)
    setattr(optimizer, TRACKER_ATTR, tracker)


def _layer_map(engine: DeepSpeedEngine, config: LayerGradNormsConfig, trainable, all_names) -> LayerMap:
    if isinstance(engine.module, PipelineModule):
        if config.granularity != "layer":
            raise UnsupportedSetupError(f"{CONFIG_KEY}.granularity={config.granularity!r}: a PipelineModule is "
                                        "measured per layer only (its stages do not know each other's parameters)")
        if config.layer_pattern:
            logger.warning("%s.layer_pattern=%r is ignored for a PipelineModule: its layers come from its specs",
                           CONFIG_KEY, config.layer_pattern)
        return build_pipeline_layer_map(engine.module._layer_specs, trainable)
    layer_map = build_layer_map(trainable, all_names, config.layer_pattern, config.granularity, config.group_by)
    if config.granularity == "group_by" and not layer_map.keys:
        raise LayerGradNormsConfigError(f"{CONFIG_KEY}.group_by={config.group_by!r} matches no trainable parameter "
                                        f"(examples: {', '.join(name for name, _ in trainable[:5])})")
    if layer_map.num_layers == 0:
        examples = ", ".join(name for name, _ in trainable[:5])
        logger.warning(
            "%s: no parameter name matches the layer pattern %r (examples: %s); every parameter is "
            "reported in a bucket named after its module", CONFIG_KEY, config.layer_pattern or "default", examples)
    return layer_map


def _stats_group(engine: DeepSpeedEngine, optimizer):
    """The ranks whose partitions make up the whole model: the data-parallel group, or all ranks
    when pipeline or tensor parallelism splits the model further."""
    if engine.mpu is None or engine.mpu.get_model_parallel_world_size() == 1:
        return optimizer.dp_process_group
    covered = dist.get_world_size(group=optimizer.dp_process_group) * engine.mpu.get_model_parallel_world_size()
    if covered != dist.get_world_size():
        raise UnsupportedSetupError(f"{CONFIG_KEY}: data x model parallel ranks ({covered}) are not all "
                                    f"{dist.get_world_size()} ranks (sequence or expert parallelism?); not supported")
    return None


def attach_unfused_tracker(engine: DeepSpeedEngine, optimizer: FP16_UnfusedOptimizer) -> None:
    """DeepSpeed without ZeRO in fp16 or bf16: per-parameter fp32 copies of the gradient, one group each."""
    config = engine_config(engine)
    if not wanted(config):
        return
    _check_supported(engine, optimizer)
    if not _whole_model_on_each_rank(engine):
        raise UnsupportedSetupError(f"{CONFIG_KEY}: without ZeRO, pipeline and tensor parallelism are not supported")
    names = engine.param_names
    trainable = [(names[param], param) for group in optimizer.fp16_groups for param in group]
    layer_map = _layer_map(engine, config, trainable, names.values())
    device = trainable[0][1].device
    members = []
    for group in optimizer.fp16_groups:
        measured = [index for index, param in enumerate(group) if layer_map.bucket_of(param) is not None]
        buckets = torch.tensor([layer_map.bucket_of(group[index]) for index in measured], dtype=torch.int64,
                               device=device)
        members.append((measured, buckets))
    engine_ref = weakref.ref(engine)
    tracker = LayerGradNormTracker(config, layer_map, [None] * len(members), REPLICATED, device,
                                   completed_steps=lambda: engine_ref().global_steps)
    setattr(optimizer, TRACKER_ATTR, tracker)
    optimizer._layer_grad_norm_members = members


def _observe_unfused(optimizer: FP16_UnfusedOptimizer, groups: List[List[torch.nn.Parameter]]) -> None:
    """Fold in the gradients of ``groups`` (the fp16 parameters, or their fp32 copies)."""
    tracker = _tracker(optimizer)
    for index, (group, (measured, buckets)) in enumerate(zip(groups, optimizer._layer_grad_norm_members)):
        grads = [group[j].grad if group[j].grad is not None else torch.zeros_like(group[j]) for j in measured]
        tracker.observe_runs(index, lambda grads=grads: [grad.float().reshape(-1) for grad in grads], buckets)


def _check_supported(engine: DeepSpeedEngine, optimizer) -> None:
    refusals = {
        "MoE expert parameter groups": getattr(optimizer, "has_moe_layers", False),
        "ZenFlow": bool(getattr(optimizer, "zenflow", False)),
        "torch autocast": getattr(optimizer, "torch_autocast_gradscaler", None) is not None,
        "the Muon optimizer": "muon" in type(optimizer.optimizer).__name__.lower(),
    }
    refused = [what for what, present in refusals.items() if present]
    if refused:
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support {', '.join(refused)} yet; "
                                    f"remove the '{CONFIG_KEY}' block or set enabled=false")


def attach_engine_tracker(engine: DeepSpeedEngine) -> None:
    """At the end of initialize: DeepSpeed without ZeRO (fp32, the engine clips) is measured from the
    module's ``.grad``; any other engine without an optimizer tracker is refused."""
    config = engine_config(engine)
    if not wanted(config) or getattr(engine.optimizer, TRACKER_ATTR, None) is not None:
        return
    if _plain_fp32(engine):
        if config.trigger is not None:
            raise UnsupportedSetupError(f"{CONFIG_KEY}.trigger needs an optimizer that reports the global "
                                        "gradient norm (ZeRO-1/2, BF16_Optimizer, fp16/bf16 without ZeRO)")
        engine_ref = weakref.ref(engine)
        block = config.model_dump()
        setattr(engine, TRACKER_ATTR, LayerGradNorms(engine.module, lambda: engine_ref().global_steps, **block))
        return
    raise UnsupportedSetupError(
        f"{CONFIG_KEY} needs the ZeRO stage 1 or 2 optimizer (DeepSpeedZeroOptimizer), BF16_Optimizer, or no "
        f"ZeRO (fp32, or FP16_UnfusedOptimizer for fp16/bf16); this engine uses {type(engine.optimizer).__name__} "
        f"(zero_optimization.stage={engine.zero_optimization_stage()}, bf16={engine.bfloat16_enabled()}, "
        f"fp16={engine.fp16_enabled()})")


def _plain_fp32(engine: DeepSpeedEngine) -> bool:
    """fp32 without ZeRO, on one data-parallel group: every rank holds the averaged gradient in ``.grad``."""
    return (engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and isinstance(engine.optimizer, torch.optim.Optimizer) and _whole_model_on_each_rank(engine))


def _whole_model_on_each_rank(engine: DeepSpeedEngine) -> bool:
    """No pipeline stages, no tensor shards: each rank's gradient is the whole model's."""
    return not isinstance(engine.module, PipelineModule) and (engine.mpu is None
                                                              or engine.mpu.get_model_parallel_world_size() == 1)


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


def _attach_zero(engine: DeepSpeedEngine, optimizer) -> None:
    if isinstance(optimizer, DeepSpeedZeroOptimizer):  # not stage 3: refused in attach_engine_tracker
        attach_tracker(engine, optimizer, optimizer.bit16_groups, zero_partition_slices,
                       optimizer.single_partition_of_fp32_groups[0].device)


def _attach_bf16(engine: DeepSpeedEngine, optimizer: BF16_Optimizer) -> None:
    attach_tracker(engine, optimizer, optimizer.bf16_groups, bf16_partition_slices,
                   optimizer.fp32_groups_gradients_flat[0].device)


def _attach_unfused(engine: DeepSpeedEngine, optimizer) -> None:
    if isinstance(optimizer, FP16_UnfusedOptimizer) and not optimizer.fused_lamb_legacy:
        attach_unfused_tracker(engine, optimizer)


def _configure_optimizer(attach: Callable) -> Callable[[Callable], Callable]:
    """A wrapper for an engine's ``_configure_*_optimizer``: ``attach(engine, optimizer)`` to its result."""

    def make_wrapper(original):

        def wrapper(self, *args, **kwargs):
            optimizer = original(self, *args, **kwargs)
            attach(self, optimizer)
            return optimizer

        return wrapper

    return make_wrapper


def _engine_init(original):

    def wrapper(self, *args, **kwargs):
        original(self, *args, **kwargs)
        attach_engine_tracker(self)

    return wrapper


def _engine_take_model_step(original):
    """Without ZeRO the engine clips ``.grad`` in place here, then steps the optimizer."""

    def wrapper(self, lr_kwargs):
        plain = getattr(self, TRACKER_ATTR, None)
        if plain is not None:
            plain.measure_before_clipping(self.gradient_clipping())
        result = original(self, lr_kwargs)
        tracker = plain.tracker if plain is not None else _tracker(self.optimizer)
        if tracker is not None:
            write_monitor_events(self, tracker)
        return result

    return wrapper


def write_monitor_events(engine: DeepSpeedEngine, tracker: LayerGradNormTracker) -> None:
    """This step's statistics to DeepSpeed's monitors (TensorBoard, W&B, CSV), when it was measured."""
    stats = tracker.get()
    if (stats is None or stats["step"] != engine.global_steps or not tracker.monitor
            or not getattr(engine.monitor, "enabled", False)):
        return
    events = []
    for phase in ("pre_clip", "post_clip"):
        for key, values in (stats[phase] or {}).items():
            events += [(f"Train/Samples/layer_grad_norms/{phase}/{name}/{bucket_label(key)}", values[name],
                        engine.global_samples) for name in ("norm", "min", "max")]
    engine.monitor.write_events(events)


def _optimizer_step(original):

    def wrapper(self, *args, **kwargs):
        tracker = _tracker(self)
        if tracker is None:
            return original(self, *args, **kwargs)
        tracker.begin_step()
        result = original(self, *args, **kwargs)
        tracker.end_step(self.overflow)
        tracker.after_step(self._global_grad_norm, self.overflow)
        return result

    return wrapper


def _zero_unscale_and_clip_grads(original):
    """ZeRO calls this once per group on the flat fp32 partition, before the optimizer steps on it."""

    def wrapper(self, grad_groups_flat, total_norm):
        tracker = _tracker(self)
        if tracker is not None and tracker.measuring:
            with tracker.guarded("reading the clipped partition"):
                flat_grad = grad_groups_flat[0]
                tracker.observe(_group_of(self, flat_grad), flat_grad)
                tracker.set_applied_scale(zero_unscale_divisor(total_norm, self.clip_grad, self.loss_scale))
        return original(self, grad_groups_flat, total_norm)

    return wrapper


def _zero_update_scale(original):
    """ZeRO calls this once per step, before the loss scale changes and before a skipped step's
    gradients are dropped."""

    def wrapper(self, has_overflow=False):
        tracker = _tracker(self)
        if tracker is not None and tracker.measuring:
            with tracker.guarded("reading a skipped step's gradients"):
                tracker.set_gradient_scale(self.loss_scale)
                if has_overflow:
                    for index, flat_grad in overflow_partitions(self).items():
                        tracker.observe(index, flat_grad.float())
        return original(self, has_overflow)

    return wrapper


def _unfused_update_scale(original):
    """Called once per step; on a skipped step, before the fp16 gradients are dropped (their fp32
    copies may not exist yet).

    The gradient scale stays 1: DeepSpeed 0.19.8's ``engine.backward`` scales the loss only for ZeRO
    optimizers, so these gradients carry no loss scale, while ``unscale_and_clip_grads`` still divides
    by it. ``post_clip`` and ``clip_coef`` (about 1 / loss scale) show what the optimizer consumes.
    """

    def wrapper(self, skip):
        tracker = _tracker(self)
        if skip and tracker is not None and tracker.measuring:
            with tracker.guarded("reading a skipped step's gradients"):
                _observe_unfused(self, self.fp16_groups)
        return original(self, skip)

    return wrapper


def _unfused_unscale_and_clip_grads(original):
    """Called on the fp32 gradient copies just before the optimizer steps; returns what it divided by."""

    def wrapper(self, total_norm, apply_scale=True):
        tracker = _tracker(self)
        measuring = apply_scale and tracker is not None and tracker.measuring
        if measuring:
            with tracker.guarded("reading the fp32 gradients"):
                _observe_unfused(self, self.fp32_groups)
        combined_scale = original(self, total_norm, apply_scale)
        if measuring:
            tracker.set_applied_scale(combined_scale)
        return combined_scale

    return wrapper


def _bf16_step(original):
    """BF16_Optimizer holds the reduced fp32 gradient when step() starts; it clips it in place."""

    def wrapper(self, *args, **kwargs):
        tracker = _tracker(self)
        if tracker is None:
            return original(self, *args, **kwargs)
        if tracker.begin_step():
            for index, flat_grad in enumerate(self.fp32_groups_gradient_flat_partition):
                tracker.observe(index, flat_grad)
        result = original(self, *args, **kwargs)
        if tracker.measuring and not self.overflow:
            with tracker.guarded("reading the clip factor"):
                tracker.set_applied_scale(bf16_clip_divisor(self._global_grad_norm, self.clip_grad))
        tracker.end_step(self.overflow)
        tracker.after_step(self._global_grad_norm, self.overflow)
        return result

    return wrapper


def get_layer_grad_norms(self) -> Optional[dict]:
    """Per-layer gradient statistics of the last measured step, or ``None``; see DESIGN.md section 2."""
    tracker = _tracker(self)
    return None if tracker is None else tracker.get()


def _engine_tracker(engine: DeepSpeedEngine) -> Optional[LayerGradNormTracker]:
    plain = getattr(engine, TRACKER_ATTR, None)
    return plain.tracker if plain is not None else _tracker(engine.optimizer)


def engine_get_layer_grad_norms(self) -> Optional[dict]:
    """Per-layer gradient statistics of the last measured step, or ``None``; see DESIGN.md section 2."""
    tracker = _engine_tracker(self)
    return None if tracker is None else tracker.get()


def engine_set_layer_grad_norms(self, enabled: Optional[bool] = None, interval: Optional[int] = None,
                                layers: Optional[object] = None) -> None:
    """Switch per-layer statistics on or off, or change their interval or layers, on a live engine.

    Call it on every rank at the same step (as SPMD training code does); the ds_config needs a
    ``layer_grad_norms`` block at initialize (``enabled: false`` with a trigger or control file, or
    ``enabled: true``).
    """
    tracker = _engine_tracker(self)
    if tracker is None:
        raise UnsupportedSetupError(f"set_layer_grad_norms: this engine was initialized without an enabled "
                                    f"'{CONFIG_KEY}' block, so there is no layer map to measure with")
    tracker.set_options(enabled=enabled, interval=interval, layers=layers)


def apply() -> bool:
    """Apply the wrappers once; returns False when they were already applied."""
    if getattr(DeepSpeedZeroOptimizer, _INSTALLED_ATTR, False):
        return False
    _wrap(DeepSpeedEngine, "__init__", _engine_init)
    _wrap(DeepSpeedEngine, "_configure_zero_optimizer", _configure_optimizer(_attach_zero))
    _wrap(DeepSpeedEngine, "_configure_bf16_optimizer", _configure_optimizer(_attach_bf16))
    _wrap(DeepSpeedEngine, "_configure_fp16_optimizer", _configure_optimizer(_attach_unfused))
    _wrap(DeepSpeedEngine, "_take_model_step", _engine_take_model_step)
    _wrap(DeepSpeedZeroOptimizer, "step", _optimizer_step)
    _wrap(DeepSpeedZeroOptimizer, "unscale_and_clip_grads", _zero_unscale_and_clip_grads)
    _wrap(DeepSpeedZeroOptimizer, "_update_scale", _zero_update_scale)
    _wrap(BF16_Optimizer, "step", _bf16_step)
    _wrap(FP16_UnfusedOptimizer, "step", _optimizer_step)
    _wrap(FP16_UnfusedOptimizer, "_update_scale", _unfused_update_scale)
    _wrap(FP16_UnfusedOptimizer, "unscale_and_clip_grads", _unfused_unscale_and_clip_grads)
    DeepSpeedZeroOptimizer.get_layer_grad_norms = get_layer_grad_norms
    BF16_Optimizer.get_layer_grad_norms = get_layer_grad_norms
    FP16_UnfusedOptimizer.get_layer_grad_norms = get_layer_grad_norms
    DeepSpeedEngine.get_layer_grad_norms = engine_get_layer_grad_norms
    DeepSpeedEngine.set_layer_grad_norms = engine_set_layer_grad_norms
    setattr(DeepSpeedZeroOptimizer, _INSTALLED_ATTR, True)
    return True
