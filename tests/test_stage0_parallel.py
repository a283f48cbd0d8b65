"""Per-layer statistics under pipeline and tensor parallelism without ZeRO (stage 0): fp32, fp16 through
FP16_Optimizer and FP16_UnfusedOptimizer (with an overflow step), and bf16.

Each rank's gradient is its stage's or shard's complete gradient, averaged over data parallelism; the
tables are summed over the model-parallel group (one data-parallel replica). PP 2 (both spec offsets, a
tied embedding) and TP 2 on 2 ranks, PP 2 x DP 2 on 4 (all in the extended tier); the references are the unsharded
models in plain PyTorch. The applied clip factor is checked against the step SGD (lr 1) really took: DeepSpeed
clips by its own model-parallel norm, which under a pipeline is not the whole model's; in fp16 and bf16 the step
of the optimizer's fp32 master weights, bucket for bucket.
"""

import math
from functools import lru_cache

import pytest
import torch
from parallel3d_workers import run_3d_cases
from stage0_workers import TP_CASE, run_two_ranks

from deepspeed_patch.statistics.reduction import COLLECTIVES_PER_STEP
from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats, assert_matches_applied
from releases import STAGE0_LOSS_CARRIES_SCALE, bf16_without_zero

# fp16 clip values are small: from DeepSpeed 0.18 on, the fp16 optimizers without ZeRO clip by the norm
# divided by the loss scale (the engine no longer scales the loss there, the optimizer still unscales).
FP16_CLIP = 1e-3
PIPELINE_CASES = {
    "pp2_tied_clip": {"stage": 0, "tie": True, "clip": 0.1, "first_layer_index": 3, "compare_off": True},
    "pp2_fp16_fused_tied_overflow_clip": {"stage": 0, "dtype": "fp16", "fused": True, "tie": True, "clip": FP16_CLIP,
                                          "overflow_step": 2, "steps": 4, "compare_off": True},
    "pp2_fp16_unfused_overflow_offset2": {"stage": 0, "dtype": "fp16", "overflow_step": 2, "first_layer_index": 2},
    "pp2_bf16_clip_offset2": {"stage": 0, "dtype": "bf16", "clip": 0.1, "first_layer_index": 2},
}
# The 3D workers' model (column/row-parallel MLP layers) on 2 ranks: tensor parallel 2 without ZeRO.
PARALLEL_CASES = {
    "tp2_fp16_fused_overflow_clip": {"stage": 0, "pp": 1, "tp": 2, "dp": 1, "dtype": "fp16", "fused": True,
                                     "clip": FP16_CLIP, "overflow_step": 2, "steps": 3, "compare_off": True},
    "tp2_bf16_clip": {"stage": 0, "pp": 1, "tp": 2, "dp": 1, "dtype": "bf16"},
}
PIPELINE_DP_CASES = {
    "pp2_dp2_clip": {"stage": 0, "pp": 2, "tp": 1, "dp": 2},
    "pp2_dp2_fp16_overflow_clip": {"stage": 0, "pp": 2, "tp": 1, "dp": 2, "dtype": "fp16", "clip": FP16_CLIP,
                                   "overflow_step": 2, "steps": 3},
}
TP_CLIP, STEPS = 0.5, 3
# CI's extended pass (14 s, tests/README.md): the suite keeps PP 2 x DP 2 and TP 2 x DP 2 under ZeRO-1
# (test_parallel3d.py) and stage 0 without model parallelism, fp16 and fp32, at 1, 2 and 3 ranks (test_zero_stats.py)
pytestmark = pytest.mark.extended
LOW_PRECISION = [
    name for cases in (PIPELINE_CASES, PARALLEL_CASES, PIPELINE_DP_CASES) for name, case in cases.items()
    if case.get("dtype", "fp32") != "fp32"
]


@lru_cache(maxsize=None)
def two_ranks():
    return launch(run_two_ranks, 2, PIPELINE_CASES, PARALLEL_CASES, TP_CLIP, STEPS)


@lru_cache(maxsize=None)
def four_ranks():
    return launch(run_3d_cases, 4, PIPELINE_DP_CASES)


def results(name):
    """The case's result on every rank (its record under "on", the feature-off run's under "off", and the
    case); a rank's error fails the test."""
    by_rank = [rank[name] for rank in (four_ranks() if name in PIPELINE_DP_CASES else two_ranks())]
    for rank in by_rank:
        if "error" in rank:
            pytest.fail(rank["error"])
    return by_rank


