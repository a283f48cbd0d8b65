"""What each rank runs for tests/test_optimizer_statistics.py, test_optimizer_statistics_zero3.py and
test_optimizer_statistics_stage0.py: train a TinyGPT under ZeRO-1/2/3 or without ZeRO with Adam or AdamW and
``optimizer_statistics`` on, and record beside what it reports the plain-PyTorch reference of every step: per
bucket, the statistics of the full fp32 weights after the step, of after minus before, and of the Adam moments
after it, gathered with DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` (collectives
at stage 3), or read directly from what the optimizer holds without ZeRO (``stage0_masters``), outside the step,
on every rank."""

import logging
import traceback
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_integration.tiny_gpt import TinyGPT
from reference import bucket_stats, reference_key_of
from setup_workers import counting_collectives
from zero_workers import (
    DEFAULT_CASE,
    batches_of_step,
    ds_config,
    force_fp16_on_cpu,
    full_weights,
    install_feature,
    model_config,
)

KINDS = ["param", "update", "exp_avg", "exp_avg_sq"]


def cpu_adam(params, **options) -> torch.optim.Optimizer:
    """DeepSpeedCPUAdam (its host kernel is built on first use, which takes minutes)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, **options)


def fused_adam(params, **options) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam (AdamW mode): without ZeRO in fp16 or bf16, DeepSpeed wraps it in FP16_Optimizer."""
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(params, **options)


OPTIMIZERS = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "cpu_adam": cpu_adam,
    "fused_adam": fused_adam
}
MOMENTS = ("exp_avg", "exp_avg_sq")
DEFAULT = {
    **DEFAULT_CASE, "layers": 2, "optimizer": "adamw", "kinds": KINDS, "lr": 1e-2, "weight_decay": 0.1, "options": {},
    "recorded": None, "scheduler": None, "layer_lr": None
}
"""``layer_lr``: the transformer layers' parameters in a second parameter group, at this lr."""
SPIKE = 64.0
"""``recorded`` cases multiply the last step's loss by this: the trigger fires there and the flight recorder
hands back the steps before it."""


def stage0_masters(engine) -> Dict[torch.nn.Parameter, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Without ZeRO, where ``safe_get_full_*`` return None: each model parameter's fp32 master and its moments, as
    the optimizer holds them: the parameter itself and the torch optimizer's state (fp32: ``engine.optimizer`` is
    the torch optimizer), FP16_UnfusedOptimizer's fp32 copy and its state, or the parameter's slice of
    FP16_Optimizer's flat fp32 group and of that group's state."""
    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return {param: (param, optimizer.state.get(param, {})) for group in optimizer.param_groups
                for param in group["params"]}
    state, masters = optimizer.optimizer.state, {}
    if not hasattr(optimizer, "fp32_groups_flat"):
        for params, copies in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            masters.update({param: (copy, state.get(copy, {})) for param, copy in zip(params, copies)})
        return masters
    for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
        offset = 0
        for param in params:
            piece = flat.narrow(0, offset, param.numel()).view_as(param)
            moments = {moment: value.narrow(0, offset, param.numel()).view_as(param)
                       for moment, value in state.get(flat, {}).items() if moment in MOMENTS}
            masters[param] = (piece, moments)
            offset += param.numel()
    return masters


def full_state(engine, trainable, moments: bool) -> Dict[str, Dict[str, torch.Tensor]]:
    """The full fp32 weights and, with ``moments`` once the optimizer has stepped, its moments, by name."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    fp32, moment_of = safe_get_full_fp32_param, safe_get_full_optimizer_state
    if engine.zero_optimization_stage() == 0:
        masters = stage0_masters(engine)
        fp32, moment_of = (lambda param: masters[param][0]), (lambda param, moment: masters[param][1].get(moment))
    state = {"param": {name: fp32(param).clone() for name, param in trainable}}
    inner = engine.optimizer if isinstance(engine.optimizer, torch.optim.Optimizer) else engine.optimizer.optimizer
    if not (moments and inner.state and not isinstance(inner, torch.optim.SGD)):
        return state
    for moment in MOMENTS:
        values = {name: moment_of(param, moment) for name, param in trainable}
        if all(value is not None for value in values.values()):
            state[moment] = {name: value.clone() for name, value in values.items()}
    return state


def train(case: Dict[str, Any], block: Dict[str, Any]) -> Dict[str, Any]:
    import deepspeed
    from deepspeed import comm as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = ds_config({**case, "block": block}, enabled=block is not None)
    model = TinyGPT(model_config(case))
    trainable = list(model.named_parameters())
    options = {"lr": case["lr"]} if case["optimizer"] == "sgd" else {"lr": case["lr"],
                                                                      "weight_decay": case["weight_decay"]}
    optimizer = OPTIMIZERS[case["optimizer"]](param_groups(trainable, case["layer_lr"]), **options, **case["options"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, case["scheduler"]) if case["scheduler"] else None
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    key_of = reference_key_of({})
    record = {"measured": [], "reference": [], "collectives": [], "final": None}
    for step in range(1, case["steps"] + 1):
        before = full_state(engine, trainable, moments=False)["param"]
        for batch in batches_of_step(case, step, world_size, rank):
            loss = engine(batch)
            if step == case["overflow_step"]:
                loss = loss * 1e30
            if case["recorded"] and step == case["steps"]:
                loss = loss * SPIKE
            engine.backward(loss)
            with counting_collectives() as calls:
                engine.step()
        record["collectives"].append(calls[0])
        after = full_state(engine, trainable, moments=True)
        named = {
            "param": after["param"],
            "update": {name: after["param"][name] - before[name] for name in before},
            **{moment: after[moment] for moment in MOMENTS if moment in after},
        }
        record["reference"].append({kind: bucket_stats(values, key_of) for kind, values in named.items()})
        record["measured"].append(engine.get_layer_grad_norms())
    record["fires"] = engine.get_layer_grad_norms_history("all") if case["recorded"] else None
    record["final"] = full_weights(engine.module, dtype=None)
    record["optimizer"] = type(engine.optimizer).__name__
    record["sub_group_to_group_id"] = getattr(engine.optimizer, "sub_group_to_group_id", None)  # ZeRO-3
    engine.destroy()
    return record


def param_groups(trainable, layer_lr: Optional[float]) -> list:
    """All parameters in one group; with ``layer_lr``, the transformer layers' in a second group at that lr."""
    if layer_lr is None:
        return [param for _, param in trainable]
    return [{"params": [param for name, param in trainable if not name.startswith("layers.")]},
            {"params": [param for name, param in trainable if name.startswith("layers.")], "lr": layer_lr}]


def block_of(case: Dict[str, Any]) -> Dict[str, Any]:
    """The block of a case: every step measured; or (``recorded``: a trigger block) none measured, every step
    recorded, and a fire at the last."""
    if case["recorded"]:
        return {"enabled": False, "optimizer_statistics": case["kinds"], "trigger": case["recorded"]}
    return {"enabled": True, "optimizer_statistics": case["kinds"]}


def run_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every case on this rank: with the kinds on; with the gradient statistics only (``compare_off``: the
    weights and the collective count to compare); a refused case records the error's message."""
    install_feature()
    force_fp16_on_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    for name, overrides in cases.items():
        case = {**DEFAULT, **overrides}
        try:
            results[name] = {"on": train(case, block_of(case))}
            if case["compare_off"]:
                results[name]["grad_only"] = train(case, {"enabled": True})
                results[name]["off"] = train(case, None)
        except Exception as err:
            results[name] = {"error": traceback.format_exc(), "message": str(err), "type": type(err).__name__}
    return results
