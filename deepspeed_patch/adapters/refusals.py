# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The set-ups the per-layer statistics refuse at initialize, each with its reason and the way out, every one
that applies named in one error (``Refusals``) rather than wrong numbers reported later.
"""

from typing import Callable, Dict, List, Optional

import torch

from .. import capabilities
from ..config import CONFIG_KEY, LayerGradNormsConfig, UnsupportedSetupError
from ..optimizer_state.adam_rule import NEEDS_ADAM, adam_decoupling, adam_rule
from .bf16 import BF16Adapter
from .fused_fp16 import FusedFP16Adapter
from .unfused_fp16 import UnfusedFP16Adapter
from .zero import ZeroAdapter
from .zero3 import Zero3Adapter


class Refusals:
    """The refusals of the checks asked (``check``), raised together in one error (``raise_all``)."""

    def __init__(self) -> None:
        self.reasons: List[str] = []

    def check(self, check: Callable[..., None], *args) -> None:
        """Ask ``check(*args)``; its refusal is kept, not raised."""
        try:
            check(*args)
        except UnsupportedSetupError as err:
            self.reasons.append(str(err))

    def raise_all(self) -> None:
        """One ``UnsupportedSetupError`` naming every refusal kept, if any."""
        if self.reasons:
            raise UnsupportedSetupError("; and ".join(self.reasons))


# The families that read optimizer_statistics; None: fp32 without ZeRO (ParamGradAdapter).
OPTIMIZER_STATISTICS_FAMILIES = (ZeroAdapter, Zero3Adapter, BF16Adapter, FusedFP16Adapter, UnfusedFP16Adapter, None)


def check_param_grads(engine, config: LayerGradNormsConfig) -> None:
    """DeepSpeed without ZeRO is read from ``.grad`` in fp32 only; and there, the trigger needs the recorder,
    which reads every step's norm (the engine keeps none)."""
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


def check_param_grad_trigger(config: LayerGradNormsConfig, replicated: bool) -> None:
    """In fp32 without ZeRO, the recorder's per-step norm is the whole model's only where every rank holds it
    all (``replicated``)."""
    if config.trigger is not None and not replicated:
        raise UnsupportedSetupError(f"{CONFIG_KEY}.trigger in fp32 without ZeRO under pipeline or tensor "
                                    "parallelism is not supported (the recorder's per-step norm would be "
                                    "this rank's stage or shard only); use ZeRO-1/2 or fp16/bf16")


def check_supported(optimizer, family: Optional[type], names: Dict[torch.nn.Parameter, str]) -> None:
    """Refuse what the adapter of ``optimizer``'s ``family`` cannot measure (``names``: the engine's parameter
    names), and what no adapter measures yet; nothing where no adapter reads ``optimizer`` (``family`` None)."""
    if family is None:
        return
    refusals = {
        "ZenFlow": bool(getattr(optimizer, "zenflow", False)),
        "torch autocast": getattr(optimizer, "torch_autocast_gradscaler", None) is not None,
        "the Muon optimizer": "muon" in type(optimizer.optimizer).__name__.lower(),
    }
    refused = [what for what, present in refusals.items() if present]
    refused += family.unsupported(optimizer, names, capabilities.installed())
    if refused:
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support {', '.join(refused)} yet; "
                                    f"remove the '{CONFIG_KEY}' block or set enabled=false")


def check_optimizer_statistics(optimizer, family: Optional[type], config: LayerGradNormsConfig) -> None:
    """``optimizer_statistics`` is read from the fp32 master partitions of ZeRO-1/2/3 (on the device or offloaded
    to the CPU), BF16_Optimizer and FP16_Optimizer, from the per-parameter fp32 copies of FP16_UnfusedOptimizer,
    and in fp32 without ZeRO (``family`` None) from the model's parameters, which ``optimizer`` (then the torch
    optimizer itself) steps; the update and moments from an optimizer of the Adam family
    (``adam_rule.adam_decoupling``, known by the step it runs); under ZeRO-3, only where that state is all in
    this process's memory (``Zero3Adapter.state_elsewhere``); in every family, only where the master weights and
    the moments are fp32 (``low_precision_state``)."""
    kinds = config.optimizer_statistics
    if not kinds:
        return
    key = f"{CONFIG_KEY}.optimizer_statistics={list(kinds)}"
    inner = optimizer if family is None else optimizer.optimizer
    if family not in OPTIMIZER_STATISTICS_FAMILIES or not isinstance(inner, torch.optim.Optimizer):
        raise UnsupportedSetupError(f"{key}: supported under ZeRO stage 0, 1, 2 or 3 and BF16_Optimizer only yet; "
                                    f"this engine uses {type(optimizer).__name__}")
    elsewhere = Zero3Adapter.state_elsewhere(optimizer) if family is Zero3Adapter else []
    if elsewhere:
        raise UnsupportedSetupError(f"{key}: under ZeRO stage 3 they are read from the inner optimizer's fp32 "
                                    f"state in this process's memory; not supported with {'; '.join(elsewhere)}")
    low = low_precision_state(optimizer, inner)
    if low:
        raise UnsupportedSetupError(f"{key}: read from fp32 master weights and optimizer states only (the update is "
                                    "derived in fp32, not rounded as a lower-precision step rounds it); not supported "
                                    f"with {'; '.join(low)}")
    if set(kinds) & set(NEEDS_ADAM):
        try:
            adam_decoupling(inner)
            for group in inner.param_groups:
                adam_rule(inner, group)
        except ValueError as err:
            raise UnsupportedSetupError(f"{key}: 'update', 'exp_avg' and 'exp_avg_sq' need an Adam optimizer; "
                                        f"this engine steps {err}") from None


