"""What each rank runs for tests/test_spike_scenarios.py and benchmarks/spike_calibration.py: train a tiny Pre-LN
GPT under DeepSpeed ZeRO-2 with Adam or AdamW, ``optimizer_statistics`` and the flight recorder on, and inject one
known fault at a known step: a learning rate raised, one layer's gradient or the loss scaled, a
corrupted batch, one layer's weights scaled in place, a NaN in one rank's gradient.

A scenario run writes the JSONL dump and, through the Megatron hook, TensorBoard; the tests judge the fires from
those logs as ``layer-grad-norms report`` does. A calibration run (``every_step``) also keeps rank 0's result of
every step, each signal's norm per layer, for the benchmark's table. One launch runs many runs; a failing run is
recorded, not raised.
"""

import argparse
import logging
import math
import os
import traceback
from typing import Any, Dict, List, Optional

import torch

from megatron_integration.demo import learning_rate_times
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch
from zero_workers import force_fp16_on_cpu, install_feature

MODEL = TinyGPTConfig(num_layers=4)
"""The tiny Pre-LN GPT of every run: 4 transformer layers of width 32."""
MICRO_BATCH = 4
KINDS = ["param", "update", "exp_avg", "exp_avg_sq"]
TRIGGER = {"grad_norm_factor": 3.0, "window": 10, "capture_steps": 2, "history": 8, "loss_factor": 3.0}
"""The trigger of every run: the global gradient norm or the reported loss (averaged over the ranks) above 3x
its median over 10 steps fires, and the recorder hands back the last 8 steps."""
FP16_INITIAL_SCALE_POWER = 8

DEFAULT_RUN: Dict[str, Any] = {
    "optimizer": "adamw",
    "lr": 1e-3,
    "weight_decay": 0.01,
    "clip": 1.0,
    "dtype": "fp32",
    "steps": 30,
    "interval": 5,  # the measured steps of the logs, besides the recorded ones
    "trigger": TRIGGER,
    "faults": [],  # {"kind", "step", ...}: lr_factor, gradient_hooks, corrupt_weights, batch_of, loss_factor
    "every_step": False,  # measure every step and keep rank 0's norms (calibration)
    "tensorboard": True,
}


def lr_factor(run: Dict[str, Any], step: int) -> float:
    """The learning rate's factor at ``step``: ``{"kind": "lr", "step": S, "until": E, "factor": F}`` raises it F
    times on steps S to E - 1 (``until`` None: to the end)."""
    factor = 1.0
    for fault in run["faults"]:
        until = fault.get("until") or math.inf
        if fault["kind"] == "lr" and fault["step"] <= step < until:
            factor *= fault["factor"]
    return factor


def faults_at(run: Dict[str, Any], step: int, kind: str) -> List[Dict[str, Any]]:
    return [fault for fault in run["faults"] if fault["kind"] == kind and fault["step"] == step]


def layer_params(model: TinyGPT, layer: Optional[int]) -> List[torch.nn.Parameter]:
    """Every parameter of transformer layer ``layer``; of the whole model with ``None``."""
    return list((model if layer is None else model.layers[layer]).parameters())


def gradient_hooks(model: TinyGPT, run: Dict[str, Any], step: int, rank: int) -> List[Any]:
    """The step's gradient faults, as hooks on the parameters' gradients before DeepSpeed reduces them:
    ``{"kind": "grad", "layer": L, "factor": F}`` scales layer L's gradient F times on every rank (``rank``: on that
    rank only; ``layer`` None: every parameter's); ``{"kind": "nan", "layer": L, "rank": R}`` makes the first
    element of layer L's first gradient NaN on rank R. Returns the hooks' handles."""
    handles = []
    for fault in faults_at(run, step, "grad"):
        if fault.get("rank") in (None, rank):
            factor = fault["factor"]
            handles += [param.register_hook(lambda grad, factor=factor: grad * factor)
                        for param in layer_params(model, fault.get("layer"))]
    for fault in faults_at(run, step, "nan"):
        if fault["rank"] == rank:
            handles.append(layer_params(model, fault["layer"])[0].register_hook(_with_nan))
    return handles


