"""``optimizer_statistics`` without ZeRO (stage 0), on 2 and 3 CPU ranks: fp32 (the torch optimizer steps the model's
own parameters), FP16_Optimizer (one flat fp32 master per group, FusedAdam) and FP16_UnfusedOptimizer (an fp32
copy per parameter, torch Adam/AdamW), in fp16 with a skipped step and in bf16.

One launch per world size runs all of that world's cases (optimizer_workers.py). DeepSpeed's ``safe_get_full_*``
return None here, so the reference of each step is read directly from what the optimizer holds
(``optimizer_workers.stage0_masters``) and reduced per bucket in float64 (reference.bucket_stats). Every rank holds
the whole state: the kinds add no collective, as the gradient statistics add none.
"""

import math
from functools import lru_cache

import pytest
import torch
from optimizer_workers import KINDS, run_cases
from test_optimizer_statistics import (
    TOLERANCE,
    check_each_kind,
    check_skipped_second_step,
    check_unchanged,
    rank_records,
)

from megatron_integration.cpu_launch import launch

CASES = {
    2: {
        "s0_fp32_adamw_gas2_clip": {"stage": 0, "gas": 2, "clip": 0.1, "compare_off": True},
        "s0_fp16_fused_adamw_overflow": {"stage": 0, "dtype": "fp16", "optimizer": "fused_adam", "overflow_step": 2,
                                         "compare_off": True},
        "s0_bf16_unfused_adamw_clip": {"stage": 0, "dtype": "bf16", "clip": 0.1},
        "s0_fp16_unfused_adam_l2_overflow": {"stage": 0, "dtype": "fp16", "optimizer": "adam", "overflow_step": 2,
                                             "compare_off": True},
    },
    3: {
        "s0_fp32_fused_adam_scheduled": {"stage": 0, "optimizer": "fused_adam", "scheduler": 0.5,
                                         "compare_off": True},
        "s0_bf16_fused_adamw_gas2_clip": {"stage": 0, "dtype": "bf16", "optimizer": "fused_adam", "gas": 2,
                                          "clip": 0.1},
        "s0_fp16_unfused_adamw_overflow_clip": {"stage": 0, "dtype": "fp16", "overflow_step": 2, "clip": 0.1,
                                                "compare_off": True},
    },
}
CASE_LIST = [(world, name) for world, cases in CASES.items() for name in cases]
SKIPPING = [(world, name) for world, name in CASE_LIST if CASES[world][name].get("overflow_step")]
COMPARED = [(world, name) for world, name in CASE_LIST if CASES[world][name].get("compare_off")]


@lru_cache(maxsize=None)
def results_of(world_size: int):
    return launch(run_cases, world_size, CASES[world_size])


def result_of(world_size: int, name: str):
    return rank_records(results_of(world_size), name)


def extended(cases):
    return [pytest.param(*case, marks=[pytest.mark.extended]) for case in cases]


@pytest.mark.parametrize("world, name", extended(CASE_LIST))
def test_each_kind_matches_the_fp32_masters_per_bucket(world, name):
    """Every rank reports, for every step and every kind, each bucket's statistics of the fp32 masters the family
    holds (after the step), their change, and the moments."""
    check_each_kind(result_of(world, name), KINDS)


@pytest.mark.parametrize("world", extended([(2, ), (3, )]))
def test_the_cases_cover_every_stage0_family(world):
    """The optimizer classes the cases ran under, as DeepSpeed picked them: the torch optimizer or FusedAdam itself
    in fp32, FP16_Optimizer for FusedAdam in fp16 and bf16, FP16_UnfusedOptimizer for torch's."""
    families = {name: result_of(world, name)[0]["on"]["optimizer"] for name in CASES[world]}
    expected = {"fp32_adamw": "AdamW", "fp32_fused_adam": "FusedAdam", "unfused": "FP16_UnfusedOptimizer",
                "fused": "FP16_Optimizer"}
    for name, family in families.items():
        assert family == next(value for key, value in expected.items() if key in name), (name, family)


@pytest.mark.parametrize("world, name", extended(SKIPPING))
def test_a_skipped_step_updates_nothing(world, name):
    """The fp16 step the loss scaler skips reports a zero update in every bucket (and the reference agrees)."""
    check_skipped_second_step(result_of(world, name)[0]["on"])


@pytest.mark.parametrize("world, name", extended(COMPARED))
def test_training_is_bit_identical_and_no_collective_is_added(world, name):
    """The same weights with the kinds on, with gradient statistics only and with the block off; every rank holds
    the whole state, so a measured step makes no collective for the statistics, kinds or not."""
    for record in result_of(world, name):
        check_unchanged(record, 0)


def test_parameter_statistics_read_each_parameter_and_its_state():
    """Parameters of two groups (one not counted here) stepped by AdamW and by FusedAdam, which counts a group's
    steps on its last parameter only: each bucket's weights, update and moments against plain torch on the actual
    after minus before, per parameter."""
    from deepspeed.ops.adam import FusedAdam

    from deepspeed_patch.optimizer_state.optimizer_stats import parameter_statistics
    from deepspeed_patch.statistics.statistics import SUMSQ, empty_stats

    checked = 0
    for make in (lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
                 lambda groups: FusedAdam(groups, lr=1e-2, weight_decay=0.1)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((30, 20), (70, ), (5, 4, 3), (11, ))]
        optimizer = make([{"params": params[:3]}, {"params": params[3:], "lr": 3e-3}])
        buckets = [[1, 0, 1], [None]]
        reader = parameter_statistics(optimizer, buckets, tuple(KINDS))
        for _ in range(3):
            before = [param.detach().clone() for param in params]
            for param in params:
                param.grad = torch.randn_like(param)
            reader.begin_step()
            optimizer.step()
        tables = {kind: empty_stats(2, "cpu") for kind in KINDS}
        reader.accumulate(tables, skipped=False)
        for kind, table in tables.items():
            for bucket in (0, 1):
                members = [index for index, row in enumerate([1, 0, 1]) if row == bucket]
                values = {index: _kind_of(kind, params[index], before[index], optimizer.state[params[index]])
                          for index in members}
                expected = sum(value.double().square().sum().item() for value in values.values())
                assert math.isclose(table[bucket, SUMSQ].item(), expected, rel_tol=TOLERANCE), (kind, bucket)
                checked += 1
    assert checked == 2 * len(KINDS) * 2


def _kind_of(kind: str, param: torch.Tensor, before: torch.Tensor, state: dict) -> torch.Tensor:
    return {"param": param.detach(), "update": param.detach() - before}.get(kind, state.get(kind))
