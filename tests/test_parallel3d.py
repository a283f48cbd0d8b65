"""Per-layer statistics with data parallelism > 1 under tensor and pipeline parallelism (3D).

TP 2 x DP 2 and PP 2 x DP 2 on 4 CPU ranks, TP 2 x PP 2 x DP 2 on 8, one launch per world size;
ZeRO-1 with clipping, and BF16_Optimizer. Each DP rank holds another ZeRO partition of the same
stage's shard: the reduction over all ranks must count every element once (TP replicas off TP rank 0
are left out by ``bucket_of``), and match the unsharded model's gradient (``parallel3d_workers``).
"""

import math
from functools import lru_cache

import pytest
from parallel3d_workers import run_3d_cases

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats, assert_matches_applied

CASES = {
    4: {
        "tp2_dp2_zero1_clip": {
            "pp": 1
        },
        "pp2_dp2_zero1_clip": {
            "pp": 2,
            "tp": 1
        },
        "tp2_dp2_sequence_parallel": {
            "pp": 1,
            "sequence_parallel": True,
            "steps": 0
        },
    },
    8: {
        "tp2_pp2_dp2_zero1_clip": {
            "pp": 2
        },
        "tp2_pp2_dp2_bf16_optimizer_clip": {
            "pp": 2,
            "dtype": "bf16"
        },
    },
}
APPLIED_TOLERANCE = 1e-3
"""Relative, of the fp32 weights' change under SGD with lr 1 to the clipped gradient (besides their rounding)."""
# The 8-rank launch runs in CI's extended pass (tests/README.md), the 4-rank one in the suite.
TRAINED = [
    pytest.param(world, name, marks=pytest.mark.extended) if world == 8 else (world, name)
    for world, cases in CASES.items() for name in cases if "sequence" not in name
]


@lru_cache(maxsize=None)
def world(world_size: int):
    return launch(run_3d_cases, world_size, CASES[world_size])


def records(world_size: int, name: str):
    by_rank = [ranks[name] for ranks in world(world_size)]
    if "error" in by_rank[0]:
        pytest.fail(by_rank[0]["error"])
    return [rank["on"] for rank in by_rank]


@pytest.mark.parametrize("world_size,name", TRAINED)
def test_every_bucket_matches_the_unsharded_reference(world_size, name):
    record = records(world_size, name)[0]
    tolerance = TOLERANCE[CASES[world_size][name].get("dtype", "fp32")]
    assert len(record["measured"]) == len(record["reference"]) == 2
    assert [measured["step"] for measured in record["measured"]] == [1, 2]
    for measured, reference in zip(record["measured"], record["reference"]):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, tolerance)


@pytest.mark.parametrize("world_size,name", TRAINED)
def test_ranks_agree_norms_add_up_and_clipping_applies_one_factor(world_size, name):
    by_rank = records(world_size, name)
    assert len(by_rank) == world_size
    assert all(repr(record["measured"]) == repr(by_rank[0]["measured"]) for record in by_rank)
    assert len(by_rank[0]["measured"]) == len(by_rank[0]["global_norm"]) == 2
    clipped = checked = 0
    for measured, global_norm in zip(by_rank[0]["measured"], by_rank[0]["global_norm"]):
        combined = math.sqrt(sum(stats["norm"]**2 for stats in measured["pre_clip"].values()))
        assert combined == pytest.approx(global_norm, rel=1e-5)
        assert measured["clip_coef"] == pytest.approx(min(1.0, 0.05 / (global_norm + 1e-6)), rel=1e-6)
        if CASES[world_size][name].get("dtype", "fp32") == "fp32":  # SGD lr 1: the fp32 weights' change
            index = measured["step"] - 1
            assert_matches_applied(measured["post_clip"], by_rank[0]["applied"][index],
                                   by_rank[0]["weights_before"][index], APPLIED_TOLERANCE)
            checked += 1
        clipped += measured["clip_coef"] < 1
    assert clipped == 2, "the clip value 0.05 should clip both steps"
    assert checked == (2 if CASES[world_size][name].get("dtype", "fp32") == "fp32" else 0)


@pytest.mark.parametrize("world_size,name", TRAINED)
def test_bf16_cases_use_bf16_optimizer(world_size, name):
    expected = "BF16_Optimizer" if CASES[world_size][name].get("dtype") == "bf16" else "DeepSpeedZeroOptimizer"
    assert records(world_size, name)[0]["optimizer"] == expected


def test_four_cases_are_trained():
    assert len(TRAINED) == 4


def test_megatron_sequence_parallel_is_refused_at_initialize():
    for rank in world(4):
        assert "--sequence-parallel" in rank["tp2_dp2_sequence_parallel"].get("message", "")