def _with_nan(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.nan
    return grad


def corrupt_weights(engine, run: Dict[str, Any], step: int) -> None:
    """``{"kind": "weights", "layer": L, "param": NAME, "factor": F}``: that parameter of layer L times F, in place,
    before the step's forward (a bit flip in the exponent scales a weight by a power of two): the model's copy on
    every rank and DeepSpeed's fp32 master partition, so that the optimizer steps from the corrupted value too."""
    from deepspeed.utils import safe_set_full_fp32_param

    for fault in faults_at(run, step, "weights"):
        param = engine.module.layers[fault["layer"]].get_parameter(fault["param"])
        with torch.no_grad():
            safe_set_full_fp32_param(param, param.detach().float() * fault["factor"])
            param.mul_(fault["factor"])


def batch_of(run: Dict[str, Any], step: int, rank: int, world_size: int) -> torch.Tensor:
    """The step's micro-batch on ``rank``; ``{"kind": "batch", "rank": R}`` (``rank`` None: every rank's)
    replaces it by a corrupted one: every sequence one token repeated, as a block of padding or a broken shard
    gives."""
    batch = synthetic_batch(MODEL, MICRO_BATCH, seed=step * world_size + rank)
    for fault in faults_at(run, step, "batch"):
        if fault.get("rank") in (None, rank):
            batch = torch.full_like(batch, fault.get("token", 0))
    return batch


def loss_factor(run: Dict[str, Any], step: int) -> float:
    """``{"kind": "loss", "factor": F}``: the step's loss F times (every layer's gradient F times)."""
    return math.prod(fault["factor"] for fault in faults_at(run, step, "loss"))



def ds_config(run: Dict[str, Any], dump: Optional[str]) -> Dict[str, Any]:
    block = {"enabled": True, "interval": 1 if run["every_step"] else run["interval"], "optimizer_statistics": KINDS,
             "trigger": run["trigger"]}
    if dump:
        block["dump"] = {"path": dump}
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_clipping": run["clip"],
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": block,
    }
    if run["dtype"] == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": FP16_INITIAL_SCALE_POWER}
    return config


def norms_of(result: Dict[str, Any]) -> Dict[str, Dict[str, float]]:
    """A result's norm of each signal per bucket (``{"pre_clip": {"0": 1.2, ...}, "update": ...}``); JSON keys."""
    signals = ("pre_clip", "post_clip", *KINDS)
    return {signal: {str(key): stats["norm"] for key, stats in (result.get(signal) or {}).items()}
            for signal in signals if result.get(signal)}


def averaged_loss(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks, as Megatron reduces it: the same value on every rank."""
    from deepspeed import comm as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(run: Dict[str, Any], workdir: str, name: str) -> Dict[str, Any]:
    """One run; returns on every rank its losses, the steps of its fires and, with ``every_step``, rank 0's norms
    of every step. Rank 0 writes the dump ``<workdir>/<name>.jsonl``, the last rank TensorBoard under
    ``<workdir>/<name>-tb``."""
    import deepspeed
    from deepspeed import comm as dist
    from torch.utils.tensorboard import SummaryWriter

    from megatron_integration.training_log import log_layer_grad_norms

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[run["optimizer"]]
    optimizer = optimizer_class(model.parameters(), lr=run["lr"], weight_decay=run["weight_decay"])
    dump = os.path.join(workdir, f"{name}.jsonl")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(run, dump))
    tensorboard = os.path.join(workdir, f"{name}-tb")
    writer = SummaryWriter(tensorboard) if run["tensorboard"] and rank == world_size - 1 else None
    args = argparse.Namespace(log_layer_grad_norms=True, log_interval=10**9)
    record: Dict[str, Any] = {"losses": [], "norms": [], "dump": dump, "tensorboard": tensorboard}
    for step in range(1, run["steps"] + 1):
        corrupt_weights(engine, run, step)
        loss = engine(batch_of(run, step, rank, world_size)) * loss_factor(run, step)
        handles = gradient_hooks(engine.module, run, step, rank)
        engine.backward(loss)
        for handle in handles:
            handle.remove()
        reported = averaged_loss(loss)
        engine.layer_grad_norms.report_loss(reported)  # before the step: a loss spike fires at its own step
        with learning_rate_times(engine.optimizer, lr_factor(run, step)):
            engine.step()
        log_layer_grad_norms(engine, step, writer, args)
        record["losses"].append(reported)
        if run["every_step"] and rank == 0:
            record["norms"].append(norms_of(engine.get_layer_grad_norms()))
    record["fires"] = sorted(engine.get_layer_grad_norms_history("all") or {})
    if writer is not None:
        writer.close()
    engine.destroy()
    return record


def run_all(runs: Dict[str, Dict[str, Any]], workdir: str) -> Dict[str, Dict[str, Any]]:
    """Every run in ``runs`` (overrides of ``DEFAULT_RUN``) on this rank, in one launch; a run that fails is
    recorded (``error``), and the others still run."""
    install_feature()
    force_fp16_on_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    for name, overrides in runs.items():
        run = {**DEFAULT_RUN, **overrides}
        try:
            results[name] = {"run": run, **train(run, workdir, name)}
        except Exception:
            results[name] = {"run": run, "error": traceback.format_exc()}
    return results


def launch_runs(runs: Dict[str, Dict[str, Any]], workdir: str, world_size: int = 2,
                timeout: float = 1800) -> Dict[str, Dict[str, Any]]:
    """``run_all`` on ``world_size`` CPU ranks; rank 0's records."""
    from megatron_integration.cpu_launch import launch

    return launch(run_all, world_size, runs, workdir, timeout=timeout)[0]

