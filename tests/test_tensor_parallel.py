"""Per-layer statistics under tensor parallelism (TP=2 on 2 CPU ranks, Megatron-style mpu).

Column-parallel shards count on every TP rank, replicated parameters (layer norms, the row-parallel
bias, embedding, head) once; the reference is the unsharded model rebuilt from both ranks' shards.
"""

import math
from functools import lru_cache

import pytest

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats
from tp_workers import run_tensor_parallel

STEPS = 3


@lru_cache(maxsize=None)
def tp2():
    return launch(run_tensor_parallel, 2, 0.5, STEPS)


def every_step(record) -> list:
    """(measured, reference, global norm) of each step, all of them: a step without its own result fails."""
    assert [measured["step"] for measured in record["measured"]] == list(range(1, STEPS + 1))
    assert len(record["reference"]) == len(record["global_norm"]) == STEPS
    return list(zip(record["measured"], record["reference"], record["global_norm"]))


def test_every_bucket_matches_the_unsharded_reference():
    record = tp2()[0]
    for measured, reference, _ in every_step(record):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE["fp32"])


def test_norms_add_up_to_global_norm_and_tensor_parallel_ranks_agree():
    first, second = tp2()
    assert repr(first["measured"]) == repr(second["measured"])
    for measured, _, global_norm in every_step(first):
        combined = math.sqrt(sum(stats["norm"]**2 for stats in measured["pre_clip"].values()))
        assert combined == pytest.approx(global_norm, rel=1e-5)


def test_clipping_applies_one_factor():
    record = tp2()[0]
    clipped = [measured for measured, _, _ in every_step(record) if measured["clip_coef"] < 1]
    assert clipped, "the clip value should clip at least one step"
    for measured in clipped:
        assert set(measured["post_clip"]) == set(measured["pre_clip"]) and measured["pre_clip"]
        for key, stats in measured["pre_clip"].items():
            assert measured["post_clip"][key]["norm"] == pytest.approx(stats["norm"] * measured["clip_coef"])
