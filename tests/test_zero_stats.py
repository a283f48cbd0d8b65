"""Per-layer statistics from ZeRO-1/2 against a plain-PyTorch reference, on 1, 2 and 3 CPU ranks.

One launch per world size runs all of that world's cases; each test below checks one property of
one case. See zero_workers.py for what a case trains and records. With CASES_ENV set, only the cases it
names run; the tests of the others are reported skipped.
"""

import math
import os
from functools import lru_cache
from typing import Callable, Dict, Hashable, List, Optional, Set, Tuple

import pytest
import torch

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats, reference_bucket, reference_key_of
from releases import (
    BF16_OPTIMIZER_DATA_PARALLEL_WRONG,
    NONCONTIGUOUS_GRADIENT_WRONG,
    RELEASE,
    STAGE0_LOSS_CARRIES_SCALE,
    bf16_without_zero,
)
from zero_workers import CASES_ENV, DEFAULT_CASE, FAMILY_CASES, run_cases

OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
ALL_EXTRA = ["l1", "mean", "zeros", "numel"]
FC2 = r"layers\.(\d+)\.(dense_4h_to_h)\."  # per-layer buckets of the MLP's second weight, as in NormFormer

CASES = {
    1: {
        "z1_fp32_clip": {"stage": 1, "clip": 0.1, "compare_off": True},
        "z0_fp32_clip": {"stage": 0, "clip": 0.1, "compare_off": True},
        "z0_fp32_group_by_clip": {"stage": 0, "clip": 0.05, "block": {"granularity": "group_by", "group_by": FC2}},
        "z0_fp32_param_clip": {"stage": 0, "clip": 0.05, "block": {"granularity": "param"}},
        "z2_fp32_group_by_clip": {"stage": 2, "clip": 0.05, "block": {"granularity": "group_by", "group_by": FC2}},
        "z0_bf16_unfused": {"stage": 0, "dtype": "bf16", "clip": 0.1},
        "z2_bf16_gas2": {"stage": 2, "dtype": "bf16", "gas": 2},
        "z2_fp16_overflow": {"stage": 2, "dtype": "fp16", "overflow_step": 2, "compare_off": True},
        "z0_fp16_fused_overflow": {"stage": 0, "dtype": "fp16", "fused": True, "overflow_step": 2,
                                   "compare_off": True},
    },
    2: {
        "z1_fp32": {"stage": 1},
        "z0_fp32_gas2_clip_groups": {"stage": 0, "gas": 2, "clip": 0.2, "groups": True, "compare_off": True},
        "z0_fp16_unfused_overflow_clip": {"stage": 0, "dtype": "fp16", "overflow_step": 2, "clip": 0.1,
                                          "groups": True, "compare_off": True},
        "z0_fp16_fused_gas2_clip_groups": {"stage": 0, "dtype": "fp16", "fused": True, "gas": 2, "clip": 0.1,
                                           "groups": True, "compare_off": True},
        "z0_bf16_fused_clip": {"stage": 0, "dtype": "bf16", "fused": True, "clip": 0.1},
        "z2_fp32_clip_groups": {"stage": 2, "clip": 0.1, "groups": True, "compare_off": True},
        "z1_fp32_gas3_clip": {"stage": 1, "gas": 3, "clip": 0.2},
        "z2_bf16_clip": {"stage": 2, "dtype": "bf16", "clip": 0.1, "compare_off": True},
        "z1_bf16_bf16accum": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "bf16"},
        "z1_bf16_optimizer_clip_gas2": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", "gas": 2,
                                        "clip": 0.1, "compare_off": True},
        "z2_bf16_fp32accum_gas2": {"stage": 2, "dtype": "bf16", "grad_accum_dtype": "fp32", "gas": 2, "clip": 0.1},
        "z1_fp16_overflow_gas2": {"stage": 1, "dtype": "fp16", "gas": 2, "overflow_step": 2, "clip": 0.1},
        "z2_fp16_clip": {"stage": 2, "dtype": "fp16", "clip": 0.1, "compare_off": True},
        "z2_small_reduce_buckets_overlap": {"stage": 2, "zero": {"reduce_bucket_size": 300, "overlap_comm": True}},
        "z2_noncontiguous": {"stage": 2, "zero": {"contiguous_gradients": False, "overlap_comm": False}},
        "z1_overlap_noncontiguous": {"stage": 1, "zero": {"contiguous_gradients": False, "overlap_comm": True}},
        "z2_frozen_tied": {"stage": 2, "tie": True, "frozen": ("layers.1.dense.weight", "layers.2.dense_h_to_4h.bias"),
                           "compare_off": True},
        "z2_offload_clip": {"stage": 2, "clip": 0.1, "zero": OFFLOAD, "top": {"zero_force_ds_cpu_optimizer": False}},
        "z1_offload_fp16_overflow": {"stage": 1, "dtype": "fp16", "overflow_step": 2, "zero": OFFLOAD,
                                     "top": {"zero_force_ds_cpu_optimizer": False}, "compare_off": True},
        "z2_offload_fp16_overflow_clip": {"stage": 2, "dtype": "fp16", "overflow_step": 2, "clip": 0.1,
                                          "zero": OFFLOAD, "top": {"zero_force_ds_cpu_optimizer": False},
                                          "compare_off": True},
        "z2_param_granularity_extras": {"stage": 2, "clip": 0.1,
                                        "block": {"granularity": "param", "statistics": ALL_EXTRA}},
        "z2_interval2_selection": {"stage": 2, "steps": 4, "block": {"interval": 2, "layers": "0,mid,-1"}},
    },
    3: {
        "z1_fp32_groups_clip": {"stage": 1, "groups": True, "clip": 0.1, "layers": 5},
        "z2_fp32_gas2": {"stage": 2, "gas": 2, "layers": 5, "compare_off": True},
        "z2_bf16": {"stage": 2, "dtype": "bf16", "layers": 5},
        "z1_fp16_overflow": {"stage": 1, "dtype": "fp16", "overflow_step": 2, "layers": 5},
        "z2_round_robin": {"stage": 2, "layers": 5, "zero": {"round_robin_gradients": True}},
        "z1_group_by_fc2_selection": {"stage": 1, "layers": 5, "groups": True, "clip": 0.05,
                                      "block": {"granularity": "group_by", "group_by": FC2, "layers": "0,-1",
                                                "statistics": ["l1", "zeros"]}},
        "z2_param_granularity_mid": {"stage": 2, "layers": 5, "clip": 0.05,
                                     "block": {"granularity": "param", "layers": "mid"}},
        "z1_bf16_optimizer_groups": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", "layers": 5,
                                     "groups": True},
    },
}


