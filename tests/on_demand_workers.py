"""What each rank runs in the on-demand tests: spike trigger, runtime switch, control file, dump, monitors."""

import json
import math
import os
from typing import Any, Dict, List

import torch

import deepspeed_patch
from megatron_integration.tiny_gpt import TinyGPTConfig, synthetic_batch
from setup_workers import base_config, counting_collectives, initialize
from zero_workers import force_fp16_on_cpu

FP16 = {"enabled": True, "initial_scale_power": 8}
# A loss scale that doubles every 2 steps from 2**14: it outgrows the TinyGPT gradient at step 14, where the
# scaler skips 2 steps in a row (DeepSpeed's default hysteresis of 2), and later skips single steps.
GROWING_FP16 = {"enabled": True, "initial_scale_power": 14, "loss_scale_window": 2}
NAN, INF = math.nan, math.inf
NAN_CASES = {  # each rank's piece of one bucket's gradient
    "nan_on_rank_0": ([NAN, 1.0, -2.0], [0.5, 3.0]),
    "nan_on_rank_1": ([0.5, 3.0], [NAN, 1.0, -2.0]),
    "nan_on_both": ([NAN, 1.0], [-2.0, NAN]),
    "inf_on_rank_0_nan_on_rank_1": ([INF, 1.0], [NAN, -1.0]),
    "nan_on_rank_0_inf_on_rank_1": ([NAN, -1.0], [INF, 1.0]),
    "inf_on_rank_1": ([1.0, -2.0], [-INF, 0.5]),
    "rank_0_empty_nan_on_rank_1": ([], [NAN, 0.25]),
    "finite": ([1.0, -2.0], [0.5, 3.0]),
}


def train(engine, steps: int, loss_factor: Dict[int, float] = None, before_step=None) -> List[Any]:
    """Train ``steps`` steps (1-based); returns ``get_layer_grad_norms()`` after each."""
    measured = []
    for step in range(1, steps + 1):
        if before_step is not None:
            before_step(step)
        loss = engine(synthetic_batch(TinyGPTConfig(), 2, seed=step))
        engine.backward(loss * (loss_factor or {}).get(step, 1.0))
        engine.step()
        measured.append(engine.get_layer_grad_norms())
    return measured


def nan_reductions() -> Dict[str, Dict[str, Any]]:
    """Each ``NAN_CASES`` bucket reduced over the real 2-rank gloo group (``reduce_stats``), and the backend's
    own MAX all-reduce of ``[NaN, 1]`` against ``[1, NaN]`` (what the coding works around)."""
    from deepspeed import comm as dist

    from deepspeed_patch.statistics.partition_stats import accumulate_spans
    from deepspeed_patch.statistics.reduction import reduce_stats
    from deepspeed_patch.statistics.statistics import empty_stats

    rank, results = dist.get_rank(), {}
    for name, pieces in NAN_CASES.items():
        table = empty_stats(2, "cpu")  # the bucket, and a status row left at the identity
        if pieces[rank]:
            accumulate_spans(table, [torch.tensor(pieces[rank], dtype=torch.float32)], torch.tensor([0]))
        results[name] = reduce_stats(table, None)
    raw = torch.tensor([NAN, 1.0] if rank == 0 else [1.0, NAN], dtype=torch.float64)
    dist.all_reduce(raw, op=dist.ReduceOp.MAX)
    return {"reduced": results, "raw_max": raw.tolist()}


def scale_growth() -> Dict[str, Any]:
    """fp16 training whose dynamic loss scale grows into routine overflows, with the default overflow policy."""
    trigger = {"grad_norm_factor": 1e9, "window": 5, "capture_steps": 2, "history": 4}
    engine = initialize(base_config(fp16=GROWING_FP16, layer_grad_norms={"enabled": False, "trigger": trigger}))
    record = {"overflow": [], "history": [], "measured": []}
    for step in range(1, 21):
        engine.backward(engine(synthetic_batch(TinyGPTConfig(), 2, seed=step)))
        engine.step()
        record["overflow"].append(bool(engine.optimizer.overflow))
        record["history"].append(engine.get_layer_grad_norms_history())
        record["measured"].append(engine.get_layer_grad_norms())
    engine.destroy()
    return record


LOSS_TRIGGER = {"grad_norm_factor": 1e9, "loss_factor": 3.0, "window": 5, "capture_steps": 1, "history": 4}
OWN_LOSS_SPIKE = 8
"""The step at which rank 1's own loss, and only rank 1's, is reported 100 times larger."""


