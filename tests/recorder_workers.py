"""What each rank runs in the flight-recorder tests: train a TinyGPT with ``trigger.history``, force a fire,
and record the history, the plain-PyTorch reference of every step (rank 0), and the collectives per step."""

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_integration.tiny_gpt import TinyGPT
from reference import averaged_gradients, bucket_stats
from setup_workers import counting_collectives
from zero_workers import (
    DEFAULT_CASE,
    DTYPES,
    FP16_INITIAL_SCALE_POWER,
    batches_of_step,
    ds_config,
    force_fp16_on_cpu,
    install_feature,
    loss_scale,
    model_config,
)

SPIKE = 64.0  # a power of two: the spiked step's gradient is the ordinary one scaled exactly, in every dtype
HISTORY = 4
TRIGGER = {"grad_norm_factor": 3.0, "window": 5, "capture_steps": 1, "history": HISTORY}
OVERFLOW_IN_BLOCK = (2, 11)
"""An fp16 overflow that the loss scaler skips at step 2 (one: no fire), and the spike that fires at step 11: the
overflowed step lies in the first recorder block before the recorded steps."""
FULL_DISK = "full"
"""The folder of the work directory where the tests mount a small tmpfs (as root), a full disk for the dump."""


def recorder_case(**overrides: Any) -> Dict[str, Any]:
    """A zero_workers case measuring nothing on its own (unless ``measure``): only the recorder and the
    trigger's capture. ``fault``: what ``inject_fault`` breaks."""
    case = {**DEFAULT_CASE, "steps": 8, "spikes": (7, ), "overflow_step": None, "report_loss": False,
            "trigger": TRIGGER, "dump": None, "measure": False, "fault": None, **overrides}
    case["block"] = {"enabled": case["measure"], "trigger": case["trigger"],
                     **({"dump": {"path": case["dump"]}} if case["dump"] else {})}
    return case


FAULTY_STEP = 5
"""The step at which a ``record_only`` or ``skip_push`` fault strikes rank 1."""


def inject_fault(engine, fault: Optional[str]) -> List[Tuple[Any, str, Any]]:
    """Break one rank: ``monitor``, DeepSpeed's monitors raise on rank 0 (our events only); ``record_only``,
    rank 1's measurement raises on a step that is only recorded; ``skip_push``, rank 1 misses recording a
    step (its ring slots shift). A full disk under the dump needs no injection (``dump`` on a small tmpfs).
    Returns what to restore: ``(owner, name, original)``."""
    if fault is None:  # nothing to break: deepspeed_patch untouched (the series' runs have none)
        return []
    from deepspeed import comm as dist

    from deepspeed_patch.outputs import monitor
    from deepspeed_patch.statistics import measurement

    adapter, rank = engine.layer_grad_norms, dist.get_rank()
    if fault == "monitor" and rank == 0:

        def raising(self, result):
            raise RuntimeError("injected monitor failure")

        return [_replace(monitor.MonitorEvents, "write", raising)]
    if fault == "record_only" and rank == 1:
        original = measurement.accumulate_partition

        def failing(*args, **kwargs):
            if adapter.schedule.step == FAULTY_STEP:
                raise RuntimeError("injected measurement failure")
            return original(*args, **kwargs)

        return [_replace(measurement, "accumulate_partition", failing)]
    if fault == "skip_push" and rank == 1:
        recorder = adapter.spikes.recorder
        push = recorder.push
        recorder.push = lambda table, scales: None if scales.step == FAULTY_STEP else push(table, scales)
    return []


def _replace(owner: Any, name: str, value: Any) -> Tuple[Any, str, Any]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    return owner, name, original