def chosen_cases(names: Optional[str]) -> Set[str]:
    """The names of the cases to run: the comma-separated ``names``, or all when None. An unknown name is an
    error."""
    every = {name for cases in CASES.values() for name in cases}
    if names is None:
        return every
    unknown = set(names.split(",")) - every
    if unknown:
        raise ValueError(f"{CASES_ENV}={names!r}: no case named {sorted(unknown)}")
    return set(names.split(","))


CHOSEN = chosen_cases(os.environ.get(CASES_ENV))


def cases_where(keep: Callable[[int, dict], bool] = lambda world, case: True) -> list:
    """``(world size, name)`` parameters of the cases ``keep(world, case)`` accepts; those not chosen are
    marked skipped, with the reason."""

    def not_chosen(name: str) -> list:
        return [] if name in CHOSEN else [pytest.mark.skip(reason=f"{name} is not among {CASES_ENV}")]

    return [pytest.param(world, name, marks=not_chosen(name))
            for world, cases in CASES.items() for name, case in cases.items() if keep(world, {**DEFAULT_CASE, **case})]


ALL_CASES = cases_where()


@lru_cache(maxsize=None)
def results_of(world_size: int):
    return launch(run_cases, world_size, {name: case for name, case in CASES[world_size].items() if name in CHOSEN})


def case_result(world_size: int, name: str):
    """Rank 0's record of the case, and every rank's."""
    if name not in CHOSEN:
        pytest.skip(f"{name} is not among {CASES_ENV}")
    by_rank = [ranks[name] for ranks in results_of(world_size)]
    if "error" in by_rank[0]:
        pytest.fail(by_rank[0]["error"])
    assert len(by_rank) == world_size
    return by_rank[0], by_rank


