"""What each rank runs in the multi-rank tests: train a TinyGPT under ZeRO and record what it reports.

Each case trains a few steps with the feature on, records ``get_layer_grad_norms()`` and the
global norm after every step and, on rank 0, the plain-PyTorch reference statistics of the same
step. Cases that ask for it train again with the feature off, to prove training is unchanged.
"""

import contextlib
import logging
import os
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch
from reference import averaged_gradients, bucket_stats, reference_key_of
from releases import STAGE0_LOSS_CARRIES_SCALE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_INITIAL_SCALE_POWER = 8
OVERFLOW_BLOW_UP = 1e30
"""An overflow step's loss is multiplied by this: the fp16 loss and its gradient overflow."""
# Set to the directory of a DeepSpeed with the upstream patch applied: the tests run against it,
# without deepspeed_patch.
UPSTREAM_ENV = "LAYER_GRAD_NORMS_UPSTREAM"
# Comma-separated names of tests/test_zero_stats.py's cases: only these are launched and tested there (the
# others are reported skipped).
CASES_ENV = "LAYER_GRAD_NORMS_CASES"
# One of those cases per optimizer family (DeepSpeedZeroOptimizer, BF16_Optimizer, FP16_Optimizer,
# FP16_UnfusedOptimizer, a torch optimizer without ZeRO), all on 2 ranks: tests/test_upstream_patch.py runs
# them on the patched DeepSpeed.
FAMILY_CASES = ("z1_fp16_overflow_gas2", "z1_bf16_optimizer_clip_gas2", "z0_fp16_fused_gas2_clip_groups",
                "z0_fp16_unfused_overflow_clip", "z0_fp32_gas2_clip_groups")
MICRO_BATCH = 2

DEFAULT_CASE: Dict[str, Any] = {
    "stage": 2,
    "dtype": "fp32",
    "steps": 3,
    "gas": 1,
    "clip": 0.0,
    "groups": False,  # weight-decay and no-decay parameter groups
    "frozen": (),  # parameter names to freeze
    "tie": False,
    "layers": 4,
    "zero": {},  # extra zero_optimization keys
    "top": {},  # extra top-level ds_config keys
    "block": {},  # extra layer_grad_norms keys
    "overflow_step": None,  # fp16: blow up the loss of this step
    "compare_off": False,  # also train with the feature off and compare bit for bit
    "grad_accum_dtype": None,
    "fused": False,  # without ZeRO: FP16_Optimizer (flat groups) instead of FP16_UnfusedOptimizer
    "zero_init": False,  # stage 3: build the model under deepspeed.zero.Init (else partitioned at initialize)
}


def install_feature() -> None:
    """``deepspeed_patch.install()``; or, under ``UPSTREAM_ENV``, check that the patched DeepSpeed is the
    one imported and make ``deepspeed_patch`` unimportable, so that nothing of it can take part."""
    upstream = os.environ.get(UPSTREAM_ENV)
    if upstream is None:
        import deepspeed_patch

        deepspeed_patch.install()
        return
    sys.modules["deepspeed_patch"] = None  # any import of it now fails
    import deepspeed

    if not deepspeed.__file__.startswith(os.path.abspath(upstream)):
        raise RuntimeError(f"{UPSTREAM_ENV}={upstream}, yet deepspeed comes from {deepspeed.__file__}")


