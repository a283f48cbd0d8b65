"""``adaptive_clipping`` and ``skip_step`` against an independent plain-PyTorch reference, on 1, 2 and 3 CPU ranks.

One launch per world size runs all of that world's cases (remedies_workers.py): one rank in the suite, 2 and 3 ranks
in the extended tier. The reference of each step is the
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
from typing import Dict, List, Optional, Set

import pytest
from remedies_workers import run_cases

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
"""A trigger that never fires by itself: only a skipped step opens its capture and reduces its recorder."""
BF16_OPTIMIZER = {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32"}
APPLIED_TOLERANCE = 1e-3
"""Relative, of an fp32 update (weights before minus after, rounded in the weights) to the reference's gradient."""


def adaptive(steps: int = 6, **case) -> dict:
    return {"steps": steps, "clip": 0.5, "block": {"adaptive_clipping": ADAPTIVE}, **case}


def skipping(**case) -> dict:
    return {"steps": 8, "spike_step": 7, "report_loss": True, **case}


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
        "z1_bf16_optimizer_adaptive": adaptive(**BF16_OPTIMIZER),
    },
    "3x": {
        "z2_fp32_adaptive_gas2_uneven": adaptive(gas=2, layers=UNEVEN),
        "z2_bf16_adaptive_uneven": adaptive(dtype="bf16", layers=UNEVEN),
        "z1_bf16_optimizer_adaptive_uneven": adaptive(**BF16_OPTIMIZER, layers=UNEVEN),
        "z3_fp32_adaptive_uneven": adaptive(stage=3, layers=UNEVEN),
        "z3_fp32_both_spike_uneven": skipping(stage=3, clip=0.5, layers=UNEVEN,
                                              block={"skip_step": SKIP, "adaptive_clipping": ADAPTIVE}),
    },
}
ADAPTIVE_CASES = [(launch_id, name) for launch_id, cases in CASES.items() for name, case in cases.items()
                  if "adaptive_clipping" in case.get("block", {}) and case["block"]["adaptive_clipping"]["enabled"]
                  and not name.startswith("refused") and not case.get("compare_off") and not case.get("adam")]
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


def adagc_factors(references: List[Dict], clip: float, config: Dict, passed: Set[int]) -> List[Optional[Dict]]:
    """AdaGC (arXiv 2502.11034) from the full gradient of each step, written out here on its own: the factor each
    bucket's gradient is multiplied by (the global clip coefficient, DeepSpeed's rule, in the warm-up), ``None``
    on a step in ``passed`` (skipped or overflowed: the optimizer applied nothing, the state does not move)."""
    ema: Dict = {}
    applied = 0
    factors = []
    for step, reference in enumerate(references, start=1):
        if step in passed:
            factors.append(None)
            continue
        norms = {key: stats["norm"] for key, stats in reference.items()}
        if applied < config["warmup_steps"]:
            total = math.sqrt(sum(norm**2 for norm in norms.values()))
            coef = min(1.0, clip / (total + 1e-6)) if clip > 0 else 1.0
            step_factors = dict.fromkeys(norms, coef)
            for key, norm in norms.items():
                ema[key] = min(ema.get(key, math.inf), norm * coef)
        else:
            step_factors = {key: min(1.0, config["factor"] * ema[key] / norm) for key, norm in norms.items()}
            for key, norm in norms.items():
                ema[key] = config["beta"] * ema[key] + (1 - config["beta"]) * norm * step_factors[key]
        applied += 1
        factors.append(step_factors)
    return factors


def skip_decisions(losses: List[float], norms: List[float], config: Dict) -> List[bool]:
    """OLMo-core's rule, one-sided: a value above mean + sigma * std (sample std) of its last ``window``
    predecessors, judged once ``min(window, max(20, window // 2))`` are there."""
    least = min(config["window"], max(20, config["window"] // 2))

    def outlier(values: List[float], index: int) -> bool:
        window = values[max(0, index - config["window"]):index]
        return len(window) >= least and values[index] > statistics.fmean(window) + config["sigma"] * statistics.stdev(
            window)

    return [outlier(losses, index) or outlier(norms, index) for index in range(len(norms))]


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
    optimizer applied, against AdaGC computed from the reference gradient."""
    case = CASES[launch_id][name]
    config = {"warmup_steps": 100, "factor": 1.05, "beta": 0.98, **case["block"]["adaptive_clipping"]}
    dtype = case.get("dtype", "fp32")
    records = ok(launch_id, name)
    record = records[0]
    passed = passed_steps(launch_id, name)
    expected = adagc_factors(record["reference"], case["clip"], config, passed)
    checked = clipped = 0
    for index, (reference, factors) in enumerate(zip(record["reference"], expected)):
        measured = record["measured"][index]
        assert all(repr(other["measured"][index]) == repr(measured) for other in records)  # every rank's (NaN too)
        if index + 1 != case.get("overflow_step"):  # the forced overflow's statistics are NaN
            assert_close_stats(measured["pre_clip"], reference, TOLERANCE[dtype])
        if factors is None:
            assert measured["post_clip"] is None and measured["adaptive_clip"] is None
            assert record["unchanged"][index]
            continue
        warm = measured["adaptive_clip"] is None
        assert warm == (index < config["warmup_steps"] + len([s for s in passed if s <= index]))
        if not warm:
            assert set(measured["adaptive_clip"]) == set(factors)
            for key, factor in factors.items():
                assert measured["adaptive_clip"][key] == pytest.approx(factor, rel=10 * TOLERANCE[dtype])
            clipped += sum(factor < 1.0 for factor in factors.values())
        want = {key: {stat: stats[stat] * factors[key] for stat in ("norm", "min", "max", "abs_max")}
                for key, stats in reference.items()}
        assert_close_stats(measured["post_clip"], want, 10 * TOLERANCE[dtype], stats=("norm", "min", "max"))
        if dtype == "fp32":  # low-precision weights round the update itself: its stats are post_clip's above
            assert_close_stats(record["applied"][index], want, APPLIED_TOLERANCE, stats=("norm", "min", "max"))
        checked += 1
    assert checked == case["steps"] - len(passed)
    assert clipped > 0  # the per-bucket rule did clip


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

    from deepspeed_patch.remedies import CHECKPOINT_KEY, UNIVERSAL_STATE, saved_state

    state = {"adaptive_clipping": {"steps": 3, "ema": {0: 0.5}}, "skip_step": {"losses": [1.0], "norms": [2.0]}}
    path = tmp_path / UNIVERSAL_STATE
    path.parent.mkdir()
    torch.save({CHECKPOINT_KEY: state, "param_groups": []}, path)
    assert saved_state(None, str(tmp_path)) == state
    assert saved_state(None, str(tmp_path / "elsewhere")) is None
    assert saved_state([{"other": 1}, {CHECKPOINT_KEY: state}], None) == state
