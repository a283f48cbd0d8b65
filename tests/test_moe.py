"""Mixture-of-Experts: DeepSpeed's ``MoE`` under ZeRO-1 and ZeRO-2, expert parallel 1 and 2, on 2 CPU ranks.

Each layer's experts and router have buckets of their own (``"0.experts"``, ``"0.gate"``), exact against
the plain-PyTorch reference, adding up to the layer and to DeepSpeed's global norm. One launch runs every
case; see moe_workers.py.
"""

import math
from functools import lru_cache

import pytest

from megatron_integration.cpu_launch import launch
from moe_workers import LAYERS, run_moe_cases
from reference import TOLERANCE, assert_clipped_like_torch

STEPS = 2
CLIP = 0.05
CASES = {
    f"z{stage}_ep{ep_size}": {"stage": stage, "ep_size": ep_size, "steps": STEPS, "clip": CLIP}
    for stage in (1, 2) for ep_size in (1, 2)
}
STATS = ("norm", "min", "max", "abs_min", "abs_max")


@lru_cache(maxsize=None)
def results():
    return launch(run_moe_cases, 2, CASES)


def record_of(name: str, rank: int = 0):
    record = results()[rank][name]
    assert "error" not in record, record.get("error")
    assert record["has_moe"]
    assert len(record["measured"]) == STEPS
    return record


def steps_of(name: str):
    """(measured, reference, layer reference, global norm) of every step on rank 0."""
    record = record_of(name)
    assert len(record["reference"]) == STEPS
    for index, measured in enumerate(record["measured"]):
        assert measured is not None and measured["step"] == index + 1, measured
        yield measured, record["reference"][index], record["layer_reference"][index], record["global_norm"][index]


@pytest.mark.parametrize("name", CASES)
def test_experts_and_router_have_buckets_of_their_own(name):
    measured = record_of(name)["measured"][-1]["pre_clip"]
    layers = [key for index in range(LAYERS) for key in (index, f"{index}.gate", f"{index}.experts")]
    assert list(measured)[:len(layers)] == layers
    assert set(measured) == set(layers) | {"embed", "head"}


@pytest.mark.parametrize("name", CASES)
def test_every_bucket_matches_the_reference_before_and_after_clipping(name):
    checked = 0
    for measured, reference, _, _ in steps_of(name):
        assert_clipped_like_torch(measured, reference, CLIP, TOLERANCE["fp32"], stats=STATS)
        checked += 1
    assert checked == STEPS


@pytest.mark.parametrize("name", CASES)
def test_parts_add_up_to_the_layer_and_to_the_global_norm(name):
    checked = 0
    for measured, _, layer_reference, global_norm in steps_of(name):
        pre_clip = measured["pre_clip"]
        for index in range(LAYERS):
            parts = [pre_clip[key]["norm"] for key in (index, f"{index}.gate", f"{index}.experts")]
            assert math.sqrt(sum(norm**2 for norm in parts)) == pytest.approx(layer_reference[index]["norm"],
                                                                                rel=1e-5)
            checked += 1
        total = math.sqrt(sum(stats["norm"]**2 for stats in pre_clip.values()))
        assert total == pytest.approx(global_norm, rel=1e-5)
    assert checked == STEPS * LAYERS


@pytest.mark.parametrize("name", CASES)
def test_identical_on_every_rank(name):
    assert record_of(name, 0)["measured"] == record_of(name, 1)["measured"]