def force_fp16_on_cpu() -> None:
    """DeepSpeed's CPU accelerator refuses fp16; the kernels work, so tests switch the flag on."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]


def fused_sgd(params, lr: float) -> torch.optim.Optimizer:
    """SGD that DeepSpeed takes for its FusedAdam, so that fp16/bf16 without ZeRO runs FP16_Optimizer
    (the flat-buffer path); SGD, so that the weight update shows the gradient the optimizer applied."""
    from deepspeed.ops.adam import FusedAdam

    class FusedSGD(FusedAdam):

        def __init__(self, params, lr: float) -> None:
            torch.optim.Optimizer.__init__(self, params, {"lr": lr})  # no fused kernel to build

        @torch.no_grad()
        def step(self, closure=None) -> None:
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-group["lr"])

    return FusedSGD(params, lr)


def ds_config(case: Dict[str, Any], enabled: bool) -> Dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "zero_optimization": {"stage": case["stage"], **case["zero"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        **case["top"],
    }
    if case["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    if case["dtype"] == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER, "loss_scale_window": 2}
    if case["grad_accum_dtype"]:
        config["data_types"] = {"grad_accum_dtype": case["grad_accum_dtype"]}
    if enabled:
        config["layer_grad_norms"] = {"enabled": True, **case["block"]}
    return config


def model_config(case: Dict[str, Any]) -> TinyGPTConfig:
    return TinyGPTConfig(num_layers=case["layers"], tie_embeddings=case["tie"])


def batches_of_step(case: Dict[str, Any], step: int, world_size: int, rank: int = None) -> List[torch.Tensor]:
    """The micro-batches of one optimizer step: all ranks' (rank=None) or one rank's, in order."""
    ranks = range(world_size) if rank is None else [rank]
    return [
        synthetic_batch(model_config(case), MICRO_BATCH, seed=1000 * step + 10 * micro + r) for r in ranks
        for micro in range(case["gas"])
    ]


def loss_scale(optimizer) -> float:
    """1 where there is none: BF16_Optimizer has no ``loss_scale``, FP16_Optimizer's is None in bf16."""
    return float(getattr(optimizer, "loss_scale", None) or 1.0)


def full_weights(module: torch.nn.Module, dtype: Optional[torch.dtype] = torch.float32) -> Dict[str, torch.Tensor]:
    """A copy of every weight of ``module`` (in ``dtype``; ``None``: its own), gathered where ZeRO-3
    partitions them (collective: every rank calls it)."""
    import deepspeed

    named = list(module.named_parameters())
    with deepspeed.zero.GatheredParameters([param for _, param in named]):
        return {name: param.detach().to(dtype or param.dtype, copy=True) for name, param in named}


def master_weights(optimizer, trainable) -> Optional[Dict[str, torch.Tensor]]:
    """A copy of the optimizer's fp32 copy of each trainable weight: the master weights a bf16 or fp16 optimizer
    updates, exact to fp32 where the model's own weights round the update away. ZeRO and BF16_Optimizer give them
    through ``safe_get_full_fp32_param`` (collective under ZeRO: every rank calls it); the fp16 optimizers (bf16
    without ZeRO from 0.17 on) keep them in ``fp32_groups_flat`` (fused) or ``fp32_groups``. None for an optimizer
    that keeps none (fp32: the model's weights are its own)."""
    from deepspeed.utils import safe_get_full_fp32_param

    copies = {name: safe_get_full_fp32_param(param) for name, param in trainable}
    if any(copy is None for copy in copies.values()):
        copies = fp16_optimizer_masters(optimizer, trainable)
    return None if copies is None else {name: copy.detach().float().cpu().clone() for name, copy in copies.items()}


def master_of_param(optimizer, trainable) -> Optional[Callable[[torch.nn.Parameter], torch.Tensor]]:
    """``master_weights`` looked up by parameter, for rebuilding a model from its pieces (pipeline stages, TP
    shards); None for an optimizer that keeps none."""
    masters = master_weights(optimizer, trainable)
    if masters is None:
        return None
    by_param = {id(param): masters[name] for name, param in trainable}
    return lambda param: by_param[id(param)]


def fp16_optimizer_masters(optimizer, trainable) -> Optional[Dict[str, torch.Tensor]]:
    """FP16_Optimizer's flat fp32 groups (split in its parameters' order) or FP16_UnfusedOptimizer's fp32
    parameters, by the model's parameter names; None for another optimizer."""
    groups = getattr(optimizer, "fp16_groups", None)
    masters = getattr(optimizer, "fp32_groups_flat", None) or getattr(optimizer, "fp32_groups", None)
    if groups is None or masters is None:
        return None
    by_param = {}
    for params, master in zip(groups, masters):
        pieces = master.split([param.numel() for param in params]) if torch.is_tensor(master) else master
        by_param.update({id(param): piece.view(param.shape) for param, piece in zip(params, pieces)})
    return {name: by_param[id(param)] for name, param in trainable}


