"""Config validation, refused set-ups, the no-match warning and the collective count, in real launches."""

from functools import lru_cache

import pytest

from deepspeed_patch.statistics.reduction import COLLECTIVES_PER_STEP
from megatron_integration.cpu_launch import launch
from setup_workers import BAD_BLOCKS, run_collective_counts, run_setup_checks


@lru_cache(maxsize=None)
def single_rank():
    return launch(run_setup_checks, 1, False)[0]


@lru_cache(maxsize=None)
def two_ranks():
    return launch(run_setup_checks, 2, True)


def collective_counts(ranks: int) -> list:
    """Every rank's ``setup_workers.collective_counts``: from the set-up checks' launches at 1 and 2 ranks, from a
    launch of its own at 3."""
    if ranks == 3:
        return launch(run_collective_counts, 3)
    return [result["collectives"] for result in ([single_rank()] if ranks == 1 else two_ranks())]


EXPECTED_ERRORS = {
    "unknown_key": ["layer_grad_norms.intervl=2", "unknown key"],
    "bad_layer_spec": ["layer_grad_norms.layers='0,first,-1'", "'first'"],
    "bool_layer": ["layer_grad_norms.layers=[0, True]"],
    "layer_out_of_range": ["layer_grad_norms.layers=[0, 7]", "layer 7 is out of range", "4 transformer layers"],
    "negative_out_of_range": ["layer_grad_norms.layers=[-9]", "layer -9 is out of range"],
    "invalid_regex": ["layer_grad_norms.layer_pattern='layers.(\\\\d+'", "not a valid regular expression"],
    "regex_without_group": ["layer_grad_norms.layer_pattern", "exactly one capture group"],
    "interval_zero": ["layer_grad_norms.interval=0", "greater than or equal to 1"],
    "interval_text": ["layer_grad_norms.interval='often'"],
    "granularity_typo": ["layer_grad_norms.granularity='params'", "expected one of ['layer', 'param', 'group_by']"],
    "group_by_without_capture_group": ["layer_grad_norms.group_by='dense_4h_to_h'", "at least one capture group"],
    "group_by_without_its_granularity": ["granularity='layer' with group_by=", "only with, granularity 'group_by'"],
    "unknown_statistic": ["layer_grad_norms.statistics=['l1', 'l2']", "unknown statistic 'l2'"],
    "group_by_matching_nothing": ["layer_grad_norms.group_by=", "matches no trainable parameter",
                                  "layers.0.input_layernorm.weight"],
}


@pytest.mark.parametrize("name", sorted(BAD_BLOCKS))
def test_bad_block_fails_at_initialize_naming_key_and_value(name):
    error = single_rank()["bad_blocks"][name]
    assert error.startswith("LayerGradNormsConfigError"), error
    for fragment in EXPECTED_ERRORS[name]:
        assert fragment in error, error


def test_a_failure_on_one_rank_switches_the_statistics_off_everywhere_and_training_goes_on():
    first, second = (result["failure"] for result in two_ranks())
    assert len(first["losses"]) == len(second["losses"]) == 4  # no hang, no crash
    for record in (first, second):
        assert record["measured"][0]["step"] == 1
        assert record["measured"][1:] == [None, None, None]


def test_a_failure_on_one_rank_without_zero_neither_hangs_nor_diverges_with_the_loss_watched():
    """Issue 45 item 8: the loss's all-reduce ran over the whole world while a failure switched the statistics off
    on its process group only (here each rank's own): the failing rank stopped the all-reduce, the other did not,
    and the collectives mismatched. Now both run over the process group: the failing rank switches off alone, the
    other goes on measuring, and the two replicas train the same weights."""
    first, second = (result["failure_stage0_loss"] for result in two_ranks())
    assert len(first["losses"]) == len(second["losses"]) == 4
    assert first["losses"] == second["losses"]
    assert all(record is not None for record in first["measured"])  # the other rank's statistics go on
    assert second["measured"][0]["step"] == 1 and second["measured"][1:] == [None, None, None]
    assert len(first["weights"]) > 0
    for name, weight in first["weights"].items():
        assert weight.equal(second["weights"][name]), name


def test_pipeline_without_zero_is_measured_and_only_its_fp32_trigger_refused():
    errors = single_rank()["pipeline_without_zero"]
    assert errors["measured"] == ""
    assert errors["trigger"] == ("UnsupportedSetupError: layer_grad_norms.trigger in fp32 without ZeRO under "
                                 "pipeline or tensor parallelism is not supported (the recorder's per-step norm "
                                 "would be this rank's stage or shard only); use ZeRO-1/2 or fp16/bf16")


def test_moe_without_zero_is_refused_at_initialize_naming_it():
    assert single_rank()["moe"] == ("UnsupportedSetupError: layer_grad_norms supports Mixture-of-Experts under ZeRO "
                                    "stage 1 or 2 only; this engine uses SGD (zero_optimization.stage=0)")


def test_an_engine_without_optimizer_warns_and_measures_nothing():
    """Built for inference or evaluation: nothing to measure, so not refused; one warning per engine."""
    without = single_rank()["without_optimizer"]
    assert {stage: record["optimizer"] for stage, record in without["stages"].items()} == {
        "stage 0": "NoneType", "stage 0, bf16": "BF16_Optimizer", "stage 3": "DeepSpeedZeRoOffload"}
    assert [record["result"] for record in without["stages"].values()] == [None, None, None]
    warnings = [message for message in without["warnings"] if "has no optimizer" in message]
    assert len(warnings) == 3 and all("per-layer statistics are off" in message for message in warnings)


def test_disabled_block_is_accepted():
    assert single_rank()["disabled_block_ok"] == ""


def test_pattern_matching_nothing_warns_with_examples_and_uses_named_buckets():
    no_match = single_rank()["no_match"]
    warning = next(message for message in no_match["warnings"] if "no parameter name matches" in message)
    assert "layers.0.input_layernorm.weight" in warning
    assert all(isinstance(key, str) for key in no_match["keys"])
    assert "layers.0.query_key_value" in no_match["keys"]


@pytest.mark.parametrize("ranks", [1, 2, pytest.param(3, marks=pytest.mark.extended)])
def test_extra_collectives_and_bytes_on_measured_steps_none_in_between(ranks):
    """A measured step adds two all-reduces of the ``(buckets + 1, 9)`` float64 table (the status row last) to what
    DeepSpeed's step all-reduces, counted at ``torch.distributed.all_reduce``: the same bytes on 2 and 3 ranks; one
    rank combines nothing. Steps 1 and 3 are not measured, 2 and 4 are."""
    results = collective_counts(ranks)
    assert len(results) == ranks
    for result in results:
        off, on = result["off"], result["interval2"]
        extra_calls = 0 if ranks == 1 else COLLECTIVES_PER_STEP
        extra_bytes = 0 if ranks == 1 else (on["buckets"] + 1) * 9 * 8  # float64
        assert on["buckets"] == 8  # TinyGPT's 4 layers and embed, pos_embed, final_layernorm, head
        for key, extra in (("calls", extra_calls), ("all_reduce_bytes", extra_bytes)):
            assert [on[key][step] - off[key][step] for step in range(4)] == [0, extra, 0, extra], key
        assert off["all_reduce_bytes"][0] > 0 or ranks == 1  # the wrapper sees DeepSpeed's own all-reduces
