"""How the optimizer kinds and the update-to-weight ratio reach the logs (``deepspeed_patch.outputs.tags``):
phases of their own, named as the gradient's are."""

import math

import pytest

from deepspeed_patch.outputs.tags import (
    ALL_PHASES,
    OPTIMIZER_KINDS,
    LayerKey,
    flat_scalars,
    logged_result,
    phase_statistics,
    update_to_weight,
)


def bucket(norm: float) -> dict:
    """One bucket's statistics, every one derived from ``norm``."""
    return {"norm": norm, "min": -norm / 4, "max": norm / 2, "abs_min": 0.0, "abs_max": norm / 2, "nonfinite": 0}


def result_with(kinds=OPTIMIZER_KINDS, overflow: bool = False) -> dict:
    """A result of two buckets, layer 0 and the embedding; the kinds' norms differ by kind."""
    keys = (0, "embed")
    by_kind = {"param": 4.0, "update": 0.01, "exp_avg": 0.2, "exp_avg_sq": 0.003}
    result = {"step": 7, "overflow": overflow, "clip_coef": None if overflow else 0.5,
              "pre_clip": {key: bucket(1.0 + index) for index, key in enumerate(keys)},
              "post_clip": None if overflow else {key: bucket(0.5 + index) for index, key in enumerate(keys)}}
    for kind in kinds:
        result[kind] = {key: bucket(by_kind[kind] * (1 + index)) for index, key in enumerate(keys)}
    return result


def test_every_kind_and_the_ratio_are_flat_scalars_named_like_the_gradient_s_phases():
    scalars = flat_scalars(result_with())
    assert scalars["layer-grad-norms/pre-clip/layer00"] == 1.0
    assert scalars["layer-grad-norms/update/layer00"] == 0.01
    assert scalars["layer-grad-norms/param/embed"] == 8.0
    assert scalars["layer-grad-norms/values/max/exp-avg-sq/layer00"] == 0.0015
    assert scalars["layer-grad-norms/values/min/exp-avg/embed"] == pytest.approx(-0.1)
    assert scalars["layer-grad-norms/update-to-weight/layer00"] == pytest.approx(0.01 / 4.0)
    assert scalars["layer-grad-norms/update-to-weight/embed"] == pytest.approx(0.02 / 8.0)
    assert not any("values" in tag and "update-to-weight" in tag for tag in scalars)  # the ratio has a norm only
    # 6 phases x 3 statistics x 2 buckets, and the ratio's norm of each bucket
    assert len(scalars) == 6 * 3 * 2 + 2


def test_phases_a_result_lacks_or_holds_none_are_left_out():
    overflowed = flat_scalars(result_with(kinds=("param", "exp_avg"), overflow=True))
    assert {tag.split("/")[-2] for tag in overflowed} == {"pre-clip", "param", "exp-avg"}  # no post-clip, no ratio
    assert flat_scalars(result_with(kinds=())) == flat_scalars(result_with(kinds=()), phases=("pre_clip", "post_clip"))


def test_phases_and_statistics_select():
    scalars = flat_scalars(result_with(), phases=("update", "update_to_weight"), statistics=("norm", "max"))
    assert sorted(scalars) == sorted(["layer-grad-norms/update/layer00", "layer-grad-norms/update/embed",
                                      "layer-grad-norms/values/max/update/layer00",
                                      "layer-grad-norms/values/max/update/embed",
                                      "layer-grad-norms/update-to-weight/layer00",
                                      "layer-grad-norms/update-to-weight/embed"])


def test_logged_result_adds_the_ratio_only_with_update_and_param():
    result = result_with()
    logged = logged_result(result)
    assert "update_to_weight" not in result  # the engine's result is left as it is
    assert {key: values["norm"] for key, values in logged["update_to_weight"].items()} == pytest.approx(
        {0: 0.0025, "embed": 0.0025})
    for kinds in ((), ("update", ), ("param", "exp_avg")):
        assert logged_result(result_with(kinds)) == result_with(kinds)


def test_the_ratio_over_zero_weights_is_infinite_or_zero():
    result = {"update": {0: {"norm": 0.5}, 1: {"norm": 0.0}, 2: {"norm": 0.0}},
              "param": {0: {"norm": 0.0}, 1: {"norm": 0.0}, 2: {"norm": 2.0}}}
    assert update_to_weight(result) == {0: {"norm": math.inf}, 1: {"norm": 0.0}, 2: {"norm": 0.0}}


def test_layers_of_several_stacks_keep_their_names():
    key = LayerKey("decoder", 3)
    result = {"pre_clip": {key: bucket(1.0)}, "post_clip": None, "update": {key: bucket(1.0)},
              "param": {key: bucket(2.0)}}
    assert flat_scalars(result, statistics=("norm", ))["layer-grad-norms/update-to-weight/decoder.layer03"] == 0.5


def test_phase_statistics():
    assert phase_statistics("update_to_weight") == ("norm", )
    assert phase_statistics("adaptive_clip") == ("norm", )
    assert all(phase_statistics(phase) == ("norm", "min", "max") for phase in ALL_PHASES[:-1])


def test_remedies_in_logs():
    """Adaptive clipping's factors are a phase of their own (each bucket's factor as its "norm"), a skip a scalar of
    the step."""
    result = {"pre_clip": {0: bucket(1.0)}, "post_clip": {0: bucket(0.5)}, "adaptive_clip": {0: 0.5, "embed": 1.0},
              "skipped": False, "skip_reason": None}
    scalars = flat_scalars(result, statistics=("norm", ))
    assert scalars["layer-grad-norms/adaptive-clip/layer00"] == 0.5
    assert scalars["layer-grad-norms/adaptive-clip/embed"] == 1.0
    assert scalars["layer-grad-norms/skipped-step"] == 0.0
    assert "layer-grad-norms/skipped-step" not in flat_scalars({"pre_clip": {0: bucket(1.0)}, "post_clip": None})