def scheduled_steps(case: dict) -> List[int]:
    """The optimizer steps the block's ``interval`` measures (every interval-th step, counted from 1)."""
    interval = case["block"].get("interval", 1)
    return [step for step in range(1, case["steps"] + 1) if step % interval == 0]


def measured_steps(record) -> List[Tuple[int, dict, dict]]:
    """(step index, measured dict, reference) for each measured step without an overflow, all of them.

    Every step's record must be what the case's configuration says: that step's result on a scheduled step,
    an overflow exactly on the case's ``overflow_step``, the last result (or None) in between. A step that
    does not match fails the test instead of being left out, so the list holds exactly the scheduled steps
    less the overflow step, and at least one.
    """
    case, on = record["case"], record["on"]
    assert len(on["measured"]) == len(on["reference"]) == case["steps"]
    scheduled = scheduled_steps(case)
    checked, last = [], None
    for index, (measured, reference) in enumerate(zip(on["measured"], on["reference"])):
        step = index + 1
        if step not in scheduled:
            assert (measured is None) if last is None else (measured["step"] == last), f"step {step}: {measured}"
            continue
        if measured is None or measured["step"] != step:
            pytest.fail(f"step {step} was scheduled, yet the result is {measured}")
        assert measured["overflow"] == (step == case["overflow_step"]), f"step {step}: overflow {measured['overflow']}"
        last = step
        if not measured["overflow"]:
            checked.append((index, measured, reference))
    assert len(checked) == len([step for step in scheduled if step != case["overflow_step"]]) >= 1
    return checked


def layers_selected(case: dict) -> Set[int]:
    """The transformer layers the block's ``layers`` reports, by the documented rule: ``mid`` is L // 2,
    negative indices count from the end."""
    layers = case["block"].get("layers", "all")
    if layers == "all":
        return set(range(case["layers"]))
    items = layers.split(",") if isinstance(layers, str) else layers
    return {case["layers"] // 2 if item == "mid" else int(item) % case["layers"] for item in items}


def layer_of_key(record) -> Dict[Hashable, Optional[int]]:
    """Each bucket key of the case's granularity -> the transformer layer of its parameters (None outside)."""
    key_of = reference_key_of(record["case"]["block"])
    layers = {}
    for name in record["on"]["final"]:
        layer = reference_bucket(name)
        if key_of(name) is not None:
            layers[key_of(name)] = layer if isinstance(layer, int) else None
    return layers


def expected_keys(record, index: int) -> Set[Hashable]:
    """The buckets step ``index`` must report: the reference's, less the layers the selection leaves out."""
    selected, layer_of = layers_selected(record["case"]), layer_of_key(record)
    keys = {key for key in record["on"]["reference"][index] if layer_of[key] is None or layer_of[key] in selected}
    assert keys
    return keys


def expect_bf16_optimizer_bug(request, world_size: int, name: str) -> None:
    """Where this release's BF16_Optimizer steps on a gradient other than the ranks' average (releases.py)."""
    if BF16_OPTIMIZER_DATA_PARALLEL_WRONG and world_size > 1 and "bf16_optimizer" in name:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"DeepSpeed {RELEASE}'s BF16_Optimizer steps on a "
                                              "gradient that is not the ranks' average, with a global norm per rank"))


