# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Which adapter measures a DeepSpeed engine, and what it is built from: the family, the process group
whose tables add up to the whole model, the layer map and the bucket-counting rule.

Called once, at the end of ``DeepSpeedEngine.__init__``. What is refused there, and why, is ``refusals``.
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
from ..config import CONFIG_KEY, LayerGradNormsConfig, UnsupportedSetupError
from ..outputs.monitor import MonitorEvents
from ..statistics.clipping import engine_fp32_clip_square
from ..statistics.layer_map import model_layer_map
from ..statistics.reduction import REPLICATED
from .base import LayerGradNormsAdapter, Setup
from .bf16 import BF16Adapter
from .fused_fp16 import FusedFP16Adapter
from .param_grads import ParamGradAdapter
from .refusals import (
    Refusals,
    check_moe,
    check_no_sequence_parallel,
    check_optimizer_statistics,
    check_param_grad_trigger,
    check_param_grads,
    check_remedies,
    check_supported,
    whole_model_on_each_rank,
)
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
    if not (config.enabled or config.trigger is not None or config.control_file is not None or config.acts()):
        return None  # a trigger or a control file can switch measuring on later, a remedy acts: they need the adapter
    if not _steps_an_optimizer(engine):
        logger.warning(f"{CONFIG_KEY}: this engine has no optimizer ({type(engine.optimizer).__name__}), so no "
                       "gradient step to measure; per-layer statistics are off")
        return None
    optimizer = engine.optimizer
    family = next((family for family in OPTIMIZER_FAMILIES if family.handles(optimizer)), None)
    refusals = Refusals()  # every refusal that applies, named at once
    refusals.check(check_moe, engine, family)
    refusals.check(check_optimizer_statistics, optimizer, family, config)
    refusals.check(check_remedies, optimizer, family, config)
    refusals.check(check_supported, optimizer, family, engine.param_names)
    refusals.raise_all()
    if family is None:
        return _param_grad_adapter(engine, config)
    if family in REPLICATED_FAMILIES:
        process_group = _stage0_group(engine)
    else:
        process_group = _stats_group(engine, optimizer)
    try:
        params = family.trainable_params(optimizer)
        adapter = family(optimizer, _setup(engine, config, params, process_group))
    except AttributeError as err:  # a DeepSpeed release whose optimizer keeps its layout elsewhere
        raise UnsupportedSetupError(f"{CONFIG_KEY}: {type(optimizer).__name__} of DeepSpeed {deepspeed.__version__} "
                                    f"has no attribute {err.name!r}, which {family.__name__} reads") from err
    optimizer.layer_grad_norms = adapter
    return adapter


def _steps_an_optimizer(engine) -> bool:
    """False for an engine built without an optimizer (for inference or evaluation): under ZeRO-3 it holds
    only the parameter partitioner, ``DeepSpeedZeRoOffload``; in bf16 without ZeRO, a ``BF16_Optimizer`` around
    DeepSpeed's placeholder ``DummyOptim``, with no parameter group to step."""
    from deepspeed.runtime.utils import DummyOptim
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    optimizer = engine.optimizer
    return not (optimizer is None or isinstance(optimizer, DeepSpeedZeRoOffload)
                or isinstance(getattr(optimizer, "optimizer", None), DummyOptim))


def _param_grad_adapter(engine, config: LayerGradNormsConfig) -> ParamGradAdapter:
    """DeepSpeed without ZeRO in fp32: the engine clips the ``.grad`` it holds on every rank itself."""
    check_param_grads(engine, config)
    process_group = _stage0_group(engine)
    check_param_grad_trigger(config, process_group is REPLICATED)
    params = [param for param in engine.module.parameters() if param.requires_grad]
    clip_square = None if process_group is REPLICATED else _engine_clip_square(engine.module, engine.mpu)
    return ParamGradAdapter(params,
                            _setup(engine, config, params, process_group),
                            max_norm=engine.gradient_clipping,
                            clip_square=clip_square,
                            optimizer=engine.optimizer)


def _engine_clip_square(module: torch.nn.Module, mpu):
    """This rank's share of the square of the norm the engine clips ``module``'s gradients by under model
    parallelism (not the table's own)."""

    def clip_square() -> torch.Tensor:
        return engine_fp32_clip_square(module.parameters(), mpu)

    return clip_square


def _setup(engine, config: LayerGradNormsConfig, params: List[torch.nn.Parameter], process_group) -> Setup:
    """The layer map of the trainable ``params``, and the engine's step count and monitors."""
    names = engine.param_names
    check_no_sequence_parallel(params, names)
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
                 process_group,
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


def _stage0_group(engine):
    """Without ZeRO each rank holds the complete gradient of its pipeline stage and tensor shard, averaged
    over data parallelism: the whole model on every rank (``REPLICATED``), or, under pipeline or tensor
    parallelism, the model split over the ranks of one data-parallel replica, the model-parallel group.
    The replicas hold the same gradient, so summing over all ranks would count it once per replica; each
    replica's group gives the same result."""
    if whole_model_on_each_rank(engine):
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
