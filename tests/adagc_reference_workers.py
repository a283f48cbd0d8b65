"""What the rank runs in test_adagc_reference.py: one TinyGPT trained twice from the same weights on the same
batches, by DeepSpeed (ZeRO, fp32, ``adaptive_clipping`` with ``granularity: "param"``, torch's AdamW) and by
pytorch-optimizer's ``AdaGC`` (per-tensor AdaGC inside its own Adam), recording after every step each side's
clipping factor of every parameter, its average (``ema``; AdaGC's ``gamma``) and the weights.

pytorch-optimizer's factors are not in its state: ``FactorRecorder`` sees each ``grad.mul(factor)`` its step makes
(a ``TorchFunctionMode``, so the reference runs its own code unchanged, eager per-tensor path).
"""

from typing import Any, Dict, List

import torch
from torch.overrides import TorchFunctionMode

from megatron_integration.tiny_gpt import TinyGPT
from zero_workers import DEFAULT_CASE, batches_of_step, ds_config, full_weights, model_config, run_each

ADAGC_CASE: Dict[str, Any] = {
    **DEFAULT_CASE,
    "steps": 10,
    "clip": 1.0,  # DeepSpeed's gradient_clipping in the warm-up = AdaGC's lambda_abs
    "lr": 0.01,
    "betas": (0.9, 0.999),
    "weight_decay": 0.1,
    "eps": 1e-8,
    "same_weights": True,  # each step of the reference starts from the engine's weights (see the test)
    "adaptive": {"enabled": True, "beta": 0.98, "factor": 1.05, "warmup_steps": 3},
}


class FactorRecorder(TorchFunctionMode):
    """Records the factor of every ``grad.mul(factor)`` on a gradient it was given, by parameter name."""

    def __init__(self, named_grads: Dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.name_of = {id(grad): name for name, grad in named_grads.items()}
        self.factors: Dict[str, float] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.mul and id(args[0]) in self.name_of:
            self.factors[self.name_of[id(args[0])]] = float(args[1])
        return func(*args, **(kwargs or {}))


def reference_optimizer(model: torch.nn.Module, case: Dict[str, Any]) -> torch.optim.Optimizer:
    """pytorch-optimizer's AdaGC with the case's settings. Its ``warmup_steps`` counts differently: its step ``t``
    (from 1) warms up while ``t < warmup_steps``, so its ``warmup_steps`` is ours plus one."""
    from pytorch_optimizer import AdaGC

    adaptive = case["adaptive"]
    return AdaGC(model.parameters(), lr=case["lr"], betas=case["betas"], beta=adaptive["beta"],
                 lambda_abs=case["clip"], lambda_rel=adaptive["factor"], warmup_steps=adaptive["warmup_steps"] + 1,
                 weight_decay=case["weight_decay"], weight_decouple=True, eps=case["eps"], foreach=False)


def reference_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> Dict[str, Any]:
    """One step of the reference: its factor and ``gamma`` of every parameter."""
    optimizer.zero_grad()
    model(batch).backward()
    named = dict(model.named_parameters())
    recorder = FactorRecorder({name: param.grad for name, param in named.items()})
    with recorder:
        optimizer.step()
    return {"factors": recorder.factors,
            "ema": {name: optimizer.state[param]["gamma"].item() for name, param in named.items()}}


def deepspeed_step(engine, batch: torch.Tensor) -> Dict[str, Any]:
    """One step of the engine: its result (the factors, or the global clip coefficient in the warm-up) and each
    bucket's average."""
    engine.backward(engine(batch))
    engine.step()
    result = engine.get_layer_grad_norms()
    return {"factors": result["adaptive_clip"], "clip_coef": result["clip_coef"],
            "ema": engine.layer_grad_norms.remedy_step.remedies.state_dict()["adaptive_clipping"]["ema"]}


def train_side_by_side(case: Dict[str, Any]) -> Dict[str, List]:
    """Both trainings, step by step."""
    import deepspeed

    torch.manual_seed(0)
    model = TinyGPT(model_config(case))
    twin = TinyGPT(model_config(case))
    twin.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=case["lr"], betas=case["betas"], eps=case["eps"],
                                  weight_decay=case["weight_decay"])
    config = ds_config({**case, "block": {"granularity": "param", "adaptive_clipping": case["adaptive"]}}, True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    reference = reference_optimizer(twin, case)
    record: Dict[str, List] = {"deepspeed": [], "reference": [], "weights": [], "reference_weights": []}
    for step in range(1, case["steps"] + 1):
        (batch, ) = batches_of_step(case, step, world_size=1)
        if case["same_weights"]:
            with torch.no_grad():
                for mine, theirs in zip(twin.parameters(), engine.module.parameters()):
                    mine.copy_(theirs)
        record["deepspeed"].append(deepspeed_step(engine, batch))
        record["reference"].append(reference_step(twin, reference, batch))
        record["weights"].append(full_weights(engine.module))
        record["reference_weights"].append(full_weights(twin))
    record["optimizer"] = type(engine.optimizer).__name__
    engine.destroy()
    return record


def run_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    return run_each(cases, ADAGC_CASE, train_side_by_side)
