"""Per-layer statistics under pipeline parallelism: 2 stages on 2 CPU ranks, both spec offsets.

Layer keys come from the specs (never from a hard-coded offset), every rank reports every layer,
and the values match the same network run as an ordinary module.
"""

import math
from functools import lru_cache

import pytest

from megatron_integration.cpu_launch import launch
from pipeline_workers import DEFAULT_CASE, run_pipeline_cases
from reference import TOLERANCE, assert_close_stats

OPTIMIZER_KINDS = ("param", "update", "exp_avg", "exp_avg_sq")
CASES = {
    "offset3_zero1_fp32_clip": {"first_layer_index": 3, "clip": 0.1},
    "offset2_zero1_fp32": {"first_layer_index": 2},
    "offset3_bf16_optimizer_clip": {"first_layer_index": 3, "dtype": "bf16", "clip": 0.1},
    "offset2_bf16_optimizer": {"first_layer_index": 2, "dtype": "bf16", "layers": 5},
    "offset3_tied_head_clip": {"first_layer_index": 3, "tie": True, "clip": 0.1},
    "offset2_adamw_optimizer_statistics_clip": {"first_layer_index": 2, "clip": 0.1, "kinds": OPTIMIZER_KINDS},
}


def named_buckets(name):
    """Named buckets of the pipelined model (spec class, or tie key) and the TinyGPT modules they hold."""
    if CASES[name].get("tie"):
        return {"embed": ("embed", "pos_embed"), "LayerNorm": ("final_layernorm", )}
    return {"EmbeddingPipe": ("embed", "pos_embed"), "LayerNorm": ("final_layernorm", ), "Linear": ("head", )}


@lru_cache(maxsize=None)
def two_stages():
    return launch(run_pipeline_cases, 2, CASES)


def records(name):
    by_rank = [ranks[name] for ranks in two_stages()]
    if "error" in by_rank[0]:
        pytest.fail(by_rank[0]["error"])
    return [rank["on"] for rank in by_rank]


def every_step(record, name: str) -> list:
    """(measured, reference, global norm) of each step of the case, all of them: a step without its own
    result fails the test."""
    steps = {**DEFAULT_CASE, **CASES[name]}["steps"]
    assert [measured["step"] for measured in record["measured"]] == list(range(1, steps + 1))
    assert len(record["reference"]) == len(record["global_norm"]) == steps
    return list(zip(record["measured"], record["reference"], record["global_norm"]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_layers_match_the_plain_module(name):
    record = records(name)[0]
    tolerance = TOLERANCE[CASES[name].get("dtype", "fp32")]
    layers = CASES[name].get("layers", 4)
    for measured, reference, _ in every_step(record, name):
        assert sorted(key for key in measured["pre_clip"] if isinstance(key, int)) == list(range(layers))
        assert_close_stats(measured["pre_clip"], {k: v for k, v in reference.items() if isinstance(k, int)},
                           tolerance)


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_buckets_hold_embedding_norm_and_head(name):
    """A tied embedding/head is one bucket, counted once although both end stages hold a copy."""
    record = records(name)[0]
    tolerance = TOLERANCE[CASES[name].get("dtype", "fp32")]
    named = named_buckets(name)
    for measured, reference, _ in every_step(record, name):
        assert set(named) == {key for key in measured["pre_clip"] if isinstance(key, str)}
        for key, modules in named.items():
            expected = math.sqrt(sum(reference[module]["norm"]**2 for module in modules))
            assert measured["pre_clip"][key]["norm"] == pytest.approx(expected, rel=tolerance)
            assert measured["pre_clip"][key]["max"] == pytest.approx(max(reference[m]["max"] for m in modules),
                                                                     rel=tolerance)


@pytest.mark.parametrize("name", sorted(CASES))
def test_norms_add_up_to_global_norm_and_ranks_agree(name):
    first, second = records(name)
    assert repr(first["measured"]) == repr(second["measured"])
    for measured, _, global_norm in every_step(first, name):
        combined = math.sqrt(sum(stats["norm"]**2 for stats in measured["pre_clip"].values()))
        assert combined == pytest.approx(global_norm, rel=1e-5)


def test_bf16_cases_use_bf16_optimizer():
    for name, case in CASES.items():
        expected = "BF16_Optimizer" if case.get("dtype") == "bf16" else "DeepSpeedZeroOptimizer"
        assert records(name)[0]["optimizer"] == expected


def test_optimizer_statistics_of_each_stage_match_the_full_state():
    """``optimizer_statistics`` under pipeline parallelism: each layer's fp32 weights, update and moments, read on
    the stage that holds it, against the full state gathered from both stages."""
    name = "offset2_adamw_optimizer_statistics_clip"
    checked = 0
    for record in records(name):
        assert len(record["kind_reference"]) == len(record["measured"]) == DEFAULT_CASE["steps"]
        for measured, reference in zip(record["measured"], record["kind_reference"]):
            for kind in OPTIMIZER_KINDS:
                layers = {key: value for key, value in reference[kind].items() if isinstance(key, int)}
                assert sorted(layers) == sorted(key for key in measured[kind] if isinstance(key, int))
                assert_close_stats(measured[kind], layers, 1e-4)
                checked += len(layers)
    assert checked == 2 * DEFAULT_CASE["steps"] * len(OPTIMIZER_KINDS) * DEFAULT_CASE["layers"]
