"""What each rank runs for the set-up tests: config errors, refused set-ups, warnings, collectives."""

import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List

import torch

import deepspeed_patch
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch, tiny_gpt_pipe
from zero_workers import force_fp16_on_cpu

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "broadcast", "reduce", "all_to_all_single", "barrier", "all_reduce_coalesced")


def base_config(**overrides: Any) -> Dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    config.update(overrides)
    return config


def initialize(config: Dict[str, Any], model: torch.nn.Module = None):
    import deepspeed

    torch.manual_seed(0)
    model = model or TinyGPT(TinyGPTConfig())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def installed_initialize(config: Dict[str, Any]) -> None:
    """``deepspeed.initialize`` after ``install()``, as a user's script calls them; nothing comes back."""
    deepspeed_patch.install()
    initialize(config).destroy()


def error_of(start: Callable[[], Any]) -> str:
    """The error ``start()`` raises, as ``Type: message``; '' if none."""
    try:
        start()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


def initialize_error(config: Dict[str, Any], model: torch.nn.Module = None) -> str:
    """The error ``deepspeed.initialize`` raises for ``config`` (and ``model``); '' if none."""
    return error_of(lambda: initialize(config, model).destroy())


class _Records(logging.Handler):

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def no_match_warning() -> Dict[str, Any]:
    """Train one step with a layer pattern that matches nothing; return the warnings and the keys."""
    handler = _Records()
    logging.getLogger("deepspeed_patch").addHandler(handler)
    engine = initialize(base_config(layer_grad_norms={"enabled": True, "layer_pattern": r"decoder\.(\d+)\."}))
    engine.backward(engine(synthetic_batch(TinyGPTConfig(), 2, seed=0)))
    engine.step()
    keys = list(engine.get_layer_grad_norms()["pre_clip"])
    engine.destroy()
    logging.getLogger("deepspeed_patch").removeHandler(handler)
    return {"warnings": handler.messages, "keys": keys}


