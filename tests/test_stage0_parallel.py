"""Per-layer statistics under pipeline and tensor parallelism without ZeRO (stage 0, fp32).

Each rank's ``.grad`` is its stage's or shard's complete gradient, averaged over data parallelism; the
tables are summed over the model-parallel group (one data-parallel replica). PP 2 with a tied embedding
and TP 2 on 2 ranks, PP 2 x DP 2 on 4; the references are the unsharded models in plain PyTorch. The
applied clip factor is checked against the step SGD (lr 1) really took: DeepSpeed clips by its own
model-parallel norm, which under a pipeline is not the whole model's.
"""

import math
from functools import lru_cache

import pytest
from parallel3d_workers import run_3d_cases
from stage0_workers import TP_CASE, run_two_ranks

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats

PIPELINE_CASES = {"pp2_tied_clip": {"stage": 0, "tie": True, "clip": 0.1, "first_layer_index": 3}}
PIPELINE_DP_CASES = {"pp2_dp2_clip": {"stage": 0, "pp": 2, "tp": 1, "dp": 2}}
TP_CLIP, STEPS = 0.5, 3


@lru_cache(maxsize=None)
def two_ranks():
    return launch(run_two_ranks, 2, PIPELINE_CASES, TP_CLIP, STEPS)


@lru_cache(maxsize=None)
def four_ranks():
    return launch(run_3d_cases, 4, PIPELINE_DP_CASES)


def records(ranks, name):
    """The case's record on every rank; a rank's error fails the test."""
    by_rank = [rank[name] for rank in ranks]
    for rank in by_rank:
        if "error" in rank:
            pytest.fail(rank["error"])
    return [rank.get("on", rank) for rank in by_rank]


def every_step(record, steps: int) -> list:
    """(measured, reference) of each step, all of them: a step without its own result fails."""
    assert [measured["step"] for measured in record["measured"]] == list(range(1, steps + 1))
    assert len(record["reference"]) == steps
    return list(zip(record["measured"], record["reference"]))


def total(stats: dict) -> float:
    return math.sqrt(sum(bucket["norm"]**2 for bucket in stats.values()))


def test_pipeline_layers_and_tied_embedding_match_the_plain_module():
    first, second = records(two_ranks(), "pp2_tied_clip")
    assert repr(first["measured"]) == repr(second["measured"])
    checked = 0
    for measured, reference in every_step(first, STEPS):
        assert sorted(key for key in measured["pre_clip"] if isinstance(key, int)) == list(range(4))
        assert_close_stats(measured["pre_clip"], {k: v for k, v in reference.items() if isinstance(k, int)},
                           TOLERANCE["fp32"])
        expected = math.sqrt(reference["embed"]["norm"]**2 + reference["pos_embed"]["norm"]**2)
        assert measured["pre_clip"]["embed"]["norm"] == pytest.approx(expected, rel=TOLERANCE["fp32"])
        checked += 1
    assert checked == STEPS


@pytest.mark.parametrize("name", ["pp2_tied_clip", TP_CASE])
def test_post_clip_is_the_step_deepspeed_took(name):
    record = records(two_ranks(), name)[0]
    assert len(record["update"]) == STEPS
    coefficients = []
    for measured, update in zip(record["measured"], record["update"]):
        assert total(measured["post_clip"]) == pytest.approx(update, rel=1e-4)
        coefficients.append(measured["clip_coef"])
    assert min(coefficients) < 1, "the clip value should clip at least one step"


def test_tensor_parallel_matches_the_unsharded_reference():
    first, second = records(two_ranks(), TP_CASE)
    assert repr(first["measured"]) == repr(second["measured"])
    checked = 0
    for measured, reference in every_step(first, STEPS):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE["fp32"])
        checked += 1
    assert checked == STEPS


def test_pipeline_with_data_parallelism_counts_each_replica_once():
    ranks = records(four_ranks(), "pp2_dp2_clip")
    assert len({repr(rank["measured"]) for rank in ranks}) == 1 and len(ranks) == 4
    steps = PIPELINE_DP_CASES["pp2_dp2_clip"].get("steps", 2)
    checked = 0
    for measured, reference in every_step(ranks[0], steps):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE["fp32"])
        checked += 1
    assert checked == steps
