"""What each rank runs in the remedies' tests (test_remedies.py): train a TinyGPT with ``adaptive_clipping`` or
``skip_step`` on, and record what the optimizer applied and what the statistics report.

The optimizer is SGD with lr 1, so a step's update (weights before minus after) is the gradient the optimizer
received. Rank 0 also records the plain-PyTorch reference gradient of every step (reference.py), from the weights
before it; the test computes AdaGC's factors and the skip decision from it on its own.
"""

import argparse
import contextlib
import json
import logging
import os
import re
import tempfile
from typing import Any, Callable, Dict, Hashable, List

import torch

import deepspeed_patch.remedies.remedy_step
from megatron_integration.tiny_gpt import TinyGPT
from reference import averaged_gradients, bucket_stats, reference_bucket
from setup_workers import counting_collectives
from zero_workers import (
    DEFAULT_CASE,
    DTYPES,
    FP16_INITIAL_SCALE_POWER,
    OVERFLOW_BLOW_UP,
    batches_of_step,
    ds_config,
    full_weights,
    loss_scale,
    model_config,
    run_each,
)

REMEDY_CASE: Dict[str, Any] = {
    **DEFAULT_CASE,
    "spike_step": None,  # multiply this step's loss (every rank, every micro-batch) by SPIKE
    "report_loss": False,  # report the loss averaged over ranks and micro-batches before each step
    "resume_at": None,  # save a checkpoint after this step, train on, then resume from it in a new engine
    "resume_from": "checkpoint",  # or "universal" (converted by ds_to_universal), or "module" (no optimizer states)
    "dump": False,  # write the JSONL dump and return its lines
    "adam": False,  # Adam instead of SGD with lr 1 (ds_to_universal converts Adam's state only)
    "model": "tiny",  # "tp": tensor (x data) parallel MLP stack (parallel3d_workers); "pipe": a tied 2-stage pipeline
    "scale_window": 1000,  # fp16: clean steps before the loss scale grows (2: grows on every second step)
    "fail_scaling_at": None,  # make the adaptive scaling raise on this step (the remedy failing inside the step)
}
SPIKE = 1000.0
UNMATCHED = "unmatched"
"""The reference's bucket of the parameters a ``group_by`` pattern leaves out."""