def low_precision_state(optimizer, inner: torch.optim.Optimizer) -> List[str]:
    """What keeps the master weights that ``inner`` (the torch optimizer) steps, or its moments, in less than fp32,
    by the ds_config key or argument that asks for it: ZeRO's bf16 or fp16 master weights and bf16 optimizer
    states, DeepSpeedCPUAdam's ``fp32_optimizer_states=False`` where the parameters are not fp32 (its moments are
    in the parameters' precision), and any parameter of ``inner`` that is not fp32."""
    master = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)  # older releases: always fp32
    stepped = sorted({str(param.dtype) for group in inner.param_groups for param in group["params"]} - {str(master)})
    below_fp32 = master != torch.float32 or bool(stepped)
    refusals = {
        f"master weights in {master} (bf16.bf16_master_weights_and_grads=true or "
        "fp16.fp16_master_weights_and_grads=true)":
        master != torch.float32,
        "bf16.bf16_optimizer_states=true (Adam's moments in bf16)":
        bool(getattr(optimizer, "bf16_optimizer_states", False)),
        f"{type(inner).__name__}(fp32_optimizer_states=False) (moments in the parameters' precision)":
        getattr(inner, "fp32_optimizer_states", True) is False and below_fp32,
        f"parameters of {type(inner).__name__} in {', '.join(stepped)}":
        bool(stepped) and master == torch.float32,
    }
    return [what for what, present in refusals.items() if present]


# The families whose step the remedies can act on, and which of them.
BOTH_REMEDIES = ("adaptive_clipping", "skip_step")
REMEDY_FAMILIES = {ZeroAdapter: BOTH_REMEDIES, Zero3Adapter: BOTH_REMEDIES, BF16Adapter: ("adaptive_clipping", )}


def check_remedies(optimizer, family: Optional[type], config: LayerGradNormsConfig) -> None:
    """``adaptive_clipping`` acts in ZeRO-1/2/3 and BF16_Optimizer, ``skip_step`` in ZeRO-1/2/3: where the step's
    reduction can come before the optimizer step, with every partition read, and (``skip_step``) where the
    optimizer skips a step on a flag it tests after that point. Neither goes with ``optimizer_statistics``, which
    are reduced with the step after the optimizer steps. The fp16 optimizers without ZeRO, and fp32 without ZeRO,
    are refused by name."""
    wanted = [name for name in BOTH_REMEDIES if getattr(config, name).enabled]
    refusals = [
        f"{CONFIG_KEY}.{name} is supported under ZeRO stage 1, 2 and 3"
        f"{' and BF16_Optimizer' if name == 'adaptive_clipping' else ''} only yet; this engine uses "
        f"{type(optimizer).__name__}" for name in wanted if name not in REMEDY_FAMILIES.get(family, ())
    ]
    if config.optimizer_statistics:
        refusals += [
            f"{CONFIG_KEY}.{name} with optimizer_statistics is not supported yet (the step is reduced before the "
            "optimizer steps; docs/remedies.md says why); leave one of them out" for name in wanted
        ]
    if refusals:
        raise UnsupportedSetupError("; and ".join(refusals))


def check_moe(engine, family: Optional[type]) -> None:
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
    if not whole_model_on_each_rank(engine):
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support Mixture-of-Experts with pipeline or tensor "
                                    f"parallelism yet; remove the '{CONFIG_KEY}' block or set enabled=false")


def check_no_sequence_parallel(params: List[torch.nn.Parameter], names) -> None:
    """Megatron's ``--sequence-parallel`` marks the parameters (layer norms) whose gradients stay partial on
    each tensor-parallel rank until Megatron all-reduces them, after DeepSpeed's optimizer would have read
    them; nothing tests which of the two it sees, so the set-up is refused."""
    marked = [names.get(param, "?") for param in params if getattr(param, "sequence_parallel", False)]
    if marked:
        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support Megatron's --sequence-parallel (parameters "
                                    f"marked sequence_parallel: {', '.join(marked[:3])}"
                                    f"{', ...' if len(marked) > 3 else ''}); run without it or set enabled=false")


def _plain_fp32(engine) -> bool:
    """fp32 without ZeRO and a torch optimizer: every rank holds its averaged gradient in ``.grad``."""
    return (engine.zero_optimization_stage() == 0 and not engine.fp16_enabled() and not engine.bfloat16_enabled()
            and isinstance(engine.optimizer, torch.optim.Optimizer))


def whole_model_on_each_rank(engine) -> bool:
    """No pipeline stages, no tensor shards: each rank's gradient is the whole model's."""
    from deepspeed.runtime.pipe.module import PipelineModule

    return not isinstance(engine.module, PipelineModule) and (engine.mpu is None
                                                              or engine.mpu.get_model_parallel_world_size() == 1)
