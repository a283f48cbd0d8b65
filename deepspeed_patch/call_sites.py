# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What DeepSpeed's config, engine and optimizers call, one function per call site.

Each function is called with the arguments of the method it sits in (``self`` first): at the top
of the method, at its end, or on the value it returns, so that each method changes by one line.

- ``DeepSpeedConfig._initialize_params``: ``read_config`` validates the ``layer_grad_norms`` block.
- ``DeepSpeedEngine``: ``attach_*`` build the layer map when an optimizer is configured;
  ``before_model_step`` and ``after_model_step`` bracket the optimizer step (and the engine's own
  clipping without ZeRO); ``get_layer_grad_norms`` and ``set_layer_grad_norms`` are its methods.
- ``DeepSpeedZeroOptimizer`` (ZeRO-1/2), ``FP16_Optimizer`` and ``FP16_UnfusedOptimizer`` (no ZeRO,
  fp16/bf16): the gradient is read where the optimizer unscales and clips it, or, on a step the
  loss scaler skips, before it is dropped. ``BF16_Optimizer`` holds it when the
  step begins.
"""

import logging
import weakref
from typing import Callable, Dict, List, Optional

import torch
from deepspeed import comm as dist
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from .config import CONFIG_KEY, LayerGradNormsConfig, LayerGradNormsConfigError, load_config
from .layer_map import LayerMap, bucket_label, build_layer_map, build_pipeline_layer_map
from .partition_slices import bf16_partition_slices, fused_fp16_partition_slices, zero_partition_slices
from .plain import LayerGradNorms
from .statistics import REPLICATED, bf16_clip_divisor, zero_unscale_divisor
from .tracker import LayerGradNormTracker

logger = logging.getLogger(__name__)

TRACKER_ATTR = "layer_grad_norm_tracker"


class UnsupportedSetupError(RuntimeError):
    """``layer_grad_norms`` is enabled on a set-up it cannot measure correctly (yet)."""


# --- DeepSpeedConfig ------------------------------------------------------------------------------


def read_config(ds_config, param_dict: dict) -> None:
    """Validate the ``layer_grad_norms`` block as the rest of the ds_config is read."""
    ds_config.layer_grad_norms_config = load_config(param_dict)


# --- DeepSpeedEngine: set-up ----------------------------------------------------------------------


def attach_zero(engine, optimizer) -> None:
    """After ``_configure_zero_optimizer``: ZeRO-1/2's flat fp32 partitions (stage 3 is refused later)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        _attach_flat(engine, optimizer, optimizer.bit16_groups, zero_partition_slices,
                     optimizer.single_partition_of_fp32_groups[0].device)


def attach_bf16(engine, optimizer) -> None:
    """After ``_configure_bf16_optimizer``: BF16_Optimizer's flat fp32 gradient partitions."""
    _attach_flat(engine, optimizer, optimizer.bf16_groups, bf16_partition_slices,
                 optimizer.fp32_groups_gradients_flat[0].device)


def attach_fp16(engine, optimizer) -> None:
    """After ``_configure_fp16_optimizer`` (no ZeRO, fp16 or bf16): each rank holds the whole gradient."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if isinstance(optimizer, FP16_UnfusedOptimizer) and not optimizer.fused_lamb_legacy:
        _attach_unfused(engine, optimizer)
    elif isinstance(optimizer, FP16_Optimizer) and not optimizer.fused_adam_legacy:
        _attach_flat(engine,
                     optimizer,
                     optimizer.fp16_groups,
                     fused_fp16_partition_slices,
                     optimizer.fp32_groups_flat[0].device,
                     group=REPLICATED)


def attach_engine(engine) -> None:
    """At the end of ``DeepSpeedEngine.__init__``: DeepSpeed without ZeRO in fp32 (the engine clips) is
    measured from the module's ``.grad``; any other engine without an optimizer tracker is refused."""
    config = engine_config(engine)
    if not _wanted(config) or _tracker(engine.optimizer) is not None:
        return
    if _plain_fp32(engine):
        if config.trigger is not None:
            raise UnsupportedSetupError(f"{CONFIG_KEY}.trigger needs an optimizer that reports the global "
                                        "gradient norm (ZeRO-1/2, BF16_Optimizer, fp16/bf16 without ZeRO)")
        engine_ref = weakref.ref(engine)
        setattr(engine, TRACKER_ATTR,
                LayerGradNorms(engine.module, lambda: engine_ref().global_steps, **config.model_dump()))
        return
    raise UnsupportedSetupError(
        f"{CONFIG_KEY} needs the ZeRO stage 1 or 2 optimizer (DeepSpeedZeroOptimizer), BF16_Optimizer, or no "
        f"ZeRO (fp32, or FP16_Optimizer / FP16_UnfusedOptimizer for fp16/bf16); this engine uses "
        f"{type(engine.optimizer).__name__} (zero_optimization.stage={engine.zero_optimization_stage()}, "
        f"bf16={engine.bfloat16_enabled()}, fp16={engine.fp16_enabled()})")