def fp16_subnormal_step(record: dict, index: int) -> float:
    """The absolute rounding of step ``index``'s fp16 gradient at its smallest values once unscaled (0 in other
    dtypes): below fp16's smallest normal number its elements are multiples of 2**-24, whatever their own size,
    times the loss scale the gradient carries (none without ZeRO from DeepSpeed 0.18 on)."""
    case = record["case"]
    if case["dtype"] != "fp16":
        return 0.0
    carried = record["on"]["loss_scales"][index][0]
    if case["stage"] == 0 and not STAGE0_LOSS_CARRIES_SCALE:
        carried = 1.0
    return 2.0**-24 / carried


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_pre_clip_matches_reference(world_size, name, request):
    record, _ = case_result(world_size, name)
    case = record["case"]
    if case["zero"].get("contiguous_gradients") is False and NONCONTIGUOUS_GRADIENT_WRONG:
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"DeepSpeed {RELEASE} steps on a wrong embedding "
                                              "gradient without contiguous_gradients (post_clip shows it)"))
    expect_bf16_optimizer_bug(request, world_size, name)
    for index, measured, reference in measured_steps(record):
        assert set(measured["pre_clip"]) == expected_keys(record, index)
        selected = {key: reference[key] for key in measured["pre_clip"]}
        assert_close_stats(measured["pre_clip"], selected, TOLERANCE[case["dtype"]],
                           summed=world_size * case["gas"] > 1,
                           floor=fp16_subnormal_step(record, index))
        assert [stats["nonfinite"] for stats in measured["pre_clip"].values()] == [0] * len(selected)


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_post_clip_is_what_the_optimizer_applied(world_size, name):
    """With SGD at lr=1 the weight update is the clipped gradient; compare it to post_clip.

    DeepSpeed unscales with the loss scale already updated for the next step, so on a step where the
    dynamic scaler grows the scale, the optimizer gets the gradient times old/new scale. Without ZeRO,
    engine.backward does not scale the loss at all (DeepSpeed 0.18 and later), yet the fp16 optimizer
    divides by the scale: the optimizer gets the gradient divided by it.
    """
    record, _ = case_result(world_size, name)
    case = record["case"]
    for index, measured, _ in measured_steps(record):
        old_scale, new_scale = record["on"]["loss_scales"][index]
        if case["stage"] == 0 and not STAGE0_LOSS_CARRIES_SCALE:
            old_scale = 1.0  # what the gradient really carries
        total, rel = clipped_norm(record, index, old_scale, new_scale)
        clip_factor = max(1.0, (total + 1e-6) / case["clip"]) if case["clip"] > 0 else 1.0
        expected_coef = old_scale / (new_scale * clip_factor)
        assert measured["clip_coef"] == pytest.approx(expected_coef, rel=rel)
        assert set(measured["post_clip"]) == set(measured["pre_clip"]) == expected_keys(record, index)
        # A low-precision optimizer's fp32 weights show the gradient it consumed, clipped and unscaled: post_clip and
        # with it clip_coef, against what was applied (the model's bf16 weights are too coarse for it).
        # (fp16's own check is below: at stage 0 its smallest updates drown in the fp32 weights' rounding too).
        if case["dtype"] == "bf16":
            master = record["on"]["applied_master"][index]
            assert_close_stats(measured["post_clip"], master, 1e-3, stats=("norm", "min", "max", "abs_max"))
        applied = {key: stats for key, stats in record["on"]["applied"][index].items() if key in measured["post_clip"]}
        assert set(applied) == set(measured["post_clip"])
        # The update is read off the model's weights: exact enough in fp32; in fp16 good to a few
        # percent for the small weights of the transformer layers (enough to see the halving on a
        # scale-growth step), not for the embeddings (weights near 1, updates near 1e-4); bf16
        # weights are too coarse for it. abs_min is left out: the smallest updates drown in rounding.
        if case["dtype"] == "fp32":
            assert_close_stats(measured["post_clip"], applied, 1e-3, stats=("norm", "min", "max", "abs_max"))
        if case["dtype"] == "fp16" and case["stage"] > 0:  # stage 0 fp16 updates are below the weights' ulp
            layers = {key: stats for key, stats in applied.items() if layer_of_key(record)[key] is not None}
            assert_close_stats(measured["post_clip"], layers, 3e-2, stats=("norm", ))


FLOAT_ROUNDING = 1e-6
"""The optimizers compute their clip factor in float32 tensors; recomputed here in float64 from the same norm."""


