"""What each rank runs for tests/test_optimizer_statistics.py and test_optimizer_statistics_zero3.py: train a
TinyGPT under ZeRO-1/2/3 with Adam or AdamW and ``optimizer_statistics`` on, and record beside what it reports
the plain-PyTorch reference of every step: per bucket, the statistics of the full fp32 weights after the step, of
after minus before, and of the Adam moments after it, gathered with DeepSpeed's ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` (outside the step, on every rank; collectives at stage 3)."""

import logging
import traceback
from typing import Any, Dict, Optional

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


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "cpu_adam": cpu_adam}
DEFAULT = {
    **DEFAULT_CASE, "layers": 2, "optimizer": "adamw", "kinds": KINDS, "lr": 1e-2, "weight_decay": 0.1, "options": {},
    "recorded": None, "scheduler": None, "layer_lr": None
}
"""``layer_lr``: the transformer layers' parameters in a second parameter group, at this lr."""
SPIKE = 64.0
"""``recorded`` cases multiply the last step's loss by this: the trigger fires there and the flight recorder
hands back the steps before it."""


def full_state(engine, trainable, moments: bool) -> Dict[str, Dict[str, torch.Tensor]]:
    """The full fp32 weights and, with ``moments`` once the optimizer has stepped, its moments, by name."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    state = {"param": {name: safe_get_full_fp32_param(param).clone() for name, param in trainable}}
    inner = engine.optimizer.optimizer
    if not (moments and inner.state and not isinstance(inner, torch.optim.SGD)):
        return state
    for moment in ("exp_avg", "exp_avg_sq"):
        values = {name: safe_get_full_optimizer_state(param, moment) for name, param in trainable}
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
            **{moment: after[moment] for moment in ("exp_avg", "exp_avg_sq") if moment in after},
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