def records(name):
    """The case's record (with the feature on) on every rank."""
    return [rank.get("on", rank) for rank in results(name)]


def every_step(record, steps: int) -> list:
    """(measured, reference) of each step, all of them: a step without its own result fails."""
    assert [measured["step"] for measured in record["measured"]] == list(range(1, steps + 1))
    assert len(record["reference"]) == steps
    return list(zip(record["measured"], record["reference"]))


def total(stats: dict) -> float:
    return math.sqrt(sum(bucket["norm"]**2 for bucket in stats.values()))


def test_pipeline_layers_and_tied_embedding_match_the_plain_module():
    first, second = records("pp2_tied_clip")
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
    record = records(name)[0]
    assert len(record["update"]) == STEPS
    coefficients = []
    for measured, update in zip(record["measured"], record["update"]):
        assert total(measured["post_clip"]) == pytest.approx(update, rel=1e-4)
        coefficients.append(measured["clip_coef"])
    assert min(coefficients) < 1, "the clip value should clip at least one step"


def test_tensor_parallel_matches_the_unsharded_reference():
    first, second = records(TP_CASE)
    assert repr(first["measured"]) == repr(second["measured"])
    checked = 0
    for measured, reference in every_step(first, STEPS):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE["fp32"])
        checked += 1
    assert checked == STEPS


def test_pipeline_with_data_parallelism_counts_each_replica_once():
    ranks = records("pp2_dp2_clip")
    assert len({repr(rank["measured"]) for rank in ranks}) == 1 and len(ranks) == 4
    steps = PIPELINE_DP_CASES["pp2_dp2_clip"].get("steps", 2)
    checked = 0
    for measured, reference in every_step(ranks[0], steps):
        assert set(measured["pre_clip"]) == set(reference)
        assert_close_stats(measured["pre_clip"], reference, TOLERANCE["fp32"])
        checked += 1
    assert checked == steps


def intended_optimizer(case: dict) -> str:
    """The optimizer DeepSpeed runs a low-precision stage-0 case with (engine._do_optimizer_sanity_check)."""
    if case["dtype"] == "fp16":
        return "FP16_Optimizer" if case.get("fused") else "FP16_UnfusedOptimizer"
    return "BF16_Optimizer" if case.get("pp", 2) > 1 else bf16_without_zero(fused=False)


def reported_keys(case: dict, reference: dict) -> set:
    """The reference buckets the comparison covers: all of them in the 3D workers' model (named as the
    engine names them); the layers in the tiny GPT's pipeline, whose embedding buckets the fp32 test covers."""
    if "pp" in case:
        return set(reference)
    return {key for key in reference if isinstance(key, int)}


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_matches_the_reference_and_reports_the_overflow(name):
    """Every step: an overflow step non-finite in every layer and not clipped, the others exact against the
    unsharded reference in the same precision; the same result on every rank; the intended optimizer."""
    by_rank = results(name)
    record, case = by_rank[0]["on"], by_rank[0]["case"]
    assert record["optimizer"] == intended_optimizer(case)
    assert len({repr(rank["on"]["measured"]) for rank in by_rank}) == 1  # repr: NaNs compare equal
    checked = 0
    for measured, reference in every_step(record, case["steps"]):
        keys = reported_keys(case, reference)
        if measured["step"] == case["overflow_step"]:
            assert measured["overflow"] is True and measured["post_clip"] is None
            layers = [key for key in measured["pre_clip"] if isinstance(key, int)]
            assert len(layers) == len([key for key in reference if isinstance(key, int)]) > 0
            assert all(measured["pre_clip"][key]["nonfinite"] > 0 for key in layers)
        else:
            assert measured["overflow"] is False
            assert_close_stats(measured["pre_clip"], {key: reference[key] for key in keys}, TOLERANCE[case["dtype"]])
        checked += 1
    assert checked == case["steps"] and (case["overflow_step"] or 0) <= case["steps"]