def clipped_norm(record, index: int, old_scale: float, new_scale: float) -> Tuple[float, float]:
    """The norm the optimizer compared with ``gradient_clipping`` at step ``index`` (its scaled norm over the
    scale it unscales with, as its ``unscale_and_clip_grads`` does), from the global norm it reported, and the
    tolerance of the clip factor made from it: float rounding. An optimizer that reports none (a torch
    optimizer without ZeRO, clipped by the engine) gets the reference's norm, at the reference's tolerance."""
    reported = record["on"]["global_norm"][index]
    optimizer = record["on"]["optimizer"]
    if reported is None or optimizer not in REPORTED_NORM:
        every_parameter = record["on"]["layer_reference"][index].values()  # clipping is over all of them
        total = math.sqrt(sum(ref["norm"]**2 for ref in every_parameter)) * old_scale / new_scale
        return total, TOLERANCE[record["case"]["dtype"]]
    return REPORTED_NORM[optimizer](float(reported), old_scale, new_scale), FLOAT_ROUNDING


REPORTED_NORM: Dict[str, Callable[[float, float, float], float]] = {
    # DeepSpeed 0.19.8: ZeRO-1/2 report scaled / old scale and clip by scaled / new scale (stage_1_and_2.py);
    # FP16_Optimizer reports and clips by scaled / new scale; FP16_UnfusedOptimizer reports the scaled norm and
    # clips by it / new scale; BF16_Optimizer has no scale.
    "DeepSpeedZeroOptimizer": lambda norm, old, new: norm * old / new,
    "FP16_Optimizer": lambda norm, old, new: norm,
    "FP16_UnfusedOptimizer": lambda norm, old, new: norm / new,
    "BF16_Optimizer": lambda norm, old, new: norm,
}


GRANULAR_CLIP_CASES = [(1, "z0_fp32_group_by_clip"), (1, "z0_fp32_param_clip"), (1, "z2_fp32_group_by_clip"),
                       (2, "z2_param_granularity_extras"), (3, "z1_group_by_fc2_selection"),
                       (3, "z2_param_granularity_mid")]


@pytest.mark.parametrize("world_size,name", GRANULAR_CLIP_CASES)
def test_granular_buckets_clip_by_the_norm_of_every_parameter(world_size, name):
    """With group_by (some parameters reported) or param buckets, clipping is active and clip_coef is
    clip / the norm of every parameter's gradient, not of the reported buckets only."""
    record, _ = case_result(world_size, name)
    case = record["case"]
    checked = 0
    for index, measured, _ in measured_steps(record):
        total = math.sqrt(sum(ref["norm"]**2 for ref in record["on"]["layer_reference"][index].values()))
        assert case["clip"] / total < 0.9  # clipping is active
        assert measured["clip_coef"] == pytest.approx(case["clip"] / (total + 1e-6), rel=1e-5)
        checked += 1
    assert checked == case["steps"]


def covers_all_parameters(case) -> bool:
    """Every parameter reported, and a global norm to compare with (DeepSpeed reports none without ZeRO)."""
    block = case.get("block", {})
    return "layers" not in block and block.get("granularity") != "group_by" and case.get("stage") != 0


@pytest.mark.parametrize("world_size,name", cases_where(lambda world, case: covers_all_parameters(case)))
def test_bucket_norms_add_up_to_global_norm(world_size, name, request):
    expect_bf16_optimizer_bug(request, world_size, name)
    record, _ = case_result(world_size, name)
    for index, measured, _ in measured_steps(record):
        combined = math.sqrt(sum(stats["norm"]**2 for stats in measured["pre_clip"].values()))
        assert combined == pytest.approx(float(record["on"]["global_norm"][index]), rel=1e-5)


@pytest.mark.parametrize("world_size,name", cases_where(lambda world, case: world > 1))
def test_identical_on_every_rank(world_size, name, request):
    if CASES[world_size][name].get("clip"):  # each rank's own clip factor (pre_clip agrees)
        expect_bf16_optimizer_bug(request, world_size, name)
    record, by_rank = case_result(world_size, name)
    assert measured_steps(record)  # every step as the case schedules it
    # repr, so that the NaNs of an overflow step compare equal
    others = [repr(rank["on"]["measured"]) for rank in by_rank[1:]]
    assert others == [repr(record["on"]["measured"])] * (world_size - 1)


@pytest.mark.parametrize("world_size,name",
                         cases_where(lambda world, case: case["compare_off"]))
def test_training_is_bit_identical_with_the_feature_off(world_size, name):
    assert_training_unchanged(case_result(world_size, name)[0])