def engine_config(engine) -> LayerGradNormsConfig:
    """The validated ``layer_grad_norms`` block of the engine's ds_config."""
    return engine._config.layer_grad_norms_config


def _wanted(config: LayerGradNormsConfig) -> bool:
    """Measure now, or be ready to: a trigger or a control file can switch measuring on later."""
    return config.enabled or config.trigger is not None or config.control_file is not None


def _attach_flat(engine,
                 optimizer,
                 param_groups: List[List[torch.nn.Parameter]],
                 build_slices: Callable,
                 device,
                 group=None) -> None:
    """Build the layer map and partition slices once, at start-up, if the config asks for it.

    ``param_groups`` are the optimizer's trainable parameters in flat-buffer order, one list per
    group; ``build_slices(optimizer, group_index, bucket_of, device)`` lays out one group;
    ``group``: the ranks to combine over (by default, those that together hold the whole model), or
    ``REPLICATED`` where every rank holds the whole gradient, which needs the whole model on each.
    """
    config = engine_config(engine)
    if not _wanted(config):
        return
    _check_supported(optimizer)
    if group is REPLICATED:
        _check_whole_model(engine)
    names = engine.param_names
    trainable = [(names[param], param) for group in param_groups for param in group]
    layer_map = _layer_map(engine, config, trainable, names.values())
    tensor_rank = bwc_tensor_model_parallel_rank(engine.mpu)

    def bucket_of(param) -> Optional[int]:
        # DeepSpeed's global-norm rule: a pipeline-tied copy, and a tensor-parallel replica off
        # TP rank 0, are counted on another rank.
        counted_elsewhere = getattr(param, "ds_pipe_replicated", False) or (tensor_rank != 0
                                                                            and not is_model_parallel_parameter(param))
        return None if counted_elsewhere else layer_map.bucket_of(param)

    slices = [build_slices(optimizer, index, bucket_of, device) for index in range(len(param_groups))]
    _set_tracker(engine, optimizer, config, layer_map, slices,
                 _stats_group(engine, optimizer) if group is None else group, device)


def _set_tracker(engine, optimizer, config, layer_map, slices, group, device) -> None:
    engine_ref = weakref.ref(engine)
    tracker = LayerGradNormTracker(config,
                                   layer_map,
                                   slices,
                                   group,
                                   device,
                                   completed_steps=lambda: engine_ref().global_steps)
    setattr(optimizer, TRACKER_ATTR, tracker)


def _layer_map(engine, config: LayerGradNormsConfig, trainable, all_names) -> LayerMap:
    from deepspeed.runtime.pipe.module import PipelineModule

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


def _stats_group(engine, optimizer):
    """The ranks whose partitions make up the whole model: the data-parallel group, or all ranks
    when pipeline or tensor parallelism splits the model further."""
    if engine.mpu is None or engine.mpu.get_model_parallel_world_size() == 1:
        return optimizer.dp_process_group
    covered = dist.get_world_size(group=optimizer.dp_process_group) * engine.mpu.get_model_parallel_world_size()
    if covered != dist.get_world_size():
        raise UnsupportedSetupError(f"{CONFIG_KEY}: data x model parallel ranks ({covered}) are not all "
                                    f"{dist.get_world_size()} ranks (sequence or expert parallelism?); not supported")
    return None


def _attach_unfused(engine, optimizer) -> None:
    """FP16_UnfusedOptimizer: per-parameter fp32 copies of the gradient, one group each."""
    config = engine_config(engine)
    if not _wanted(config):
        return
    _check_supported(optimizer)
    _check_whole_model(engine)
    names = engine.param_names
    trainable = [(names[param], param) for group in optimizer.fp16_groups for param in group]
    layer_map = _layer_map(engine, config, trainable, names.values())
    device = trainable[0][1].device
    members = []
    for group in optimizer.fp16_groups:
        measured = [index for index, param in enumerate(group) if layer_map.bucket_of(param) is not None]
        buckets = torch.tensor([layer_map.bucket_of(group[index]) for index in measured],
                               dtype=torch.int64,
                               device=device)
        members.append((measured, buckets))
    _set_tracker(engine, optimizer, config, layer_map, [None] * len(members), REPLICATED, device)
    optimizer._layer_grad_norm_members = members


def _check_supported(optimizer) -> None:
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


def _check_whole_model(engine) -> None:
    if not _whole_model_on_each_rank(engine):
        raise UnsupportedSetupError(f"{CONFIG_KEY}: without ZeRO, pipeline and tensor parallelism are not supported")


