"""``optimizer_statistics`` under ZeRO stage 3 against a plain-PyTorch reference, on 2 and 3 CPU ranks.

The same workers and checks as tests/test_optimizer_statistics.py (ZeRO-1/2): the reference of each step is the
full fp32 weights before and after it and the Adam moments after it, gathered by DeepSpeed's ``safe_get_full_*``
helpers. Every case cuts the model's two parameter groups (the transformer layers at their own lr) into several
sub-groups (a small ``sub_group_size``), so that each sub-group's flat fp32 partition must be read with its own
group's hyper-parameters. The refusals of the set-ups whose optimizer state is elsewhere are unit tests.
"""

from functools import lru_cache

import pytest
import torch
from optimizer_workers import KINDS, run_cases
from test_optimizer_statistics import (
    UNEVEN,
    check_each_kind,
    check_skipped_update_zero,
    check_training_unchanged,
    rank_records,
)

from megatron_integration.cpu_launch import launch

SUB_GROUP_SIZE = 2000
"""Elements of a sub-group's partition, about: the embedding alone, the other outer parameters, a few per layer."""


def zero3(zero=None, **case):
    """A ZeRO-3 case whose parameter groups split into sub-groups, the layers' group at a third of the lr."""
    return {"stage": 3, "zero": {"sub_group_size": SUB_GROUP_SIZE, **(zero or {})}, "layer_lr": 3e-3, **case}


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
CASES = {
    2: {
        "z3_fp32_adamw_gas2_clip": zero3(gas=2, clip=0.1, compare_off=True),
        "z3_bf16_adamw_clip_scheduled": zero3(dtype="bf16", clip=0.1, scheduler=0.5),
        "z3_fp16_overflow_update_zero": zero3(dtype="fp16", overflow_step=2),
        "z3_offload_cpu_adam_clip": zero3(OFFLOAD, optimizer="cpu_adam", clip=0.1),
    },
    3: {
        "z3_fp32_adam_l2_gas2_uneven": zero3(optimizer="adam", gas=2, layers=UNEVEN, compare_off=True),
        "z3_offload_cpu_adam_fp16_overflow_uneven": zero3(OFFLOAD, optimizer="cpu_adam", dtype="fp16",
                                                          overflow_step=2, layers=UNEVEN),
    },
}
MEASURED = [(world, name) for world, cases in CASES.items() for name in cases]
COMPARED = [(world, name) for world, name in MEASURED if CASES[world][name].get("compare_off")]
SKIPPING = [(world, name) for world, name in MEASURED if CASES[world][name].get("overflow_step")]


@lru_cache(maxsize=None)
def results_of(world_size: int):
    return launch(run_cases, world_size, CASES[world_size])


def result_of(world_size: int, name: str):
    return rank_records(results_of(world_size), name)


@pytest.mark.extended
@pytest.mark.parametrize("world, name", MEASURED)
def test_each_kind_matches_the_full_fp32_state_per_bucket(world, name):
    """Every rank reports, for every step and every kind, each bucket's statistics of the gathered full fp32
    weights (after the step), their change, and the moments."""
    check_each_kind(result_of(world, name), KINDS)


@pytest.mark.extended
@pytest.mark.parametrize("world, name", MEASURED)
def test_the_sub_groups_split_the_parameter_groups(world, name):
    """The cases run under ZeRO-3 with more sub-groups than parameter groups, so that a sub-group's index is
    not its group's: the statistics read each sub-group with its group's lr (``sub_group_to_group_id``)."""
    record = result_of(world, name)[0]["on"]
    assert record["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    group_ids = list(record["sub_group_to_group_id"].values())
    assert set(group_ids) == {0, 1} and group_ids != list(range(len(group_ids)))


@pytest.mark.extended
@pytest.mark.parametrize("world, name", SKIPPING)
def test_a_skipped_step_updates_nothing(world, name):
    """The fp16 step the loss scaler skips reports a zero update in every bucket (and the reference agrees)."""
    check_skipped_update_zero(result_of(world, name)[0])


@pytest.mark.extended
@pytest.mark.parametrize("world, name", COMPARED)
def test_training_is_bit_identical_and_the_collectives_unchanged(world, name):
    """The same gathered weights with the kinds on, with gradient statistics only and with the block off; a
    measured step makes the two collectives of the gradient statistics and no more."""
    check_training_unchanged(result_of(world, name))


def stage3_optimizer(cls=None, **attributes):
    """A ZeRO-3 optimizer object (not initialized) with an AdamW inside, its offload and precision attributes as
    a plain set-up has them, changed by ``attributes``."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    cls = cls or DeepSpeedZeroOptimizer_Stage3
    optimizer = cls.__new__(cls)
    optimizer.__dict__.update({
        "optimizer": torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]),
        "swap_optimizer": False,
        "offload_optimizer": False,
        "partial_offload": 1.0,
        "master_weights_and_grads_dtype": torch.float32,
        **attributes
    })
    return optimizer


def super_offload_class():
    from deepspeed.runtime.superoffload.superoffload_stage3 import SuperOffloadOptimizer_Stage3

    return SuperOffloadOptimizer_Stage3


@pytest.mark.parametrize("super_offload, attributes, words", [
    (False, {"swap_optimizer": True, "offload_optimizer": True}, ["zero_optimization.offload_optimizer.device=nvme"]),
    (True, {"offload_optimizer": True}, ["zero_optimization.offload_optimizer.super_offload=true"]),
    (False, {"offload_optimizer": True, "partial_offload": 0.5}, ["zero_optimization.offload_optimizer.ratio=0.5"]),
    (False, {"master_weights_and_grads_dtype": torch.bfloat16}, ["torch.bfloat16", "bf16_master_weights_and_grads"]),
])
def test_zero3_refuses_the_state_elsewhere_by_key(super_offload, attributes, words):
    """Under ZeRO-3 the kinds need the optimizer state in this process's memory, under the inner optimizer, in
    fp32: each set-up where it is not is refused naming its ds_config key; the plain and offloaded ones are not."""
    from deepspeed_patch.adapters.refusals import check_optimizer_statistics
    from deepspeed_patch.adapters.zero3 import Zero3Adapter
    from deepspeed_patch.config import UnsupportedSetupError, load_config

    config = load_config({"layer_grad_norms": {"optimizer_statistics": ["param", "update"]}})
    check_optimizer_statistics(stage3_optimizer(), Zero3Adapter, config)
    check_optimizer_statistics(stage3_optimizer(offload_optimizer=True), Zero3Adapter, config)
    cls = super_offload_class() if super_offload else None
    with pytest.raises(UnsupportedSetupError) as error:
        check_optimizer_statistics(stage3_optimizer(cls, **attributes), Zero3Adapter, config)
    message = str(error.value)
    for word in ["optimizer_statistics=['param', 'update']", "ZeRO stage 3", "memory", *words]:
        assert word in message, message