def assert_training_unchanged(record) -> None:
    """The same losses and final weights with the feature off, and nothing measured."""
    case = record["case"]
    assert len(record["on"]["losses"]) == case["steps"] * case["gas"]
    assert record["off"]["losses"] == record["on"]["losses"]
    assert record["off"]["final"].keys() == record["on"]["final"].keys()
    for param_name, value in record["off"]["final"].items():
        assert torch.equal(value, record["on"]["final"][param_name]), param_name
    assert record["off"]["measured"] == [None] * case["steps"]


@pytest.mark.parametrize("world_size,name",
                         cases_where(lambda world, case: case["overflow_step"]))
def test_overflow_step_reports_nonfinite_layers(world_size, name):
    """Every transformer layer's bucket holds the infinities of the blown-up loss; a bucket's norm is
    non-finite exactly where it counts non-finite elements, and no more than it has; its min, max and
    abs_min are the reference's, whose loss is blown up the same way."""
    record, _ = case_result(world_size, name)
    step = record["case"]["overflow_step"]
    measured, reference = record["on"]["measured"][step - 1], record["on"]["reference"][step - 1]
    assert measured["step"] == step
    assert measured["overflow"] is True
    assert measured["post_clip"] is None and measured["clip_coef"] is None
    assert set(measured["pre_clip"]) == expected_keys(record, step - 1)
    layers = [key for key in measured["pre_clip"] if layer_of_key(record)[key] is not None]
    assert len(layers) == len(layers_selected(record["case"]))
    assert all(measured["pre_clip"][key]["nonfinite"] > 0 for key in layers)
    checked = 0
    for key, stats in measured["pre_clip"].items():
        assert stats["nonfinite"] <= reference[key]["numel"]
        assert math.isfinite(stats["norm"]) == (stats["nonfinite"] == 0), key
        for stat in ("min", "max", "abs_min"):
            assert_same_value(stats[stat], reference[key][stat], TOLERANCE[record["case"]["dtype"]], (key, stat))
            checked += 1
    assert checked == 3 * len(measured["pre_clip"])


def assert_same_value(measured: float, expected: float, tolerance: float, what) -> None:
    """NaN where the reference is NaN (a NaN element makes the bucket's min, max and abs_min NaN, as one
    rank's torch.aminmax does), the same infinity, and a finite value within ``tolerance`` of itself."""
    if math.isfinite(expected):
        assert abs(measured - expected) <= tolerance * abs(expected), (what, measured, expected)
    else:
        assert repr(measured) == repr(expected), (what, measured, expected)


def test_fp16_cases_cover_a_loss_scale_growth_step():
    """The old/new scale factor in post_clip is exercised, not only written down."""
    fp16 = [(world, name) for world, cases in CASES.items() for name, case in cases.items()
            if name in CHOSEN and case.get("dtype") == "fp16"]
    if not fp16:
        pytest.skip(f"no fp16 case among {CASES_ENV}")
    grown = 0
    for world_size, name in fp16:
        record, _ = case_result(world_size, name)
        scales = record["on"]["loss_scales"]
        grown += sum(scales[index][1] > scales[index][0] for index, _, _ in measured_steps(record))
    assert grown > 0


def test_interval_and_layer_selection():
    record, _ = case_result(2, "z2_interval2_selection")
    measured = record["on"]["measured"]
    assert measured[0] is None
    assert [m["step"] for m in measured[1:]] == [2, 2, 4]
    layer_keys = sorted(key for key in measured[1]["pre_clip"] if isinstance(key, int))
    assert layer_keys == [0, 2, 3]  # 0, mid = 4 // 2, -1 of a 4-layer model
    assert {"embed", "pos_embed", "final_layernorm", "head"} <= set(measured[1]["pre_clip"])


def test_frozen_parameters_excluded_and_tied_weight_counted_once():
    record, _ = case_result(2, "z2_frozen_tied")
    measured = record["on"]["measured"][-1]["pre_clip"]
    assert "head" not in measured  # tied to the embedding: one parameter, in the "embed" bucket
    assert record["on"]["reference"][-1].keys() == measured.keys()