def own_losses() -> Dict[str, Any]:
    """A loss trigger fed each rank's own loss (each rank trains on other data, nothing averages it), rank 1's
    spiking at ``OWN_LOSS_SPIKE``: on every rank (``every_rank``), on rank 1 alone (``rank_1_only``); and the same
    trigger without ``loss_factor`` (``no_loss_factor``), whose collectives per step are the baseline. Each run: the
    fires with their recorded steps, and the collectives inside each ``engine.step()``."""
    from deepspeed import comm as dist

    rank = dist.get_rank()
    no_loss = {key: value for key, value in LOSS_TRIGGER.items() if key != "loss_factor"}
    runs = {"every_rank": (LOSS_TRIGGER, (0, 1)), "rank_1_only": (LOSS_TRIGGER, (1, )),
            "no_loss_factor": (no_loss, ())}
    record = {}
    for name, (trigger, reporting) in runs.items():
        engine = initialize(base_config(layer_grad_norms={"enabled": False, "trigger": trigger}))
        collectives = []
        for step in range(1, 11):
            loss = engine(synthetic_batch(TinyGPTConfig(), 2, seed=100 * rank + step))
            engine.backward(loss)
            if rank in reporting:
                engine.layer_grad_norms.report_loss(loss.detach() * (100.0 if (rank, step) == (1, OWN_LOSS_SPIKE)
                                                                     else 1.0))
            with counting_collectives() as calls:
                engine.step()
            collectives.append(calls[0])
        record[name] = {"fires": engine.get_layer_grad_norms_history("all"), "collectives": collectives}
        engine.destroy()
    return record


AGREED_LOSSES = {  # each rank's report (None: none; a tensor: a device loss), and the loss every rank judges
    "rank_1_larger": ((1.0, torch.tensor(3.0)), 3.0),
    "rank_0_only": ((2.5, None), 2.5),
    "none": ((None, None), -INF),
    "nan_on_rank_0": ((NAN, 7.0), NAN),
    "inf_on_rank_1_nan_on_rank_0": ((NAN, INF), NAN),
    "minus_inf_on_rank_1": ((1.0, -INF), NAN),
    "inf_on_rank_0": ((INF, 1.0), INF),
}


def agreed_over_two_ranks() -> Dict[str, float]:
    """``reduction.agreed_losses`` (one slot) over the real 2-rank gloo group, for each of ``AGREED_LOSSES``."""
    from deepspeed import comm as dist

    from deepspeed_patch.statistics.reduction import agreed_losses

    return {name: agreed_losses([reports[dist.get_rank()]])[0].item() for name, (reports, _) in AGREED_LOSSES.items()}


def run_on_demand(workdir: str, extended: bool = False) -> Dict[str, Any]:
    """The suite's runs (the trigger, switching by the method and by the control file, the monitors, the agreed
    loss and NaN over gloo), or with ``extended`` the extended tier's (each rank's own loss, the fp16 scale's
    growth)."""
    from deepspeed import comm as dist

    deepspeed_patch.install()
    force_fp16_on_cpu()
    if extended:
        return {"own_losses": own_losses(), "scale_growth": scale_growth()}
    results = {}

    trigger = {"grad_norm_factor": 3.0, "window": 5, "capture_steps": 2, "on_overflow": True, "overflow_steps": 1}
    dump = {"path": os.path.join(workdir, "layer_grad_norms.jsonl")}
    engine = initialize(base_config(fp16=FP16, layer_grad_norms={"enabled": False, "trigger": trigger, "dump": dump,
                                                                  "layers": "0"}))
    # step 8: a spike (loss x 100); step 13: an fp16 overflow (loss x 1e30)
    results["trigger"] = train(engine, 16, loss_factor={8: 100.0, 13: 1e30})
    engine.destroy()

    engine = initialize(base_config(layer_grad_norms={"enabled": False, "trigger": trigger}))

    def switch(step: int) -> None:
        if step == 3:
            engine.set_layer_grad_norms(enabled=True, interval=1, layers="0")
        if step == 5:
            engine.set_layer_grad_norms(enabled=False)

    results["method"] = train(engine, 6, before_step=switch)
    engine.destroy()

    control = os.path.join(workdir, f"control-{dist.get_world_size()}.json")
    engine = initialize(base_config(layer_grad_norms={"enabled": False, "control_file": control,
                                                      "control_interval": 2}))

    def write_control(step: int) -> None:
        settings = {4: {"enabled": True, "interval": 1}, 6: {"enabled": False}}.get(step)
        if settings and dist.get_rank() == 0:  # an operator edits the file between steps 3 and 4, 5 and 6
            with open(control, "w") as out:
                json.dump(settings, out)
            os.utime(control, ns=(step * 10**9, step * 10**9))
        dist.barrier()

    results["control"] = train(engine, 8, before_step=write_control)
    engine.destroy()

    monitor_dir = os.path.join(workdir, "monitors")
    engine = initialize(base_config(
        layer_grad_norms={"enabled": True, "layers": "0,-1"},
        csv_monitor={"enabled": True, "output_path": monitor_dir, "job_name": "csv"},
        tensorboard={"enabled": True, "output_path": monitor_dir, "job_name": "tb"}))
    results["monitor"] = train(engine, 2)
    results["global_samples"] = engine.global_samples
    engine.destroy()
    results["agreed_losses"] = agreed_over_two_ranks()
    results["nan"] = nan_reductions()
    return results
