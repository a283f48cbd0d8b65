"""``adaptive_clipping`` and ``skip_step`` against an independent plain-PyTorch reference, on 1 to 4 CPU ranks.

One launch per world size runs all of that world's cases (remedies_workers.py): 1 and 2 ranks in the suite (the
2-rank launch: tensor parallelism's replicas, ``group_by`` leaving parameters out, BF16_Optimizer's global norm),
more at 2 ranks (a tied pipeline), 3 and 4 ranks (TP 2 x DP 2) in the extended tier. The reference of each step is the
full gradient averaged over ranks and micro-batches (reference.py), from which this module computes AdaGC's factors
and the skip decision itself (``adagc_factors``, ``skip_decisions``); the optimizer is SGD with lr 1, so the update a
step applied is the gradient the optimizer received, compared bucket by bucket with the reference's clipped one.
"""

import math
import os
import re
import statistics
import tempfile
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Set

import pytest
from remedies_workers import UNMATCHED, run_cases

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_close_stats

UNEVEN = 5  # layers: partitions of unequal size at 3 ranks
LAUNCH_TIMEOUT = 1500
"""Seconds for one launch's cases: a loaded CI machine needs well over the default for the extended ones."""
DUMP = os.path.join(tempfile.gettempdir(), f"remedies-dump-{os.getpid()}.jsonl")
ADAPTIVE = {"enabled": True, "warmup_steps": 2, "factor": 0.9, "beta": 0.5}
"""Tight enough that buckets are clipped on most steps after the warm-up (a factor under 1 clips a steady norm)."""
SKIP = {"enabled": True, "sigma": 6.0, "window": 4}
BOTH = {"skip_step": SKIP, "adaptive_clipping": ADAPTIVE}
TRIGGER = {"grad_norm_factor": 1e12, "window": 3, "capture_steps": 1, "history": 3}
LOSS_TRIGGER = {"grad_norm_factor": 1e12, "loss_factor": 3.0, "window": 3, "capture_steps": 1}
"""A trigger that never fires by itself: only a skipped step opens its capture and reduces its recorder."""
BF16_OPTIMIZER = {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32"}
APPLIED_TOLERANCE = 1e-3
"""Relative, of an fp32 update (weights before minus after, rounded in the weights) to the reference's gradient."""


def adaptive(steps: int = 6, **case) -> dict:
    return {"steps": steps, "clip": 0.5, "block": {"adaptive_clipping": ADAPTIVE}, **case}


def skipping(**case) -> dict:
    return {"steps": 8, "spike_step": 7, "report_loss": True, **case}


GROUP_BY = {"adaptive_clipping": ADAPTIVE, "granularity": "group_by", "group_by": r"layers\.(\d+)\."}
"""The layers' parameters in buckets of their own; the embeddings, the final norm and the head in none."""
FAIL_AT = 3
"""The first step after the warm-up: where a failure of the scaling leaves global clipping suspended."""
TIED = "tied_modules.embed.embed.weight"
"""The pipeline's tied embedding, held by the first and the last stage."""


CASES = {  # by launch: its world size, and "x" for the extended tier
    "1": {
        "z2_fp32_adaptive_groups": adaptive(groups=True),
        "z2_fp32_keys_off": {"steps": 3, "clip": 0.5, "compare_off": True,
                             "block": {"adaptive_clipping": {"enabled": False}, "skip_step": {"enabled": False}}},
        # the master switch off, both remedies on below it, a spike they would skip and factors that would clip
        "z2_fp32_master_switch_off": {"steps": 8, "spike_step": 7, "clip": 0.5, "compare_off": True,
                                      "block": {"enabled": False, "adaptive_clipping": ADAPTIVE, "skip_step": SKIP}},
        # both remedies resumed after step 5 (past the warm-up, the windows full), a spike at the first step after it
        "z2_fp32_resume": skipping(clip=0.5, resume_at=5, spike_step=6, block=BOTH),
        "refused_stage0": {"stage": 0, "block": {"adaptive_clipping": ADAPTIVE}},
        "refused_bf16_optimizer_skip": {**BF16_OPTIMIZER, "block": {"skip_step": SKIP}},
        # three refusals of two checks (issue 46: every refusal that applies is named at once): SGD has no update
        # by Adam's rule, and neither remedy goes with optimizer_statistics
        "refused_with_optimizer_statistics": {"block": {**BOTH, "optimizer_statistics": ["update"]}},
        "z2_fp32_skip_spike": skipping(block={"skip_step": SKIP, "trigger": TRIGGER, "dump": {"path": DUMP}},
                                       dump=True),
        # the loss scale grows on every second step: ZeRO divides that step's gradient by the grown scale
        "z2_fp16_adaptive_scale_growth": adaptive(dtype="fp16", scale_window=2),
        "z2_fp32_adaptive_scaling_fails": adaptive(steps=FAIL_AT + 1, fail_scaling_at=FAIL_AT),
    },
    "2": {  # the suite's multi-rank launch: the paths a remedy takes across ranks (a tensor-parallel case last:
        # its grid stays DeepSpeed's model-parallel unit for the engines built after it in the process)
        "z2_fp32_adaptive_group_by_partial": adaptive(block=GROUP_BY),
        "z1_bf16_optimizer_adaptive": adaptive(**BF16_OPTIMIZER),
        # skip_step alone, and beside a trigger watching the loss: one loss all-reduce a step serves both
        "z2_fp32_skip_spike_2": skipping(block={"skip_step": SKIP}),
        "z2_fp32_skip_spike_loss_trigger": skipping(block={"skip_step": SKIP, "trigger": LOSS_TRIGGER}),
        "tp2_zero1_adaptive": adaptive(model="tp", stage=1),
    },
    "1x": {  # a universal checkpoint (DeepSpeed's conversion, of Adam's state only), a resume without the optimizer's
        "z2_fp32_resume_universal": skipping(clip=0.5, resume_at=5, spike_step=6, block=BOTH, resume_from="universal",
                                             adam=True),
        "z2_fp32_resume_module": skipping(clip=0.5, resume_at=5, spike_step=6, block=BOTH, resume_from="module"),
    },
    "2x": {  # the ranks agree (the agreed loss itself: test_on_demand.py, at 2 ranks in the suite)
        "z2_fp32_both_spike": skipping(clip=0.5, block={"skip_step": SKIP, "adaptive_clipping": ADAPTIVE}),
        # no rank reports a loss (Megatron, the HF Trainer): judged on the gradient norm alone, not on the -inf
        # the loss all-reduce carries for "none" (which once skipped every step on 2 ranks)
        "z2_fp32_skip_spike_no_loss": skipping(report_loss=False, block={"skip_step": SKIP}),
        "z2_fp32_adaptive_gas2_groups": adaptive(gas=2, groups=True),
        "z1_fp16_adaptive_overflow": adaptive(stage=1, dtype="fp16", overflow_step=3, steps=6),
        "pipe2_tied_zero1_adaptive": adaptive(model="pipe", stage=1),
    },
    "3x": {
        "z2_fp32_adaptive_gas2_uneven": adaptive(gas=2, layers=UNEVEN),
        "z2_bf16_adaptive_uneven": adaptive(dtype="bf16", layers=UNEVEN),
        "z1_bf16_optimizer_adaptive_uneven": adaptive(**BF16_OPTIMIZER, layers=UNEVEN),
        "z3_fp32_adaptive_uneven": adaptive(stage=3, layers=UNEVEN),
        "z3_fp32_both_spike_uneven": skipping(stage=3, clip=0.5, layers=UNEVEN,
                                              block={"skip_step": SKIP, "adaptive_clipping": ADAPTIVE}),
    },
    "4x": {  # tensor x data parallelism: 2 x 2
        "tp2_dp2_zero1_adaptive": adaptive(model="tp", stage=1),
        "tp2_dp2_bf16_optimizer_adaptive": adaptive(model="tp", **BF16_OPTIMIZER),
    },
}
ADAPTIVE_CASES = [(launch_id, name) for launch_id, cases in CASES.items() for name, case in cases.items()
                  if "adaptive_clipping" in case.get("block", {}) and case["block"]["adaptive_clipping"]["enabled"]
                  and not name.startswith("refused") and not case.get("compare_off") and not case.get("adam")
                  and "fail_scaling_at" not in case and case.get("model") != "pipe"]
REPLICA_CASES = [(launch_id, name) for launch_id, cases in CASES.items() for name, case in cases.items()
                 if case.get("model") in ("tp", "pipe")]
BF16_OPTIMIZER_CASES = [(launch_id, name) for launch_id, name in ADAPTIVE_CASES if "bf16_optimizer" in name]
SKIP_CASES = [(launch_id, name) for launch_id, cases in CASES.items() for name, case in cases.items()
              if "spike_step" in case and not case.get("compare_off")]


def tiered(pairs):
    return [pytest.param(launch_id, name, marks=[pytest.mark.extended] if "x" in launch_id else []) for launch_id, name
            in pairs]


@lru_cache(maxsize=None)
def results_of(launch_id: str):
    if os.path.exists(DUMP):
        os.remove(DUMP)
    chosen = os.environ.get("REMEDY_CASES")  # comma-separated case names: launch only those (for debugging)
    cases = {name: case for name, case in CASES[launch_id].items() if not chosen or name in chosen.split(",")}
    return launch(run_cases, int(launch_id.rstrip("x")), cases, timeout=LAUNCH_TIMEOUT)


def ok(launch_id: str, name: str) -> List[dict]:
    """Every rank's record of a case that trained."""
    records = [rank_results[name] for rank_results in results_of(launch_id)]
    for record in records:
        assert "error" not in record, record["error"]
    return [record["on"] for record in records]


def adagc_factors(references: List[Dict], clip: float, config: Dict, passed: Set[int],
                  shrinks: Sequence[float]) -> List[Optional[Dict]]:
    """AdaGC (arXiv 2502.11034) from the full gradient of each step, written out here on its own: the factor each
    bucket's gradient is multiplied by (the global clip coefficient, DeepSpeed's rule, in the warm-up, and for a
    bucket that has had no norm yet), ``None`` on a step in ``passed`` (skipped or overflowed: the optimizer applied
    nothing, the state does not move). ``shrinks``: what the optimizer multiplies each step's gradient by besides
    (ZeRO in fp16 divides a step's gradient by the loss scale it grows to at that step: old over new scale); each
    average takes in what was applied."""
    ema: Dict = {}
    applied = 0
    factors = []
    for step, (reference, shrink) in enumerate(zip(references, shrinks), start=1):
        if step in passed:
            factors.append(None)
            continue
        norms = {key: stats["norm"] for key, stats in reference.items()}
        total = math.sqrt(sum(norm**2 for norm in norms.values()))
        coef = min(1.0, clip / (total * shrink + 1e-6)) if clip > 0 else 1.0
        if applied < config["warmup_steps"]:
            step_factors = dict.fromkeys(norms, coef)
            for key, norm in norms.items():
                if norm > 0:
                    ema[key] = min(ema.get(key, math.inf), norm * coef * shrink)
        else:
            step_factors = {key: min(1.0, config["factor"] * ema[key] / norm) if key in ema else coef
                            for key, norm in norms.items()}
            for key, norm in norms.items():
                if norm > 0:
                    clipped = norm * step_factors[key] * shrink
                    ema[key] = config["beta"] * ema[key] + (1 - config["beta"]) * clipped if key in ema else clipped
        applied += 1
        factors.append(step_factors)
    return factors


def shrinks_of(record: Dict) -> List[float]:
    """Each step's old over new loss scale where ZeRO unscales by the new one (fp16), else 1."""
    return [before / after if after > before else 1.0 for before, after in record["loss_scales"]]


def skip_decisions(losses: List[float], norms: List[float], config: Dict) -> List[bool]:
    """OLMo-core's rule, one-sided: a value above mean + sigma * std (sample std) of its last ``window``
    predecessors, judged once ``min(window, max(20, window // 2))`` are there."""
    least = min(config["window"], max(20, config["window"] // 2))

    def outlier(values: List[float], index: int) -> bool:
        window = values[max(0, index - config["window"]):index]
        return len(window) >= least and values[index] > statistics.fmean(window) + config["sigma"] * statistics.stdev(
            window)

    return [outlier(losses, index) or outlier(norms, index) for index in range(len(norms))]


def reduced_table(norms: Sequence[float]):
    """A reduced statistics table (host, float64) whose gradient rows hold ``norms``, the status row after them."""
    import torch

    from deepspeed_patch.statistics.statistics import NUM_COLUMNS, SUMSQ

    table = torch.zeros(len(norms) + 1, NUM_COLUMNS, dtype=torch.float64)
    table[:len(norms), SUMSQ] = torch.tensor(norms, dtype=torch.float64)**2
    return table


def global_norm(reference: Dict) -> float:
    return math.sqrt(sum(stats["norm"]**2 for stats in reference.values()))


def passed_steps(launch_id: str, name: str) -> Set[int]:
    """The steps of a case the optimizer applied nothing on, by the reference: the forced overflow, the skips."""
    case = CASES[launch_id][name]
    record = ok(launch_id, name)[0]
    passed = {case["overflow_step"]} if case.get("overflow_step") else set()
    if "skip_step" in case.get("block", {}):
        norms = [global_norm(reference) for reference in record["reference"]]
        decisions = skip_decisions(record["losses"], norms, case["block"]["skip_step"])
        passed |= {step for step, skipped in enumerate(decisions, start=1) if skipped}
    return passed


@pytest.mark.parametrize("launch_id, name", tiered(ADAPTIVE_CASES))
def test_adaptive_clipping_applies_adagc(launch_id, name):
    """Step by step: pre-clip norms, the per-bucket factors (``adaptive_clip``), ``post_clip`` and the update the
    optimizer applied, against AdaGC computed from the reference gradient (the parameters a ``group_by`` pattern
    leaves out: a bucket of their own, not reported)."""
    case = CASES[launch_id][name]
    config = {"warmup_steps": 100, "factor": 1.05, "beta": 0.98, **case["block"]["adaptive_clipping"]}
    dtype = case.get("dtype", "fp32")
    records = ok(launch_id, name)
    record = records[0]
    passed = passed_steps(launch_id, name)
    shrinks = shrinks_of(record)
    expected = adagc_factors(record["reference"], case["clip"], config, passed, shrinks)
    checked = clipped = 0
    for index, (reference, factors, shrink) in enumerate(zip(record["reference"], expected, shrinks)):
        measured = record["measured"][index]
        reported = {key: stats for key, stats in reference.items() if key != UNMATCHED}
        assert all(repr(other["measured"][index]) == repr(measured) for other in records)  # every rank's (NaN too)
        if index + 1 != case.get("overflow_step"):  # the forced overflow's statistics are NaN
            assert_close_stats(measured["pre_clip"], reported, TOLERANCE[dtype])
        if factors is None:
            assert measured["post_clip"] is None and measured["adaptive_clip"] is None
            assert record["unchanged"][index]
            continue
        warm = measured["adaptive_clip"] is None
        assert warm == (index < config["warmup_steps"] + len([s for s in passed if s <= index]))
        if not warm:
            assert set(measured["adaptive_clip"]) == set(reported)
            for key in reported:
                assert measured["adaptive_clip"][key] == pytest.approx(factors[key], rel=10 * TOLERANCE[dtype])
            clipped += sum(factor < 1.0 for factor in factors.values())
        want = {key: {stat: stats[stat] * factors[key] * shrink for stat in ("norm", "min", "max", "abs_max")}
                for key, stats in reference.items()}
        post_clip = {key: want[key] for key in reported}
        assert_close_stats(measured["post_clip"], post_clip, 10 * TOLERANCE[dtype], stats=("norm", "min", "max"))
        if dtype == "fp32":  # low-precision weights round the update itself: its stats are post_clip's above
            assert_close_stats(record["applied"][index], want, APPLIED_TOLERANCE, stats=("norm", "min", "max"))
        checked += 1
    assert checked == case["steps"] - len(passed)
    assert clipped > 0  # the per-bucket rule did clip
    if case.get("scale_window"):  # a growth step after the warm-up, whose halved norm the average takes in
        assert any(shrink < 1 for shrink in shrinks[config["warmup_steps"]:-1])


@pytest.mark.parametrize("launch_id, name", tiered(BF16_OPTIMIZER_CASES))
def test_bf16_optimizer_global_norm_is_the_applied_one_on_every_rank(launch_id, name):
    """BF16_Optimizer computes its global norm from every parameter's gradient, not from the rank's partition: after
    the warm-up it is the norm of the gradient adaptive clipping left (``post_clip``), the same on every rank."""
    config = {"warmup_steps": 100, **CASES[launch_id][name]["block"]["adaptive_clipping"]}
    records = ok(launch_id, name)
    assert len(records) == int(launch_id.rstrip("x"))
    checked = 0
    for index, measured in enumerate(records[0]["measured"]):
        assert len({record["global_norm"][index] for record in records}) == 1, index
        if index >= config["warmup_steps"]:
            applied = math.sqrt(sum(stats["norm"]**2 for stats in measured["post_clip"].values()))
            assert records[0]["global_norm"][index] == pytest.approx(applied, rel=1e-4)
            checked += 1
    assert checked == CASES[launch_id][name]["steps"] - config["warmup_steps"]


@pytest.mark.parametrize("launch_id, name", tiered(REPLICA_CASES))
def test_replicas_get_the_same_factor(launch_id, name):
    """A parameter several ranks hold (replicated across the tensor-parallel ranks: layer norms, the row-parallel
    bias, embedding, head; a pipeline-tied embedding on the first and the last stage) is scaled by its bucket's
    factor on every rank that holds it: the copies stay bit-identical while adaptive clipping clips."""
    records = ok(launch_id, name)
    clipped = [factor for measured in records[0]["measured"] for factor in (measured["adaptive_clip"] or {}).values()
               if factor < 1.0]
    assert clipped, "adaptive clipping should clip some bucket"
    if CASES[launch_id][name]["model"] == "pipe":
        copies = [record["tied"][TIED] for record in records if TIED in record["tied"]]
        assert len(copies) == 2  # the first and the last stage
        assert copies[0].equal(copies[1])
        return
    replicated = records[0]["replicated"]
    assert len(replicated) == 12  # per layer its norm's weight and bias, the row-parallel bias; embedding, head's two
    for weight in replicated:
        assert all(record["final"][weight].equal(records[0]["final"][weight]) for record in records), weight
    tensor_parallel = 2
    for rank, record in enumerate(records):  # the shards of a TP rank alike on its data-parallel ranks
        same_shard = records[rank % tensor_parallel]["final"]
        assert all(weight.equal(same_shard[key]) for key, weight in record["final"].items()), rank


def test_a_failing_remedy_leaves_global_clipping_on():
    """The scaling raising inside the step, after global clipping was suspended for it: the step is clipped
    globally (DeepSpeed's rule), its result says so and claims no factor, and the statistics switch off at the
    next step."""
    case = CASES["1"]["z2_fp32_adaptive_scaling_fails"]
    record = ok("1", "z2_fp32_adaptive_scaling_fails")[0]
    reference = record["reference"][FAIL_AT - 1]
    coef = min(1.0, case["clip"] / (global_norm(reference) + 1e-6))
    assert coef < 1.0  # global clipping clips this step
    want = {key: {stat: stats[stat] * coef for stat in ("norm", "min", "max", "abs_max")}
            for key, stats in reference.items()}
    assert_close_stats(record["applied"][FAIL_AT - 1], want, APPLIED_TOLERANCE, stats=("norm", "min", "max"))
    measured = record["measured"][FAIL_AT - 1]
    assert measured["adaptive_clip"] is None and measured["clip_coef"] == pytest.approx(coef, rel=1e-5)
    assert record["measured"][FAIL_AT] is None


@pytest.mark.parametrize("launch_id, name", tiered(SKIP_CASES))
def test_skip_step_skips_the_spike(launch_id, name):
    """The spiked step, and only it, is skipped on every rank: no weight moves, the engine counts it as DeepSpeed
    counts an overflow, and the result says so; the decision matches OLMo-core's rule on the reference."""
    case = CASES[launch_id][name]
    records = ok(launch_id, name)
    passed = passed_steps(launch_id, name)
    assert passed == {case["spike_step"]}
    for record in records:
        skipped = [measured["skipped"] for measured in record["measured"]]
        assert skipped == [step in passed for step in range(1, case["steps"] + 1)]
        assert record["unchanged"] == skipped
        assert record["skipped_steps"] == [int(step >= case["spike_step"]) for step in range(1, case["steps"] + 1)]
        spike = record["measured"][case["spike_step"] - 1]
        assert spike["post_clip"] is None and not spike["overflow"] and "grad norm" in spike["skip_reason"]


def test_skipped_step_fires_the_capture_and_shows_in_dump():
    """The skipped step opens the trigger's capture: the recorder's steps up to it come back, it marked skipped;
    and the dump holds it."""
    case = CASES["1"]["z2_fp32_skip_spike"]
    record = ok("1", "z2_fp32_skip_spike")[0]
    history = record["history"]
    assert [entry["step"] for entry in history] == [5, 6, 7]
    assert history[-1]["trigger"]["reason"].startswith("skip_step:")
    assert [entry["skipped"] for entry in history] == [False, False, True]
    dumped = [line for line in record["dump"] if line.get("step") == case["spike_step"] and "skipped" in line]
    assert dumped and all(line["skipped"] for line in dumped)


def test_skip_step_and_a_loss_trigger_share_one_loss_all_reduce():
    """``skip_step`` and a trigger watching the loss, on 2 ranks: each step's losses are agreed in one MAX all-reduce
    (``reduction.LossAgreement``), so the trigger adds no collective to ``skip_step``'s steps; and it judges the loss
    it was handed, firing on the spiked loss at the step ``skip_step`` skips."""
    case = CASES["2"]["z2_fp32_skip_spike_loss_trigger"]
    checked = 0
    for alone, both in zip(ok("2", "z2_fp32_skip_spike_2"), ok("2", "z2_fp32_skip_spike_loss_trigger")):
        assert len(both["collectives"]) == case["steps"]
        assert both["collectives"] == alone["collectives"]
        captured = both["measured"][case["spike_step"]]["trigger"]
        assert captured["fired_at"] == case["spike_step"] and captured["reason"].startswith("loss"), captured
        checked += 1
    assert checked == 2


@pytest.mark.parametrize("name", ["z2_fp32_keys_off", "z2_fp32_master_switch_off"])
def test_keys_off_is_bit_identical(name):
    """Both keys present and off, or both on under ``"enabled": false`` (the master switch): the same weights, bit
    for bit, as without the block; with the switch off, no result either."""
    result = results_of("1")[0][name]
    assert "error" not in result, result.get("error")
    assert result["on"].keys() == result["off"].keys()
    for weight_name, weight in result["on"].items():
        assert weight.equal(result["off"][weight_name]), weight_name
    assert len(result["on"]) > 0
    if not CASES["1"][name]["block"].get("enabled", True):
        assert result["result"] is None


@pytest.mark.parametrize("launch_id, name", tiered([("1", "z2_fp32_resume"), ("1x", "z2_fp32_resume_universal")]))
def test_resume_keeps_the_averages_and_the_windows(launch_id, name):
    """A checkpoint, as saved or converted to a universal one, keeps each bucket's average, the steps seen and
    skip_step's windows: the resumed run skips the spike at its first step, and applies what the first run did."""
    case = CASES[launch_id][name]
    record = ok(launch_id, name)[0]
    resumed = record["resumed"]
    assert resumed["loaded_state"] == record["saved_state"]
    assert record["saved_state"]["adaptive_clipping"]["steps"] == case["resume_at"]
    assert len(record["saved_state"]["skip_step"]["norms"]) == SKIP["window"]
    assert resumed["measured"][0]["skipped"] and case["spike_step"] == case["resume_at"] + 1
    after = record["measured"][case["resume_at"]:]
    for key in ("adaptive_clip", "skipped"):
        assert [step[key] for step in resumed["measured"]] == [step[key] for step in after]
    for weight_name, weight in record["final"].items():
        assert weight.equal(resumed["final"][weight_name]), weight_name
    assert not [line for line in resumed["warnings"] if "restart" in line]


@pytest.mark.extended
def test_resume_without_the_optimizer_states_says_what_restarts():
    """``load_optimizer_states=False`` reads no optimizer state: the remedies restart, and a warning names what."""
    record = ok("1x", "z2_fp32_resume_module")[0]
    resumed = record["resumed"]
    assert resumed["loaded_state"]["adaptive_clipping"]["steps"] == 0
    assert not resumed["measured"][0]["skipped"]
    restarting = [line for line in resumed["warnings"] if "resumed at step 6 without the remedies' state" in line]
    assert len(restarting) == 1
    assert "adaptive_clipping's averages restart their warm-up" in restarting[0]
    assert "skip_step's windows restart empty" in restarting[0]


@pytest.mark.parametrize("name, words", [
    ("refused_stage0", ["adaptive_clipping is supported under ZeRO stage 1, 2 and 3 and BF16_Optimizer only"]),
    ("refused_bf16_optimizer_skip", ["skip_step is supported under ZeRO stage 1, 2 and 3 only"]),
    ("refused_with_optimizer_statistics", ["'update', 'exp_avg' and 'exp_avg_sq' need an Adam optimizer",
                                           "adaptive_clipping with optimizer_statistics is not supported",
                                           "skip_step with optimizer_statistics is not supported"]),
])
def test_refused_by_name(name, words):
    """Each refusal that applies is in the one error, on one line."""
    result = results_of("1")[0][name]
    assert result.get("type") == "UnsupportedSetupError", result.get("error")
    for said in words:
        assert said in result["message"]
    assert "\n" not in result["message"]


def test_megatron_flags_fill_the_block():
    import argparse

    from megatron_integration.arguments import add_layer_grad_norms_args, layer_grad_norms_block

    parser = add_layer_grad_norms_args(argparse.ArgumentParser())
    block = layer_grad_norms_block(parser.parse_args(["--log-layer-grad-norms", "--layer-grad-norms-adaptive-clipping",
                                                      "--layer-grad-norms-skip-step", "sigma=5,window=64"]))
    assert block["adaptive_clipping"] == {"enabled": True}
    assert block["skip_step"] == {"enabled": True, "sigma": 5, "window": 64}
    alone = layer_grad_norms_block(parser.parse_args(["--layer-grad-norms-adaptive-clipping", "factor=1.1"]))
    assert alone == {"enabled": True, "adaptive_clipping": {"enabled": True, "factor": 1.1}}
    assert layer_grad_norms_block(parser.parse_args([])) is None
    # the flags' bad values: test_megatron_integration.py, through the fork's parser


@pytest.mark.parametrize("block, words", [
    ({"adaptive_clipping": {"enabled": True, "beta": 1.0}}, "adaptive_clipping.beta=1.0"),
    ({"adaptive_clipping": {"enabled": True, "warmup_steps": 0}}, "adaptive_clipping.warmup_steps=0"),
    ({"skip_step": {"window": 1}}, "skip_step.window=1"),
    ({"skip_step": {"sigmas": 6}}, "skip_step.sigmas=6: unknown key"),
])
def test_bad_remedy_keys_are_named(block, words):
    from deepspeed_patch.config import LayerGradNormsConfigError, load_config

    with pytest.raises(LayerGradNormsConfigError, match=re.escape(words)):
        load_config({"layer_grad_norms": block})


def test_a_universal_checkpoint_is_read_from_its_folder(tmp_path):
    """DeepSpeed loads a universal checkpoint with ``state_dict_list=None`` and the folder (a ``TypeError`` before):
    the remedies' state is read from ``zero/optimizer_state.pt``, where ``ds_to_universal`` copies it (the real
    conversion: ``test_resume_keeps_the_averages_and_the_windows[1x-...]``, extended tier)."""
    import torch

    from deepspeed_patch.remedies.remedies import CHECKPOINT_KEY, UNIVERSAL_STATE, saved_state

    state = {"adaptive_clipping": {"steps": 3, "ema": {0: 0.5}}, "skip_step": {"losses": [1.0], "norms": [2.0]}}
    path = tmp_path / UNIVERSAL_STATE
    path.parent.mkdir()
    torch.save({CHECKPOINT_KEY: state, "param_groups": []}, path)
    assert saved_state(None, str(tmp_path)) == state
    assert saved_state(None, str(tmp_path / "elsewhere")) is None
    assert saved_state([{"other": 1}, {CHECKPOINT_KEY: state}], None) == state


def test_a_bucket_without_a_norm_in_the_warm_up_is_clipped_globally_until_it_has_one():
    """An expert no token reached in the warm-up (norm 0 there): after it, while global clipping is off, its first
    gradient is clipped by the global coefficient (not let through), and its average starts at what was applied;
    against ``adagc_factors`` on the same norms."""
    from deepspeed_patch.config import load_config
    from deepspeed_patch.remedies.remedies import Remedies

    clip = 1.0
    config = {"warmup_steps": 2, "factor": 1.05, "beta": 0.5}
    block = {"enabled": True, "adaptive_clipping": {"enabled": True, **config}}
    remedies = Remedies(load_config({"layer_grad_norms": block}), ["dense", "expert"], num_rows=2)
    steps = [{"dense": 3.0, "expert": 0.0}, {"dense": 2.0, "expert": 0.0}, {"dense": 2.5, "expert": 4.0},
             {"dense": 2.5, "expert": 4.0}]
    references = [{key: {"norm": norm} for key, norm in norms.items()} for norms in steps]
    expected = adagc_factors(references, clip, config, set(), [1.0] * len(steps))
    checked = 0
    for step, (norms, want) in enumerate(zip(steps, expected), start=1):
        action = remedies.decide(step, reduced_table([norms["dense"], norms["expert"]]), 1.0,
                                 lambda norm: max((norm + 1e-6) / clip, 1.0))
        coefficient = 1.0 if action.factors is not None else min(1.0, clip / (action.global_norm + 1e-6))
        remedies.applied(coefficient)
        if action.factors is not None:
            assert action.factors == pytest.approx((want["dense"], want["expert"]), rel=1e-12)
            checked += 1
    assert checked == 2
    assert expected[2]["expert"] == pytest.approx(clip / math.sqrt(2.5**2 + 4.0**2), rel=1e-5)  # clipped globally
    assert expected[3]["expert"] < 1.0  # then by its own average


def test_parameters_group_by_leaves_out_have_an_average_of_their_own():
    """``group_by`` matching part of the parameters: the unreported row is a bucket of the remedies (one factor per
    table row, so every span has one), and counts in the global norm."""
    from deepspeed_patch.config import load_config
    from deepspeed_patch.remedies.remedies import UNMATCHED, Remedies

    block = {"enabled": True, "adaptive_clipping": {"enabled": True, "warmup_steps": 1}}
    config = load_config({"layer_grad_norms": block})
    remedies = Remedies(config, ["0", "1"], num_rows=3)
    assert remedies.adaptive.keys == ["0", "1", UNMATCHED]
    table = reduced_table([1.0, 2.0, 2.0])
    action = remedies.decide(1, table, 1.0, lambda norm: 1.0)
    assert action.global_norm == 3.0
    remedies.applied(1.0)
    assert len(remedies.decide(2, table, 1.0, lambda norm: 1.0).factors) == 3