def intended_optimizer(name: str, case: dict) -> str:
    """The optimizer class a case is meant to exercise, by its name and configuration."""
    if "bf16_optimizer" in name:
        return "BF16_Optimizer"
    if case["stage"] == 0 and case.get("dtype") == "bf16":
        return bf16_without_zero(fused=case.get("fused", False))
    return ("FP16_UnfusedOptimizer" if "unfused" in name else "FP16_Optimizer" if "fused" in name
            else "SGD" if case["stage"] == 0 else "DeepSpeedZeroOptimizer")


@pytest.mark.parametrize("world_size,name", ALL_CASES)
def test_each_case_exercises_the_intended_optimizer(world_size, name):
    record, _ = case_result(world_size, name)
    assert record["on"]["optimizer"] == intended_optimizer(name, CASES[world_size][name])


def test_family_cases_cover_every_optimizer():
    """FAMILY_CASES, the cases run on the patched DeepSpeed, are one per optimizer the cases exercise."""
    families = [intended_optimizer(name, CASES[2][name]) for name in FAMILY_CASES]
    every = {intended_optimizer(name, case) for cases in CASES.values() for name, case in cases.items()}
    assert sorted(families) == sorted(every)


EXTRA_CASES = cases_where(lambda world, case: "statistics" in case["block"])
GRANULAR_CASES = cases_where(lambda world, case: "granularity" in case["block"])


@pytest.mark.parametrize("world_size,name", EXTRA_CASES)
def test_extra_statistics_match_reference(world_size, name):
    record, _ = case_result(world_size, name)
    extra = record["case"]["block"]["statistics"]
    for index, measured, reference in measured_steps(record):
        assert set(measured["pre_clip"]) == expected_keys(record, index)
        for key, stats in measured["pre_clip"].items():
            ref = reference[key]
            assert set(extra) <= set(stats)
            if "l1" in extra:
                assert stats["l1"] == pytest.approx(ref["l1"], rel=1e-5)
                assert measured["post_clip"][key]["l1"] == pytest.approx(ref["l1"] * measured["clip_coef"], rel=1e-5)
            if "mean" in extra:
                assert abs(stats["mean"] - ref["mean"]) <= 1e-6 * ref["abs_max"]
            if "zeros" in extra:
                assert stats["zeros"] == ref["zeros"]
            if "numel" in extra:
                assert stats["numel"] == ref["numel"]


@pytest.mark.parametrize("world_size,name", GRANULAR_CASES)
def test_finer_buckets_add_up_to_their_layer(world_size, name):
    """Squared per-parameter (or per-group) norms within a layer sum to at most the layer's squared norm,
    exactly to it when the buckets cover the whole layer."""
    record, _ = case_result(world_size, name)
    covering = record["case"]["block"]["granularity"] == "param"
    steps = measured_steps(record)
    checked = 0
    for index, measured, _ in steps:
        layers = record["on"]["layer_reference"][index]
        by_layer = {}
        for key, stats in measured["pre_clip"].items():
            # a parameter name, or "<layer>.dense_4h_to_h" from the group_by regex
            layer = reference_bucket(key) if covering else int(key.split(".")[0])
            by_layer[layer] = by_layer.get(layer, 0.0) + stats["norm"]**2
        for layer, squared in by_layer.items():
            if isinstance(layer, int):
                expected = layers[layer]["norm"]**2
                assert squared == pytest.approx(expected, rel=1e-5) if covering else squared < expected
                checked += 1
    assert checked == len(steps) * len(layers_selected(record["case"]))


def test_selection_keeps_the_selected_layers_buckets():
    record, _ = case_result(3, "z2_param_granularity_mid")
    keys = record["on"]["measured"][-1]["pre_clip"]
    assert {key for key in keys if key.startswith("layers.")} == {
        name for name in record["on"]["final"] if name.startswith("layers.2.")}
    assert "embed.weight" in keys and "head.weight" in keys
    record, _ = case_result(3, "z1_group_by_fc2_selection")
    assert set(record["on"]["measured"][-1]["pre_clip"]) == {"0.dense_4h_to_h", "4.dense_4h_to_h"}