APPLIED_TOLERANCE = 1e-3
"""Relative, of the optimizer's fp32 master weights' change (SGD, lr 1) to the gradient it applied; the elements
are off by the weights' fp32 rounding besides (``reference.assert_matches_applied``)."""
BF16_GRADIENT_ROUNDING = {"BF16_Optimizer": torch.finfo(torch.bfloat16).eps / 2}
"""Of an element to its bucket's largest: BF16_Optimizer keeps the gradient in its accumulation dtype, bf16 here
(no ``grad_accum_dtype`` without ZeRO), and clips it there in place (``clip_tensors_by_global_norm``), so the step
it takes is the clipped gradient rounded to bf16, while post_clip is the exact product (measured: up to 3e-3 of
abs_max in min and max, 2e-4 in the norm)."""


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_low_precision_clip_coefficient_is_the_optimizers(name):
    """The coefficient the fp16/bf16 optimizer applies: its clip factor from the whole model's norm, times
    old/new loss scale (the scale is updated before it unscales), and in DeepSpeed 0.18 and later, where
    the engine leaves the loss unscaled without ZeRO, 1/new scale: against that formula at the reference's
    precision, and against the step the optimizer took. SGD with lr 1 moves the fp32 master weights by the
    gradient it applied, clipped and unscaled: the whole change over the measured pre_clip is clip_coef, and
    each bucket's change is its post_clip."""
    by_rank = results(name)
    record, case = by_rank[0]["on"], by_rank[0]["case"]
    clip_factors = []
    for (measured, reference), (old_scale, new_scale), applied in zip(every_step(record, case["steps"]),
                                                                      record["loss_scales"], record["applied_master"]):
        if measured["overflow"]:
            continue
        old_scale = old_scale if STAGE0_LOSS_CARRIES_SCALE else 1.0
        norm = total(reference) * old_scale / new_scale
        clip_factor = max(1.0, (norm + 1e-6) / case["clip"]) if case.get("clip") else 1.0
        clip_factors.append(clip_factor)
        assert measured["clip_coef"] == pytest.approx(old_scale / (new_scale * clip_factor),
                                                      rel=10 * TOLERANCE[case["dtype"]])
        assert total(applied) / total(measured["pre_clip"]) == pytest.approx(measured["clip_coef"],
                                                                             rel=APPLIED_TOLERANCE)
        assert_matches_applied(measured["post_clip"], {key: applied[key] for key in reported_keys(case, applied)},
                               record["master_before"][measured["step"] - 1], APPLIED_TOLERANCE,
                               elementwise=max(APPLIED_TOLERANCE, BF16_GRADIENT_ROUNDING.get(record["optimizer"], 0)))
    assert len(clip_factors) == case["steps"] - (case["overflow_step"] is not None)
    assert max(clip_factors) > 1 or not case.get("clip"), "the clip value should clip at least one step"


def test_bf16_pipeline_buckets_add_up_to_the_global_norm():
    """BF16_Optimizer keeps the whole model's norm (DeepSpeed's own reduction): the buckets add up to it."""
    record = results("pp2_bf16_clip_offset2")[0]["on"]
    assert len(record["measured"]) == len(record["global_norm"]) == 3
    for measured, norm in zip(record["measured"], record["global_norm"]):
        assert total(measured["pre_clip"]) == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("name", [name for cases in (PIPELINE_CASES, PARALLEL_CASES)
                                  for name, case in cases.items() if case.get("compare_off")])
def test_training_is_bit_identical_with_the_feature_off(name):
    for rank in results(name):
        on, off = rank["on"], rank["off"]
        assert off["measured"] == [None] * rank["case"]["steps"]
        assert off["loss_scales"] == on["loss_scales"]
        pairs = list(on["final"].items()) if isinstance(on["final"], dict) else list(enumerate(on["final"]))
        assert len(pairs) > 0
        for key, value in pairs:
            assert torch.equal(value, off["final"][key]), key


@pytest.mark.parametrize("name", ["pp2_tied_clip", "pp2_fp16_fused_tied_overflow_clip"])
def test_a_measured_step_adds_two_collectives(name):
    """What the statistics add to a pipeline's step without ZeRO: their reduction's two all-reduces, clipping
    by DeepSpeed's own model-parallel norm included (its share rides in the same SUM)."""
    for rank in results(name):
        on, off = rank["on"]["collectives"], rank["off"]["collectives"]
        assert len(on) == len(off) == rank["case"]["steps"]
        assert [count_on - count_off for count_on, count_off in zip(on, off)] == [COLLECTIVES_PER_STEP] * len(on)
