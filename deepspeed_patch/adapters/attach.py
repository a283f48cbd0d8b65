# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which adapter measures a DeepSpeed engine, and what it is built from; or why none can.

Called once, at the end of ``DeepSpeedEngine.__init__``. A set-up that cannot be measured correctly
(yet) fails there, naming the reason, rather than reporting wrong numbers later.
"""

import weakref
from typing import List, Optional

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import logger
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from .. import capabilities
from ..clipping import engine_fp32_clip_square
from ..config import CONFIG_KEY, LayerGradNormsConfig, UnsupportedSetupError
from ..layer_map import model_layer_map
from ..monitor import MonitorEvents
from ..reduction import REPLICATED
from .base import LayerGradNormsAdapter, Setup
from .bf16 import BF16Adapter
from .fused_fp16 import FusedFP16Adapter
from .param_grads import ParamGradAdapter
from .unfused_fp16 import UnfusedFP16Adapter
from .zero import ZeroAdapter
from .zero3 import Zero3Adapter

# The optimizers whose gradients an adapter reads; each rank of the last two holds its complete gradient.
OPTIMIZER_FAMILIES = (ZeroAdapter, Zero3Adapter, BF16Adapter, FusedFP16Adapter, UnfusedFP16Adapter)
REPLICATED_FAMILIES = (FusedFP16Adapter, UnfusedFP16Adapter)


def attach(engine) -> Optional[LayerGradNormsAdapter]:
    """The adapter for ``engine`` (also set as its optimizer's ``layer_grad_norms``), or ``None`` when the
    ds_config does not ask for per-layer statistics."""
    config: LayerGradNormsConfig = engine._config.layer_grad_norms_config
    if not (config.enabled or config.trigger is not None or config.control_file is not None):
        return None  # a trigger or a control file can switch measuring on later: they need the adapter
    if not _steps_an_optimizer(engine):
        logger.warning(f"{CONFIG_KEY}: this engine has no optimizer ({type(engine.optimizer).__name__}), so no "
                       "gradient step to measure; per-layer statistics are off")
        return None
    optimizer = engine.optimizer
    family = next((family for family in OPTIMIZER_FAMILIES if family.handles(optimizer)), None)
    _check_moe(engine, family)
    if family is None:
        return _param_grad_adapter(engine, config)
    _check_supported(optimizer, family.unsupported(optimizer, engine.param_names, capabilities.installed()))
    if family in REPLICATED_FAMILIES:
        group = _stage0_group(engine)
    else:
        group = _stats_group(engine, optimizer)
    try:
        params = [param for group_params in family.param_groups(optimizer) for param in group_params]
        adapter = family(optimizer, _setup(engine, config, params, group))
    except AttributeError as err:  # a DeepSpeed release whose optimizer keeps its layout elsewhere
        raise UnsupportedSetupError(f"{CONFIG_KEY}: {type(optimizer).__name__} of DeepSpeed {deepspeed.__version__} "
                                    f"has no attribute {err.name!r}, which {family.__name__} reads") from err
    optimizer.layer_grad_norms = adapter
    return adapter


def _steps_an_optimizer(engine) -> bool:
    """False for an engine built without an optimizer (for inference or evaluation): under ZeRO-3 it holds
    only the parameter partitioner, ``DeepSpeedZeRoOffload``."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    return engine.optimizer is not None and not isinstance(engine.optimizer, DeepSpeedZeRoOffload)


def _param_grad_adapter(engine, config: LayerGradNormsConfig) -> ParamGradAdapter:
    """DeepSpeed without ZeRO in fp32: the engine clips the ``.grad`` it holds on every rank itself."""
    if not _plain_fp32(engine):
        raise UnsupportedSetupError(
            f"{CONFIG_KEY} needs a ZeRO optimizer (stage 1, 2 or 3), BF16_Optimizer, or no "
            f"ZeRO (fp32, or FP16_Optimizer / FP16_UnfusedOptimizer for fp16/bf16); this engine uses "
            f"{type(engine.optimizer).__name__} (zero_optimization.stage={engine.zero_optimization_stage()}, "
            f"bf16={engine.bfloat16_enabled()}, fp16={engine.fp16_enabled()})")
    if config.trigger is not None and not config.trigger.history:
        raise UnsupportedSetupError(f"{CONFIG_KEY}.trigger needs an optimizer that reports the global "
                                    "gradient norm (ZeRO-1/2/3, BF16_Optimizer, fp16/bf16 without ZeRO), or, in fp32 "
                                    "without ZeRO, trigger.history > 0 (the recorder reads every step's norm)")
    group = _stage0_group(engine)
    if config.trigger is not None and group is not REPLICATED:
        raise UnsupportedSetupError(f"{CONFIG_KEY}.trigger in fp32 without ZeRO under pipeline or tensor "
                                    "parallelism is not supported (the recorder's per-step norm would be "
                                    "this rank's stage or shard only); use ZeRO-1/2 or fp16/bf16")
    params = [param for param in engine.module.parameters() if param.requires_grad]
    clip_square = None if group is REPLICATED else _engine_clip_square(engine.module, engine.mpu)
    return ParamGradAdapter(params,
                            _setup(engine, config, params, group),
                            max_norm=engine.gradient_clipping,
                            clip_square=clip_square)


def _engine_clip_square(module: torch.nn.Module, mpu):
    """This rank's share of the square of the norm the engine clips ``module``'s gradients by under model
    parallelism (not the table's own)."""

    def clip_square() -> torch.Tensor:
        return engine_fp32_clip_square(module.parameters(), mpu)

    return clip_square


def _setup(engine, config: LayerGradNormsConfig, params: List[torch.nn.Parameter], group) -> Setup:
    """The layer map of the trainable ``params``, and the engine's step count and monitors."""
    names = engine.param_names
    _check_no_sequence_parallel(params, names)
    layer_map = model_layer_map(engine.module, config, [(names[param], param) for param in params], names.values())
    tensor_rank = bwc_tensor_model_parallel_rank(engine.mpu)

    def bucket_of(param: torch.nn.Parameter) -> Optional[int]:
        # DeepSpeed's global-norm rule: a pipeline-tied copy, and a tensor-parallel replica off
        # TP rank 0, are counted on another rank.
        counted_elsewhere = getattr(param, "ds_pipe_replicated", False) or (tensor_rank != 0
                                                                            and not is_model_parallel_parameter(param))
        return None if counted_elsewhere else layer_map.bucket_of(param)

    engine_ref = weakref.ref(engine)  # the engine holds the adapter
    return Setup(config,
                 layer_map,
                 bucket_of,
                 group,
                 completed_steps=lambda: engine_ref().global_steps,
                 monitor=MonitorEvents.wanted(engine, config.monitor),
                 capabilities=capabilities.installed())


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


def _check_supported(optimizer, family_refusals: List[str]) -> None:
    """Refuse what no adapter measures yet, and what ``family_refusals`` (the adapter's own) names."""
    refusals = {
        "ZenFlow": bool(getattr(optimizer, "zenflow", False)),
        "torch autocast": getattr(optimizer, "torch_autocast_gradscaler", None) is not None,
        "the Muon optimizer": "muon" in type(optimizer.optimizer).__name__.lower(),
    }
    refused = [what for what, present in refusals.items() if present] + family_refusals
    if refused:
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support {', '.join(refused)} yet; "
                                    f"remove the '{CONFIG_KEY}' block or set enabled=false")