@contextlib.contextmanager
def counting_collectives() -> Iterator[List[int]]:
    """Count calls to DeepSpeed's collectives inside the block, in the one-element list it yields."""
    from deepspeed import comm

    calls = [0]
    originals = {name: getattr(comm, name) for name in COLLECTIVES if hasattr(comm, name)}
    assert {"all_reduce", "all_gather_into_tensor", "broadcast"} <= set(originals), "nothing to count"

    def counting(original):

        def wrapper(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(comm, name, counting(original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)


@contextlib.contextmanager
def counting_all_reduce_bytes() -> Iterator[List[int]]:
    """Count the bytes this rank hands to ``torch.distributed.all_reduce`` inside the block (where DeepSpeed's
    torch backend sends every all-reduce), in the one-element list it yields."""
    import torch.distributed

    original = torch.distributed.all_reduce
    sent = [0]

    def counting(*args, **kwargs):
        tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
        sent[0] += tensor.numel() * tensor.element_size()
        return original(*args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        yield sent
    finally:
        torch.distributed.all_reduce = original


def collectives_per_step(block: Dict[str, Any], steps: int) -> Dict[str, Any]:
    """Inside each ``engine.step()`` of a run with ``block`` as the config block: the collective calls
    (``calls``) and the bytes all-reduced (``all_reduce_bytes``); and the buckets of the last result."""
    engine = initialize(base_config(layer_grad_norms=block) if block else base_config())
    counts: Dict[str, Any] = {"calls": [], "all_reduce_bytes": []}
    for step in range(steps):
        engine.backward(engine(synthetic_batch(TinyGPTConfig(), 2, seed=step)))
        with counting_collectives() as calls, counting_all_reduce_bytes() as sent:
            engine.step()
        counts["calls"].append(calls[0])
        counts["all_reduce_bytes"].append(sent[0])
    counts["buckets"] = len(engine.get_layer_grad_norms()["pre_clip"]) if block else 0
    engine.destroy()
    return counts


def collective_counts() -> Dict[str, Any]:
    """``collectives_per_step`` without the block and with it on every second step, 4 steps each."""
    return {"off": collectives_per_step({}, 4), "interval2": collectives_per_step({"enabled": True, "interval": 2}, 4)}


def failing_from_the_second_call(function):
    """``function``, raising from its second call on: a measurement that breaks after one good step."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] > 1:
            raise RuntimeError("injected failure")
        return function(*args, **kwargs)

    return wrapper


LOSS_TRIGGER = {"grad_norm_factor": 1e9, "loss_factor": 3.0, "window": 3, "capture_steps": 1, "history": 2}
"""Watches the loss (its all-reduce on every step) and never fires: the loss stays near its median."""


def failure_on_one_rank(steps: int, report_loss: bool = False, broken: str = "accumulate_partition",
                        **overrides: Any) -> Dict[str, Any]:
    """Break the measurement on the last rank only (``measurement.<broken>``, the kernel its family calls); training
    must go on, every rank of its process group switching it off. ``report_loss``: each rank reports its own loss
    before each step (the trigger's all-reduce of it)."""
    from deepspeed import comm as dist

    engine = initialize(base_config(**{"layer_grad_norms": {"enabled": True}, **overrides}))
    from deepspeed_patch.statistics import measurement

    kernel = getattr(measurement, broken)
    if dist.get_rank() == dist.get_world_size() - 1:
        setattr(measurement, broken, failing_from_the_second_call(kernel))
    record = {"losses": [], "measured": []}
    try:
        for step in range(steps):
            loss = engine(synthetic_batch(TinyGPTConfig(), 2, seed=step))
            engine.backward(loss)
            if report_loss:
                engine.layer_grad_norms.report_loss(loss.detach())
            engine.step()
            record["losses"].append(loss.item())
            record["measured"].append(engine.get_layer_grad_norms())
        record["weights"] = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    finally:
        setattr(measurement, broken, kernel)
        engine.destroy()
    return record


BAD_BLOCKS = {
    "unknown_key": {"enabled": True, "intervl": 2},
    "bad_layer_spec": {"enabled": True, "layers": "0,first,-1"},
    "bool_layer": {"enabled": True, "layers": [0, True]},
    "layer_out_of_range": {"enabled": True, "layers": [0, 7]},
    "negative_out_of_range": {"enabled": True, "layers": "-9"},
    "invalid_regex": {"enabled": True, "layer_pattern": "layers.(\\d+"},
    "regex_without_group": {"enabled": True, "layer_pattern": "layers\\.\\d+"},
    "interval_zero": {"enabled": True, "interval": 0},
    "interval_text": {"enabled": True, "interval": "often"},
    "granularity_typo": {"enabled": True, "granularity": "params"},
    "group_by_without_capture_group": {"enabled": True, "granularity": "group_by", "group_by": "dense_4h_to_h"},
    "group_by_without_its_granularity": {"enabled": True, "group_by": "layers\\.(\\d+)"},
    "unknown_statistic": {"enabled": True, "statistics": ["l1", "l2"]},
    "group_by_matching_nothing": {"enabled": True, "granularity": "group_by", "group_by": "decoder\\.(\\d+)"},
}

class MoEModel(torch.nn.Module):
    """One linear layer, then a 2-expert DeepSpeed MoE layer."""

    def __init__(self) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, k=1)


def moe_error() -> str:
    """The error for a model with MoE expert parameter groups without ZeRO (each rank's ``.grad`` holds only
    its own experts), as ``Type: message``."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = MoEModel()
    groups = split_params_into_different_moe_groups_for_optimizer([{"params": list(model.parameters()), "name": "p"}])
    return error_of(lambda: deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.1),
                                                 config=base_config(zero_optimization={"stage": 0},
                                                                    layer_grad_norms={"enabled": True})))


def pipeline_without_zero_errors() -> Dict[str, str]:
    """The errors for a one-stage pipeline trained in fp32 without ZeRO: none measuring, and the trigger's
    refusal (its per-step norm would be one stage's)."""
    trigger = {"grad_norm_factor": 3.0, "window": 5, "capture_steps": 1, "history": 4}
    return {
        name: initialize_error(base_config(zero_optimization={"stage": 0}, layer_grad_norms=block),
                               tiny_gpt_pipe(TinyGPTConfig(), num_stages=1))
        for name, block in (("measured", {"enabled": True}), ("trigger", {"enabled": True, "trigger": trigger}))
    }


def without_optimizer() -> Dict[str, Any]:
    """Engines built without an optimizer (ZeRO stage 0 in fp32 and in bf16, where DeepSpeed wraps a placeholder
    optimizer in ``BF16_Optimizer``; stage 3), the block enabled: the warnings and what ``get_layer_grad_norms()``
    returns after a forward pass."""
    import deepspeed

    handler, deepspeed_logger = _Records(), logging.getLogger("DeepSpeed")
    level = deepspeed_logger.level
    deepspeed_logger.addHandler(handler)
    deepspeed_logger.setLevel(logging.WARNING)
    results = {}
    for name, stage, dtype in (("stage 0", 0, {}), ("stage 0, bf16", 0, {"bf16": {"enabled": True}}),
                               ("stage 3", 3, {})):
        engine, *_ = deepspeed.initialize(model=TinyGPT(TinyGPTConfig()),
                                          config=base_config(zero_optimization={"stage": stage},
                                                             layer_grad_norms={"enabled": True}, **dtype))
        with torch.no_grad():
            engine(synthetic_batch(TinyGPTConfig(), 2, seed=0))
        results[name] = {"result": engine.get_layer_grad_norms(), "optimizer": type(engine.optimizer).__name__}
        engine.destroy()
    deepspeed_logger.removeHandler(handler)
    deepspeed_logger.setLevel(level)
    return {"warnings": handler.messages, "stages": results}


def prepare_rank() -> None:
    deepspeed_patch.install()
    force_fp16_on_cpu()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


def run_collective_counts() -> Dict[str, Any]:
    """``collective_counts`` alone, on a rank prepared as ``run_setup_checks`` prepares it."""
    prepare_rank()
    return collective_counts()


def run_setup_checks(multi_rank: bool) -> Dict[str, Any]:
    prepare_rank()
    results: Dict[str, Any] = {"collectives": collective_counts()}
    if multi_rank:
        results["failure"] = failure_on_one_rank(4)
        # without ZeRO each rank holds the whole model: its statistics' group is itself, and so is the loss's
        results["failure_stage0_loss"] = failure_on_one_rank(4, report_loss=True, broken="accumulate_spans",
                                                             zero_optimization={"stage": 0},
                                                             layer_grad_norms={"enabled": True,
                                                                               "trigger": LOSS_TRIGGER})
        return results
    results["bad_blocks"] = {name: initialize_error(base_config(layer_grad_norms=block))
                             for name, block in BAD_BLOCKS.items()}
    results["disabled_block_ok"] = initialize_error(base_config(layer_grad_norms={"enabled": False}))
    results["no_match"] = no_match_warning()
    results["moe"] = moe_error()
    results["pipeline_without_zero"] = pipeline_without_zero_errors()
    results["without_optimizer"] = without_optimizer()
    return results