def _plain_fp32(engine) -> bool:
    """fp32 without ZeRO, on one data-parallel group: every rank holds the averaged gradient in ``.grad``."""
    return (engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and isinstance(engine.optimizer, torch.optim.Optimizer) and _whole_model_on_each_rank(engine))


def _whole_model_on_each_rank(engine) -> bool:
    """No pipeline stages, no tensor shards: each rank's gradient is the whole model's."""
    from deepspeed.runtime.pipe.module import PipelineModule

    return not isinstance(engine.module, PipelineModule) and (engine.mpu is None
                                                              or engine.mpu.get_model_parallel_world_size() == 1)


# --- DeepSpeedEngine: each optimizer step ---------------------------------------------------------


def before_model_step(engine, lr_kwargs) -> None:
    """Top of ``_take_model_step``: the gradients are reduced; nothing has clipped or stepped yet."""
    plain = getattr(engine, TRACKER_ATTR, None)
    if plain is not None:
        plain.measure_before_clipping(engine.gradient_clipping())
        return
    tracker = _tracker(engine.optimizer)
    if tracker is not None and tracker.begin_step() and _is_bf16_optimizer(engine.optimizer):
        for index, flat_grad in enumerate(engine.optimizer.fp32_groups_gradient_flat_partition):
            tracker.observe(index, flat_grad)


def after_model_step(engine) -> None:
    """End of ``_take_model_step``: reduce and publish a measured step, feed the trigger, log."""
    plain = getattr(engine, TRACKER_ATTR, None)
    tracker = plain.tracker if plain is not None else _tracker(engine.optimizer)
    if tracker is None:
        return
    if plain is None:
        optimizer = engine.optimizer
        if tracker.measuring and not optimizer.overflow and _is_bf16_optimizer(optimizer):
            with tracker.guarded("reading the clip factor"):
                tracker.set_applied_scale(bf16_clip_divisor(optimizer._global_grad_norm, optimizer.clip_grad))
        tracker.end_step(optimizer.overflow)
        tracker.after_step(optimizer._global_grad_norm, optimizer.overflow)
    write_monitor_events(engine, tracker)


def _is_bf16_optimizer(optimizer) -> bool:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    return isinstance(optimizer, BF16_Optimizer)


def write_monitor_events(engine, tracker: LayerGradNormTracker) -> None:
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


# --- DeepSpeedZeroOptimizer (ZeRO-1/2) ------------------------------------------------------------


def zero_unscale_and_clip_grads(optimizer, grad_groups_flat, total_norm) -> None:
    """Top of ``unscale_and_clip_grads``, called once per group on the flat fp32 partition."""
    tracker = _tracker(optimizer)
    if tracker is not None and tracker.measuring:
        with tracker.guarded("reading the clipped partition"):
            flat_grad = grad_groups_flat[0]
            tracker.observe(_group_of(optimizer.single_partition_of_fp32_groups, flat_grad), flat_grad)
            tracker.set_applied_scale(zero_unscale_divisor(total_norm, optimizer.clip_grad, optimizer.loss_scale))


def zero_update_scale(optimizer, has_overflow=False) -> None:
    """Top of ``_update_scale``: once per step, before the loss scale changes and before a skipped
    step's gradients are dropped."""
    tracker = _tracker(optimizer)
    if tracker is not None and tracker.measuring:
        with tracker.guarded("reading a skipped step's gradients"):
            tracker.set_gradient_scale(optimizer.loss_scale)
            if has_overflow:
                for index, flat_grad in _overflow_partitions(optimizer).items():
                    tracker.observe(index, flat_grad.float())


def _overflow_partitions(optimizer) -> Dict[int, torch.Tensor]:
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


def _group_of(fp32_partitions: List[torch.Tensor], flat_grad: torch.Tensor) -> int:
    for index, partition in enumerate(fp32_partitions):
        if partition.grad is flat_grad:
            return index
    raise RuntimeError(f"{CONFIG_KEY}: unscale_and_clip_grads got a gradient of no known parameter group")


# --- FP16_Optimizer and FP16_UnfusedOptimizer (no ZeRO) -------------------------------------------


def fused_unscale_and_clip_grads(optimizer, grad_groups_flat, total_norm, apply_scale=True) -> None:
    """Top of FP16_Optimizer's ``unscale_and_clip_grads``: its flat fp32 gradients, all groups at once.

    Like FP16_UnfusedOptimizer's, these gradients carry no loss scale (see ``unfused_update_scale``).
    """
    tracker = _tracker(optimizer)
    if apply_scale and tracker is not None and tracker.measuring:
        with tracker.guarded("reading the fp32 gradients"):
            for flat_grad in grad_groups_flat:
                tracker.observe(_group_of(optimizer.fp32_groups_flat, flat_grad), flat_grad)


