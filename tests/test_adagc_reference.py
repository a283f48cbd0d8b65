"""``adaptive_clipping`` with ``granularity: "param"`` step by step against an independent implementation of AdaGC:
pytorch-optimizer's ``AdaGC`` (per tensor, inside its own Adam), on one rank under ZeRO-2 fp32 with torch's AdamW.
The extended tier: the suite checks the same rule against this project's own plain-PyTorch AdaGC
(``test_remedies.py``).

What is compared, step by step (adagc_reference_workers.py runs both):

- each parameter's factor: pytorch-optimizer's global clip coefficient in the warm-up (the result's ``clip_coef``,
  DeepSpeed's global clipping), its per-tensor factor after it (the result's ``adaptive_clip``);
- each parameter's average: our ``ema``, its ``gamma``;
- the weights after the step, both sides starting the step from the same weights.

The differences, each named (docs/remedies.md):

- ``warmup_steps``: pytorch-optimizer warms up while its step ``t`` (from 1) is below ``warmup_steps``, the paper's
  ``t < T_start``; ours counts warm-up steps. The same schedule is its ``warmup_steps`` = ours + 1.
- The warm-up's global clip: DeepSpeed divides by ``(norm + 1e-6) / clip``, pytorch-optimizer multiplies by
  ``clip / (norm + eps)`` (eps 1e-8): a relative difference of about ``1e-6 / norm`` in the factor, which the
  warm-up's running minimum carries into every later average and factor (about 1e-6 here, within ``TOLERANCE``).
- Free-running, the weights part by more than rounding (2.7e-4 after the second step, 1.6e-3 after the tenth here):
  Adam divides each gradient element by its own root mean square, so a rounding difference in the weights, through
  the next gradient, moves the update of elements whose gradient is near zero by a sizeable fraction of ``lr``. From
  the same weights the two updates agree to fp32 rounding; hence ``same_weights``.
- A parameter with a zero gradient: pytorch-optimizer moves ``gamma`` towards 0 (or takes 0 as the warm-up minimum),
  ours keeps its ``ema`` (a bucket with no gradient on a step is not evidence of a smaller norm). Not exercised here:
  every TinyGPT parameter has a gradient.
"""

import math
from functools import lru_cache

import pytest
from adagc_reference_workers import ADAGC_CASE, run_cases

from megatron_integration.cpu_launch import launch
from reference import TOLERANCE

pytest.importorskip("pytorch_optimizer", reason="pytorch-optimizer (the test extra) is the reference")

WEIGHT_TOLERANCE = 5e-7
"""Absolute, on weights of order 1 after one step from the same weights: a few fp32 ulps (2.4e-7 measured)."""
CASES = {"z2_fp32": {"stage": 2}}


@lru_cache(maxsize=None)
def records():
    return launch(run_cases, 1, CASES)[0]


def relative(ours: float, theirs: float) -> float:
    return abs(ours - theirs) / abs(theirs)


@pytest.mark.extended  # its 1-rank launch costs about 29 CPU seconds; test_remedies.py checks AdaGC in the suite
@pytest.mark.parametrize("name", CASES)
def test_adaptive_clipping_per_param_is_pytorch_optimizers_adagc(name):
    record = records()[name]
    assert "error" not in record, record["error"]
    warmup = ADAGC_CASE["adaptive"]["warmup_steps"]
    compared = clipped = 0
    for step, (ours, theirs) in enumerate(zip(record["deepspeed"], record["reference"]), start=1):
        assert set(theirs["factors"]) == set(theirs["ema"]) == set(ours["ema"]), step
        if step <= warmup:
            assert ours["factors"] is None, step
            expected = dict.fromkeys(theirs["factors"], ours["clip_coef"])
        else:
            assert ours["clip_coef"] == 1.0, step  # global clipping suspended
            expected = ours["factors"]
        for key, factor in theirs["factors"].items():
            assert relative(expected[key], factor) < TOLERANCE["fp32"], (step, key, expected[key], factor)
            assert relative(ours["ema"][key], theirs["ema"][key]) < TOLERANCE["fp32"], (step, key)
            compared += 1
            clipped += step > warmup and factor < 1
        for key, weight in record["weights"][step - 1].items():
            difference = (weight - record["reference_weights"][step - 1][key]).abs().max().item()
            assert difference < WEIGHT_TOLERANCE, (step, key, difference)
    parameters = len(record["reference"][0]["factors"])
    assert compared == ADAGC_CASE["steps"] * parameters
    # the comparison means something: the warm-up clipped globally, and AdaGC clipped tensors after it
    assert all(not math.isclose(step["clip_coef"], 1.0) for step in record["deepspeed"][:warmup])
    assert clipped >= parameters