class LogRecords(logging.Handler):
    """The package's warnings and errors: message, and whether a traceback came with it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: List[Tuple[str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.getMessage(), record.exc_info is not None))


def _step_loss(engine, case: Dict[str, Any], step: int, batch: torch.Tensor) -> torch.Tensor:
    loss = engine(batch)
    if step in case["spikes"]:
        loss = loss * SPIKE
    if step == case["overflow_step"]:
        loss = loss * 1e30
    return loss


def _reported_loss(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks, as Megatron reduces it: the same value on every rank."""
    from deepspeed import comm as dist

    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(case: Dict[str, Any], enabled: bool, count: bool = False) -> Dict[str, Any]:
    """Train ``case``; with ``enabled``, its block (the recorder); else no block at all. ``count``: without the
    reference (a case that checks collectives or faults only)."""
    import deepspeed
    from deepspeed import comm as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(model_config(case))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=ds_config(case, enabled))
    injected = inject_fault(engine, case["fault"]) if enabled else []
    logs = LogRecords()
    logging.getLogger("deepspeed_patch").addHandler(logs)
    record: Dict[str, List[Any]] = {"losses": [], "history": [], "reference": [], "applied": [], "collectives": [],
                                    "measured": []}
    for step in range(1, case["steps"] + 1):
        before = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
        scale = loss_scale(engine.optimizer)
        (batch, ) = batches_of_step(case, step, world_size, rank)
        loss = _step_loss(engine, case, step, batch)
        record["losses"].append(loss.item())
        engine.backward(loss)
        if case["report_loss"] and enabled:
            engine.layer_grad_norms.report_loss(_reported_loss(loss))
        with counting_collectives() as calls:
            engine.step()
        record["collectives"].append(calls[0])
        after = {name: p.detach().float() for name, p in engine.module.named_parameters()}
        record["applied"].append(bucket_stats({name: before[name] - after[name] for name in after}))
        record["history"].append(engine.get_layer_grad_norms_history() if enabled else None)
        record["measured"].append(engine.get_layer_grad_norms() if enabled else None)
        if rank == 0 and enabled and not count:
            factor = SPIKE if step in case["spikes"] else 1.0
            reference_scale = 2.0**FP16_INITIAL_SCALE_POWER if case["dtype"] == "fp16" else 1.0
            grads = averaged_gradients(before, model_config(case), DTYPES[case["dtype"]],
                                       batches_of_step(case, step, world_size), (), reference_scale)
            record["reference"].append(bucket_stats({name: grad * factor for name, grad in grads.items()}))
            record.setdefault("loss_scales", []).append((scale, loss_scale(engine.optimizer)))
    record["final"] = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    record["optimizer"] = type(engine.optimizer).__name__
    recorder = engine.layer_grad_norms.spikes.recorder if enabled else None
    record["ring_bytes"] = None if recorder is None else recorder.nbytes
    record["fires"] = engine.get_layer_grad_norms_history("all") if enabled else None
    logging.getLogger("deepspeed_patch").removeHandler(logs)
    for owner, name, original in injected:
        setattr(owner, name, original)
    record["logs"] = logs.records
    engine.destroy()
    return record


def run_recorder(workdir: str) -> Dict[str, Any]:
    """Every recorder case of this world size, in one launch; a failing case is recorded, not raised."""
    import traceback

    from deepspeed import comm as dist

    install_feature()
    force_fp16_on_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    world = dist.get_world_size()
    cases = {
        "z1_fp32": recorder_case(stage=1),
        "z2_fp32_clip_two_fires": recorder_case(stage=2, clip=0.5, steps=12, spikes=(7, 11),
                                                dump=os.path.join(workdir, f"dump-{world}.jsonl")),
        "z0_fp32_clip": recorder_case(stage=0, clip=0.5),
        "bf16_optimizer": recorder_case(stage=1, dtype="bf16", grad_accum_dtype="fp32"),
        "z2_fp16_overflow": recorder_case(stage=2, dtype="fp16", spikes=(), overflow_step=7,
                                          trigger={**TRIGGER, "overflow_steps": 1}),
        "z2_fp16_overflow_in_block": recorder_case(stage=2, dtype="fp16", spikes=(OVERFLOW_IN_BLOCK[1], ),
                                                   overflow_step=OVERFLOW_IN_BLOCK[0],
                                                   steps=OVERFLOW_IN_BLOCK[1] + 1),
        "z2_loss_trigger": recorder_case(stage=2, report_loss=True,
                                         trigger={**TRIGGER, "grad_norm_factor": 1e9, "loss_factor": 3.0}),
    }
    if world == 2:  # the policy and the faults: one world is enough
        cases.update(policy_and_fault_cases(workdir))
    results: Dict[str, Optional[Dict[str, Any]]] = {}
    for name, case in cases.items():
        try:
            results[name] = {"case": case, "on": train(case, enabled=True, count=name.startswith("fault_"))}
            if name == "z2_fp32_clip_two_fires":
                results[name]["off"] = train(case, enabled=False)
                without_ring = recorder_case(**{**case, "trigger": {**TRIGGER, "history": 0}, "dump": None})
                results[name]["no_history"] = train(without_ring, enabled=True, count=True)
        except Exception:
            results[name] = {"case": case, "error": traceback.format_exc()}
    return results


def policy_and_fault_cases(workdir: str) -> Dict[str, Dict[str, Any]]:
    """Overlapping fires, a fire before the ring is full, a shifted ring, and a fault on one rank each."""
    return {
        "z2_overlapping_fires": recorder_case(stage=2, steps=10, spikes=(7, 9), trigger={**TRIGGER, "cooldown": 2},
                                              dump=os.path.join(workdir, "overlap.jsonl")),
        "z2_fire_before_the_ring_is_full": recorder_case(stage=2, trigger={**TRIGGER, "history": 8}),
        "z2_shifted_ring": recorder_case(stage=2, fault="skip_push"),
        "fault_dump_on_a_full_disk": recorder_case(stage=2, measure=True,
                                                   dump=os.path.join(workdir, FULL_DISK, "dump.jsonl")),
        "fault_monitor_on_rank_0": recorder_case(stage=2, measure=True, fault="monitor", top={"csv_monitor": {
            "enabled": True, "output_path": os.path.join(workdir, "monitors"), "job_name": "csv"}}),
        "fault_record_only_step_on_rank_1": recorder_case(stage=2, fault="record_only"),
    }