def build(case: Dict[str, Any], enabled: bool = True):
    """The engine of ``case`` (the same initial weights every time)."""
    import deepspeed

    torch.manual_seed(0)
    config = ds_config(case, enabled)
    if case["dtype"] == "fp16":  # ZeRO unscales a growth step's gradient by the grown scale (a DeepSpeed bug)
        config["fp16"]["loss_scale_window"] = case["scale_window"]
    model = TinyGPT(model_config(case))
    params = [param for param in model.parameters()]
    if case["groups"]:
        params = [{"params": [p for p in params if p.ndim > 1]}, {"params": [p for p in params if p.ndim <= 1]}]
    optimizer = torch.optim.Adam(params, lr=1e-3) if case["adam"] else torch.optim.SGD(params, lr=1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def one_step(engine, case: Dict[str, Any], step: int, record: Dict[str, Any]) -> None:
    """Train optimizer step ``step`` and record its update, result and (rank 0) reference gradient."""
    from deepspeed import comm as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    before = full_weights(engine.module)
    scale_before = loss_scale(engine.optimizer)
    blow_up = SPIKE if step == case["spike_step"] else OVERFLOW_BLOW_UP if step == case["overflow_step"] else None
    losses = []
    for batch in batches_of_step(case, step, world_size, rank):
        loss = engine(batch)
        if blow_up is not None:
            loss = loss * blow_up
        losses.append(loss.detach().float())
        engine.backward(loss)
        if len(losses) == case["gas"] and case["report_loss"]:
            mean = torch.stack(losses).mean()
            dist.all_reduce(mean)
            record["losses"].append(mean.item() / world_size)
            engine.layer_grad_norms.report_loss(mean / world_size)
        with failing_scaling(step == case["fail_scaling_at"]), counting_collectives() as calls:
            engine.step()
        if len(losses) == case["gas"]:
            record["collectives"].append(calls[0])
    after = full_weights(engine.module)
    key_of = reference_key(case)
    record["applied"].append(bucket_stats({name: before[name] - after[name] for name in before}, key_of))
    record["loss_scales"].append((scale_before, loss_scale(engine.optimizer)))
    record["global_norm"].append(float(engine.get_global_grad_norm() or "nan"))
    record["unchanged"].append(all(torch.equal(before[name], after[name]) for name in before))
    record["measured"].append(engine.get_layer_grad_norms())
    record["skipped_steps"].append(engine.skipped_steps)
    if rank == 0:
        scale = 2.0**FP16_INITIAL_SCALE_POWER if case["dtype"] == "fp16" else 1.0
        grads = averaged_gradients(before, model_config(case), DTYPES[case["dtype"]],
                                   batches_of_step(case, step, world_size), (), scale, blow_up)
        record["reference"].append(bucket_stats(grads, key_of))


def reference_key(case: Dict[str, Any]) -> Callable[[str], Hashable]:
    """The reference's bucket of a parameter: its layer, or, under ``granularity: group_by``, the pattern's capture
    groups joined by ``.`` (``UNMATCHED`` where it does not match)."""
    if case["block"].get("granularity") != "group_by":
        return reference_bucket
    pattern = re.compile(case["block"]["group_by"])

    def group_key(name: str) -> Hashable:
        match = pattern.search(name)
        return ".".join(match.groups()) if match else UNMATCHED

    return group_key


class failing_scaling:
    """While ``on``: the remedy step's in-place scaling of the gradient partitions raises (a remedy failing inside the
    step, after global clipping was suspended)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.saved = deepspeed_patch.remedies.remedy_step.scale_spans

    def __enter__(self) -> None:
        if self.on:
            deepspeed_patch.remedies.remedy_step.scale_spans = self.fail

    def __exit__(self, *exc) -> None:
        deepspeed_patch.remedies.remedy_step.scale_spans = self.saved

    @staticmethod
    def fail(*args, **kwargs) -> None:
        raise RuntimeError("scaling failed (injected)")


def new_record() -> Dict[str, list]:
    return {"applied": [], "unchanged": [], "measured": [], "skipped_steps": [], "reference": [], "losses": [],
            "loss_scales": [], "global_norm": [], "collectives": []}


def train(case: Dict[str, Any]) -> Dict[str, Any]:
    engine = build(case)
    record = new_record()
    for step in range(1, case["steps"] + 1):
        one_step(engine, case, step, record)
        if step == case["resume_at"]:
            record["saved_state"] = engine.layer_grad_norms.remedy_step.remedies.state_dict()
            record["checkpoint"] = tempfile.mkdtemp(prefix="h38-remedies-")
            engine.save_checkpoint(record["checkpoint"], tag="resume")
    record["history"] = engine.get_layer_grad_norms_history()
    record["final"] = full_weights(engine.module, dtype=None)
    record["optimizer"] = type(engine.optimizer).__name__
    engine.destroy()
    if case["resume_at"] is not None:
        record["resumed"] = resume(case, record["checkpoint"])
    if case["dump"]:
        with open(case["block"]["dump"]["path"]) as lines:
            record["dump"] = [json.loads(line) for line in lines]
    return record


def resume(case: Dict[str, Any], checkpoint: str) -> Dict[str, Any]:
    """A new engine resumed from the checkpoint of step ``resume_at`` (``resume_from``: as saved, converted to a
    universal checkpoint, or without its optimizer states), trained to the end as the first was; the warnings of
    the package's loggers while loading and training."""
    from deepspeed import comm as dist

    tag = "resume"
    if case["resume_from"] == "universal":
        tag = "resume_universal"
        if dist.get_rank() == 0:
            to_universal(os.path.join(checkpoint, "resume"), os.path.join(checkpoint, tag))
        dist.barrier()
        case = {**case, "top": {**case["top"], "checkpoint": {"load_universal": True}}}
    engine = build(case)
    with warnings_of("deepspeed_patch") as logged:
        engine.load_checkpoint(checkpoint, tag=tag, load_optimizer_states=case["resume_from"] != "module")
        record = new_record()
        record["loaded_state"] = engine.layer_grad_norms.remedy_step.remedies.state_dict()
        for step in range(case["resume_at"] + 1, case["steps"] + 1):
            one_step(engine, case, step, record)
    record["warnings"] = logged
    record["final"] = full_weights(engine.module, dtype=None)
    engine.destroy()
    return record


def to_universal(folder: str, output: str) -> None:
    """DeepSpeed's own conversion (``ds_to_universal.py``), in this process; it adds the universal_checkpoint_info a
    model without one (not Megatron's) lacks (``--inject_missing_state``)."""
    from deepspeed.checkpoint.ds_to_universal import main

    main(argparse.Namespace(input_folder=folder, output_folder=output, num_extract_workers=1, num_merge_workers=1,
                            keep_temp_folder=False, strict=True, inject_missing_state=True))


@contextlib.contextmanager
def warnings_of(logger_name: str):
    """The messages of warnings and errors logged under ``logger_name`` inside the block."""
    messages: List[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def off_weights(case: Dict[str, Any], enabled: bool) -> Dict[str, Any]:
    """The final weights of ``case`` trained with the block (``enabled``) or without it, its spike included, and
    the last result the engine published."""
    from deepspeed import comm as dist

    engine = build(case, enabled)
    for step in range(1, case["steps"] + 1):
        for batch in batches_of_step(case, step, dist.get_world_size(), dist.get_rank()):
            loss = engine(batch)
            engine.backward(loss * SPIKE if step == case["spike_step"] else loss)
            engine.step()
    trained = {"weights": full_weights(engine.module, dtype=None), "result": engine.get_layer_grad_norms()}
    engine.destroy()
    return trained


def run_cases(cases: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Every case on this rank; a failing case is recorded (its error), not raised, so the others still run."""

    def trained(case: Dict[str, Any]) -> Dict[str, Any]:
        if case.get("compare_off"):
            on, off = off_weights(case, True), off_weights(case, False)
            return {"on": on["weights"], "off": off["weights"], "result": on["result"]}
        return {"on": PARALLEL_MODELS.get(case["model"], train)(case)}

    return run_each(cases, REMEDY_CASE, trained)


PARALLEL_CASE_KEYS = ("dtype", "stage", "clip", "steps", "block")
"""What a remedies case passes to the tensor-parallel and the pipeline workers' own cases."""


def train_tensor_parallel(case: Dict[str, Any]) -> Dict[str, Any]:
    """``case`` on ``parallel3d_workers``' tensor-parallel MLP stack, TP 2 x DP (world size / 2), no pipeline; the
    record holds every rank's final weights by name and which of them are replicated across the TP ranks."""
    from deepspeed import comm as dist
    from parallel3d_workers import DEFAULT_CASE as CASE_3D
    from parallel3d_workers import train as train_3d

    from tp_workers import TensorParallelModel

    tp = 2
    overrides = {key: case[key] for key in PARALLEL_CASE_KEYS}
    record = train_3d({**CASE_3D, **overrides, "pp": 1, "tp": tp, "dp": dist.get_world_size() // tp})
    names = [(name, not getattr(param, "tensor_model_parallel", False))
             for name, param in TensorParallelModel(tp).named_parameters()]
    record["final"] = {name: weight for (name, _), weight in zip(names, record["final"])}
    record["replicated"] = [name for name, replicated in names if replicated]
    record["unchanged"] = [False] * case["steps"]
    return record


def train_tied_pipe(case: Dict[str, Any]) -> Dict[str, Any]:
    """``case`` on ``pipeline_workers``' tiny GPT in as many stages as ranks, its embedding tied to its head: the
    record holds each stage's own copy of the tied weight."""
    from pipeline_workers import DEFAULT_CASE as PIPE_CASE
    from pipeline_workers import train_pipe

    overrides = {key: case[key] for key in PARALLEL_CASE_KEYS}
    return train_pipe({**PIPE_CASE, **overrides, "tie": True, "gas": 1})


PARALLEL_MODELS = {"tp": train_tensor_parallel, "pipe": train_tied_pipe}