def _check_moe(engine, family: Optional[type]) -> None:
    """Mixture-of-Experts is measured under ZeRO stage 1 and 2 without model parallelism.

    There each parameter group's gradient is partitioned over its own ``real_dp_process_group``: the
    data-parallel group for dense groups, an expert-data-parallel group for expert groups. The ranks of
    one expert-data-parallel group hold the same experts, and every expert lives in exactly one such
    group, so each element of the model's gradient lies in exactly one rank's partition and one SUM (and
    one MAX) over the data-parallel group combines them. Other optimizers reduce and hold expert
    gradients in ways no test covers yet, and pipeline or tensor parallelism splits the expert groups
    further, so those combinations are refused, by name.
    """
    if not getattr(engine, "has_moe_layers", False):
        return
    if family is not ZeroAdapter:
        raise UnsupportedSetupError(f"{CONFIG_KEY} supports Mixture-of-Experts under ZeRO stage 1 or 2 only; "
                                    f"this engine uses {type(engine.optimizer).__name__} "
                                    f"(zero_optimization.stage={engine.zero_optimization_stage()})")
    if not _whole_model_on_each_rank(engine):
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support Mixture-of-Experts with pipeline or tensor "
                                    f"parallelism yet; remove the '{CONFIG_KEY}' block or set enabled=false")


def _check_no_sequence_parallel(params: List[torch.nn.Parameter], names) -> None:
    """Megatron's ``--sequence-parallel`` marks the parameters (layer norms) whose gradients stay partial on
    each tensor-parallel rank until Megatron all-reduces them, after DeepSpeed's optimizer would have read
    them; nothing tests which of the two it sees, so the set-up is refused."""
    marked = [names.get(param, "?") for param in params if getattr(param, "sequence_parallel", False)]
    if marked:
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support Megatron's --sequence-parallel (parameters "
                                    f"marked sequence_parallel: {', '.join(marked[:3])}"
                                    f"{', ...' if len(marked) > 3 else ''}); run without it or set enabled=false")


def _stage0_group(engine):
    """Without ZeRO each rank holds the complete gradient of its pipeline stage and tensor shard, averaged
    over data parallelism: the whole model on every rank (``REPLICATED``), or, under pipeline or tensor
    parallelism, the model split over the ranks of one data-parallel replica, the model-parallel group.
    The replicas hold the same gradient, so summing over all ranks would count it once per replica; each
    replica's group gives the same result."""
    if _whole_model_on_each_rank(engine):
        return REPLICATED
    mpu = engine.mpu
    if mpu is None:
        raise UnsupportedSetupError(f"{CONFIG_KEY}: a PipelineModule without ZeRO needs the engine's pipeline "
                                    "grid as its mpu; this engine has none")
    covered = mpu.get_data_parallel_world_size() * mpu.get_model_parallel_world_size()
    if covered != dist.get_world_size():
        raise UnsupportedSetupError(f"{CONFIG_KEY}: without ZeRO, data x model parallel ranks ({covered}) are not "
                                    f"all {dist.get_world_size()} ranks (sequence or expert parallelism?); "
                                    "not supported")
    return mpu.get_model_parallel_group()


def _plain_fp32(engine) -> bool:
    """fp32 without ZeRO and a torch optimizer: every rank holds its averaged gradient in ``.grad``."""
    return (engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and isinstance(engine.optimizer, torch.optim.Optimizer))


def _whole_model_on_each_rank(engine) -> bool:
    """No pipeline stages, no tensor shards: each rank's gradient is the whole model's."""
    from deepspeed.runtime.pipe.module import PipelineModule

    return not isinstance(engine.module, PipelineModule) and (engine.mpu is None
                                                              or engine.mpu.get_model_parallel_world_size() == 1)
