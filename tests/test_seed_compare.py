"""The logic of ``deepspeed_patch/upstream/seed/compare.py``, the session script that compares the seed of PR 01
with the package bit for bit (it needs a DeepSpeed master checkout, which CI cannot fetch): its float64 distance
in ulps, its equality that takes NaN for NaN, and its per-field count of differences, on results made up here."""

import importlib.util
import math
import os

import pytest

COMPARE = os.path.join(os.path.dirname(__file__), "..", "deepspeed_patch", "upstream", "seed", "compare.py")


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("seed_compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_result(step: int, norm: float, overflow: bool = False) -> dict:
    """A result as ``engine.get_layer_grad_norms()`` gives it, two layers; no post-clip on an overflowed step."""
    def stats() -> dict:
        return {key: {"norm": norm * (key + 1), "min": -norm, "max": norm} for key in (0, 1)}

    return {"step": step, "overflow": overflow, "clip_coef": None if overflow else 0.5, "loss_scale": 1.0,
            "pre_clip": stats(), "post_clip": None if overflow else stats()}


def test_ulps_counts_float64_steps_across_zero(compare):
    assert compare.ulps(1.0, 1.0) == 0
    assert compare.ulps(1.0, math.nextafter(1.0, 2.0)) == 1
    assert compare.ulps(math.nextafter(0.0, 1.0), math.nextafter(0.0, -1.0)) == 2
    assert compare.ulps(math.inf, 1.0) == -1


def test_nan_equals_nan_and_nothing_else(compare):
    assert compare.equal(math.nan, math.nan)
    assert not compare.equal(math.nan, 1.0)
    assert compare.equal(None, None) and not compare.equal(0.5, None)


def test_compare_counts_each_differing_field_once(compare, capsys):
    seed = [None, step_result(2, 1.0), step_result(3, math.nan, overflow=True)]
    package = [None, step_result(2, 1.0), step_result(3, math.nan, overflow=True)]
    package[1]["pre_clip"][1]["norm"] = math.nextafter(2.0, 3.0)  # one ulp off, one field of one layer
    counts = compare.compare("seed", seed, "package", package)
    assert counts["pre_clip.norm"][:3] == [4, 1, 1]  # 2 steps x 2 layers compared, one differs by one ulp
    assert counts["post_clip.norm"][:2] == [2, 0]  # the overflowed step has no post-clip to compare
    assert counts["clip_coef"][:2] == [2, 0] and counts["step"][:2] == [2, 0]
    assert sum(entry[1] for entry in counts.values()) == 1
    assert "step 2 pre_clip 1 norm" in capsys.readouterr().out


def test_compare_names_a_phase_only_one_run_has(compare):
    seed, package = [step_result(1, 1.0)], [step_result(1, 1.0)]
    package[0]["post_clip"] = None
    counts = compare.compare("seed", seed, "package", package)
    assert counts["post_clip missing"][1] == 1