def fused_skip_step(optimizer) -> None:
    """Top of FP16_Optimizer's ``_skip_invalid_grad_norm``, before a skipped step's gradients are
    dropped: the fp16 gradients on an fp16 overflow, their flat fp32 copies on a non-finite norm."""
    tracker = _tracker(optimizer)
    if tracker is not None and tracker.measuring:
        with tracker.guarded("reading a skipped step's gradients"):
            for index, group in enumerate(optimizer.fp16_groups):
                flat_grad = optimizer.fp32_groups_flat[index].grad
                if flat_grad is None:
                    flat_grad = torch.cat([
                        param.grad.reshape(-1) if param.grad is not None else param.new_zeros(param.numel())
                        for param in group
                    ])
                tracker.observe(index, flat_grad.float())


def unfused_unscale_and_clip_grads(optimizer, total_norm, apply_scale=True) -> None:
    """Top of FP16_UnfusedOptimizer's ``unscale_and_clip_grads``: its fp32 gradient copies."""
    tracker = _tracker(optimizer)
    if apply_scale and tracker is not None and tracker.measuring:
        with tracker.guarded("reading the fp32 gradients"):
            _observe_unfused(tracker, optimizer, optimizer.fp32_groups)


def applied_scale(optimizer, combined_scale) -> None:
    """On what FP16_Optimizer's and FP16_UnfusedOptimizer's ``unscale_and_clip_grads`` return: the one
    factor they divide the gradient by."""
    tracker = _tracker(optimizer)
    if tracker is not None and tracker.measuring:
        tracker.set_applied_scale(combined_scale)


def unfused_update_scale(optimizer, skip) -> None:
    """Top of FP16_UnfusedOptimizer's ``_update_scale``: on a skipped step, before the fp16 gradients are
    dropped (their fp32 copies may not exist yet).

    The gradient scale stays 1: DeepSpeed 0.19.8's ``engine.backward`` scales the loss only for ZeRO
    optimizers, so these gradients carry no loss scale, while ``unscale_and_clip_grads`` still divides
    by it. ``post_clip`` and ``clip_coef`` (about 1 / loss scale) show what the optimizer consumes.
    """
    tracker = _tracker(optimizer)
    if skip and tracker is not None and tracker.measuring:
        with tracker.guarded("reading a skipped step's gradients"):
            _observe_unfused(tracker, optimizer, optimizer.fp16_groups)


def _observe_unfused(tracker: LayerGradNormTracker, optimizer, groups: List[List[torch.nn.Parameter]]) -> None:
    """Fold in the gradients of ``groups`` (the fp16 parameters, or their fp32 copies)."""
    for index, (group, (measured, buckets)) in enumerate(zip(groups, optimizer._layer_grad_norm_members)):
        grads = [group[j].grad if group[j].grad is not None else torch.zeros_like(group[j]) for j in measured]
        tracker.observe_runs(index, lambda grads=grads: [grad.float().reshape(-1) for grad in grads], buckets)


# --- the public methods ---------------------------------------------------------------------------


def _tracker(optimizer) -> Optional[LayerGradNormTracker]:
    return getattr(optimizer, TRACKER_ATTR, None)


def _engine_tracker(engine) -> Optional[LayerGradNormTracker]:
    plain = getattr(engine, TRACKER_ATTR, None)
    return plain.tracker if plain is not None else _tracker(engine.optimizer)


def get_layer_grad_norms(engine) -> Optional[dict]:
    """Per-layer gradient statistics of the last measured optimizer step, or ``None``.

    ``{"step", "overflow", "clip_coef", "pre_clip": {bucket: {"norm", "min", "max", "abs_min",
    "abs_max", "nonfinite", ...}}, "post_clip": {...}}``, the same on every rank; buckets are
    transformer layers (``int``) and the parameters outside them (``str``).
    """
    tracker = _engine_tracker(engine)
    return None if tracker is None else tracker.get()


def optimizer_layer_grad_norms(optimizer) -> Optional[dict]:
    """The optimizer's view of ``DeepSpeedEngine.get_layer_grad_norms()``."""
    tracker = _tracker(optimizer)
    return None if tracker is None else tracker.get()


def set_layer_grad_norms(engine,
                         enabled: Optional[bool] = None,
                         interval: Optional[int] = None,
                         layers: Optional[object] = None) -> None:
    """Switch per-layer statistics on or off, or change their interval or layers, on a live engine.

    Call it on every rank at the same step (as SPMD training code does); the ds_config needs a
    ``layer_grad_norms`` block at initialize (``enabled: false`` with a trigger or control file, or
    ``enabled: true``).
    """
    tracker = _engine_tracker(engine)
    if tracker is None:
        raise UnsupportedSetupError(f"set_layer_grad_norms: this engine was initialized without an enabled "
                                    f"'{CONFIG_KEY}' block, so there is no layer map to measure with")
    tracker.set_options(enabled=enabled, interval=interval, layers=layers)