def train(case: Dict[str, Any], enabled: bool) -> Dict[str, Any]:
    import deepspeed
    from deepspeed import comm as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = ds_config(case, enabled)
    with deepspeed.zero.Init(config_dict_or_path=config) if case["zero_init"] else contextlib.nullcontext():
        model = TinyGPT(model_config(case))
    for name, param in model.named_parameters():
        param.requires_grad_(name not in case["frozen"])
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if case["groups"]:
        params = [
            {"params": [p for name, p in trainable if p.ndim > 1], "weight_decay": 0.0},
            {"params": [p for name, p in trainable if p.ndim <= 1], "weight_decay": 0.0},
        ]
    else:
        params = [p for _, p in trainable]
    optimizer = (fused_sgd if case["fused"] else torch.optim.SGD)(params, lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    record = {"losses": [], "measured": [], "global_norm": [], "reference": [], "applied": [], "applied_master": [],
              "loss_scales": [], "layer_reference": []}
    for step in range(1, case["steps"] + 1):
        before = full_weights(engine.module)
        master_before = master_weights(engine.optimizer, trainable)
        scale_before = loss_scale(engine.optimizer)
        for batch in batches_of_step(case, step, world_size, rank):
            loss = engine(batch)
            record["losses"].append(loss.item())
            if step == case["overflow_step"]:
                loss = loss * OVERFLOW_BLOW_UP
            engine.backward(loss)
            engine.step()
        after = full_weights(engine.module)
        record["loss_scales"].append((scale_before, loss_scale(engine.optimizer)))
        # SGD with lr=1: the update is the gradient the optimizer consumed, after clipping.
        key_of = reference_key_of(case["block"])
        record["applied"].append(bucket_stats({n: before[n] - after[n] for n, _ in trainable}, key_of))
        master_after = master_weights(engine.optimizer, trainable)
        record["applied_master"].append(None if master_before is None else bucket_stats(
            {n: master_before[n] - master_after[n] for n, _ in trainable}, key_of))
        record["measured"].append(engine.get_layer_grad_norms())
        record["global_norm"].append(engine.get_global_grad_norm())
        if rank == 0 and enabled:
            # the loss scale the engine's backward multiplied the loss by: none without ZeRO from 0.18 on
            # (releases.py), where the reference's small fp16 gradients then flush to zero as the engine's do
            carries_scale = case["dtype"] == "fp16" and (case["stage"] > 0 or STAGE0_LOSS_CARRIES_SCALE)
            scale = 2.0**FP16_INITIAL_SCALE_POWER if carries_scale else 1.0
            grads = averaged_gradients(before, model_config(case), DTYPES[case["dtype"]],
                                       batches_of_step(case, step, world_size), case["frozen"], scale,
                                       OVERFLOW_BLOW_UP if step == case["overflow_step"] else None)
            record["reference"].append(bucket_stats(grads, key_of))
            record["layer_reference"].append(bucket_stats(grads))
    record["final"] = full_weights(engine.module, dtype=None)
    record["optimizer"] = type(engine.optimizer).__name__
    engine.destroy()
    return record


def run_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every case on this rank; a failing case is recorded, not raised, so the others still run."""

    def trained(case: Dict[str, Any]) -> Dict[str, Any]:
        result = {"on": train(case, enabled=True)}
        if case["compare_off"]:
            result["off"] = train(case, enabled=False)
        return result

    return run_each(cases, DEFAULT_CASE, trained)


def run_each(cases: Dict[str, Dict[str, Any]], defaults: Dict[str, Any],
             trained: Callable[[Dict[str, Any]], Dict[str, Any]]) -> Dict[str, Any]:
    """``trained(case)`` of every case (its overrides on ``defaults``) on this rank, with the feature installed; a
    failing case is recorded (``error``: its traceback, ``type`` and ``message``: the exception's), not raised, so
    the others still run. Each result holds its ``case``."""
    import traceback

    install_feature()
    force_fp16_on_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    for name, overrides in cases.items():
        case = {**defaults, **overrides}
        try:
            results[name] = {**trained(case), "case": case}
        except Exception as err:
            results[name] = {"error": traceback.format_exc(), "type": type(err).__name__, "message": str(err),
                             "case": case}
    return results
