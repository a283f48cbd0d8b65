"""Issue 44's natural-spike suite (``benchmarks/natural_spikes.py``): its ground-truth rule on series whose first
departure is known, and (extended) a short run of Adam's slingshot under ZeRO-2 on 2 CPU ranks whose fires the
report and the ground truth judge alike.

The ground truth is checked against DeepSpeed's own state (``safe_get_full_optimizer_state``), not the package."""

import math
import os
import sys
from typing import Dict, List

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import natural_spikes as ns  # noqa: E402
from spike_mechanisms import MECHANISMS, RunSpec, StepHooks, bucket_norms, train  # noqa: E402

BUCKETS = ("embedding", "0", "1", "head")


def quiet_truth(steps: int) -> List[Dict]:
    """Truth lines of a quiet run: every signal of every bucket flat (a small ripple), the loss flat."""
    lines = []
    for step in range(1, steps + 1):
        ripple = 1.0 + 0.05 * math.sin(step)
        line = {"step": step, "loss": 1.0 * ripple}
        for signal in (*ns.SIGNALS, "param"):
            line[signal] = {bucket: ripple for bucket in BUCKETS}
        lines.append(line)
    return lines


def test_the_gradient_of_the_bucket_that_left_first_is_named_with_its_lead_time():
    truth = quiet_truth(120)
    for step in range(90, 100):
        truth[step - 1]["grad"]["1"] *= 5.0  # layer 1's gradient from step 90
    for step in range(91, 100):
        truth[step - 1]["exp_avg"]["1"] *= 3.0  # its moment one step later
    for step in range(94, 97):
        truth[step - 1]["loss"] *= 10.0  # the loss jumps at 94
    answer = ns.truth_answer(truth, fired_at=95)
    assert answer["loss_spike"] == 94
    assert answer["first"]["signal"] == "grad" and answer["first"]["buckets"] == ["1"]
    assert answer["first"]["step"] == 90 and answer["lead"] == 4


def test_a_bucket_outside_the_layers_is_judged():
    truth = quiet_truth(120)
    for step in range(92, 100):
        truth[step - 1]["grad"]["head"] *= 4.0
        truth[step - 1]["loss"] *= 10.0
    assert ns.truth_answer(truth, fired_at=92)["first"]["buckets"] == ["head"]


def test_a_departure_before_the_look_back_is_not_a_cause():
    truth = quiet_truth(160)
    for step in range(100, 160):
        truth[step - 1]["update"]["0"] *= 3.0  # a new level from step 100, long before the spike
    for step in range(140, 143):
        truth[step - 1]["exp_avg_sq"]["embedding"] *= 3.0
        truth[step - 1]["loss"] *= 10.0
    answer = ns.truth_answer(truth, fired_at=140)
    assert answer["first"]["signal"] == "exp_avg_sq" and answer["first"]["step"] == 140
    assert answer["lead"] is None  # no gradient left its level in the look-back


def test_at_one_step_the_gradient_comes_before_the_moments_and_the_update():
    truth = quiet_truth(120)
    for signal in ("update", "exp_avg", "grad"):
        truth[99][signal]["0"] *= 3.0
    truth[99]["loss"] *= 10.0
    assert ns.truth_answer(truth, fired_at=100)["first"]["signal"] == "grad"


def test_agreement_needs_the_signal_a_bucket_and_the_step_and_names_each_difference():
    first = {"signal": "grad", "buckets": ["1", "head"], "rises": [5.0, 3.0], "step": 90}
    claim = {"signal": "pre_clip", "layers": [1], "step": 91}
    assert ns.agreement(claim, first, fired_at=95) == (True, "")
    assert ns.agreement({**claim, "signal": "exp_avg"}, first, fired_at=95) == (
        False, "signal (exp_avg, the truth's grad: a running average named ahead of the gradient)")
    assert ns.agreement({**claim, "layers": [0], "step": 85}, first, fired_at=95) == (
        False, "bucket; step (85, the truth's 90)")
    assert ns.agreement({**claim, "step": 40}, {**first, "buckets": ["head"]}, fired_at=95) == (
        False, "bucket (the truth's are outside the layers); step (dated 55 steps before its fire, beyond the "
        "look-back)")
    assert ns.agreement(None, first, fired_at=95) == (False, "no answer")


def test_a_fire_that_continues_an_earlier_one_of_the_same_loss_spike_is_judged_by_its_claim(monkeypatch, tmp_path):
    truth = quiet_truth(140)
    for step in range(100, 110):
        truth[step - 1]["grad"]["0"] *= 5.0
        truth[step - 1]["loss"] *= 10.0 if step > 101 else 1.0  # the loss jumps at 102
    claim = {"signal": "pre_clip", "layers": [0], "step": 100, "continues": None}
    answers = [{"fired_at": 100, "claim": claim}, {"fired_at": 117, "claim": {**claim, "step": 40, "continues": 100}},
               {"fired_at": 130, "claim": {**claim, "continues": 117}}]
    monkeypatch.setattr(ns, "read_truth", lambda path: truth)
    monkeypatch.setattr(ns, "report_answers", lambda path: answers)
    rows = ns.evaluate_run(str(tmp_path / "slingshot-3"))
    assert [(row["judged_by"], row["agree"]) for row in rows] == [(100, True), (100, True), (130, False)]
    assert rows[2]["loss_spike"] is None and rows[2]["why"] == "the truth found no departure"


# ---------------------------------------------------------------- a real run (extended)

SLINGSHOT = MECHANISMS["slingshot"]
STEPS = 470
SEED = 0
"""Seed 0 spikes first near step 448 here (benchmarks/results/natural_spikes.md): a grad-norm fire, then the loss's
(two fires judged, on this machine); the run takes 4-6 minutes on 2 shared cores."""
CHECKED_STEPS = (1, 50, STEPS)


class StateSnapshots(StepHooks):
    """DeepSpeed's own Adam moments per bucket (``safe_get_full_optimizer_state``) at ``CHECKED_STEPS``, for the
    ground truth's check."""

    def __init__(self) -> None:
        self.seen: Dict[int, Dict[str, Dict[str, float]]] = {}

    def after_step(self, step: int, engine) -> None:
        from deepspeed.utils import safe_get_full_optimizer_state

        if step in CHECKED_STEPS:
            named = list(engine.module.named_parameters())
            self.seen[step] = {kind: bucket_norms({name: safe_get_full_optimizer_state(param, kind)
                                                   for name, param in named}) for kind in ("exp_avg", "exp_avg_sq")}


def _run(outdir: str):
    import torch

    import deepspeed_patch

    deepspeed_patch.install()
    torch.set_num_threads(1)
    hooks = StateSnapshots()
    record = train(RunSpec(SLINGSHOT, SEED, outdir, steps=STEPS), hooks)
    return record, hooks.seen


@pytest.fixture(scope="module")
def early_run(tmp_path_factory):
    from megatron_integration.cpu_launch import launch

    outdir = str(tmp_path_factory.mktemp("natural") / f"slingshot-{SEED}")
    record, seen = launch(_run, ns.WORLD_SIZE, outdir, timeout=1800)[0]
    return outdir, record, seen


@pytest.mark.extended
def test_the_ground_truth_s_moments_are_deepspeed_s(early_run):
    """At step 1 ``exp_avg`` is ``1 - beta1`` times the gradient: the truth's gradient is checked with it."""
    outdir, _, seen = early_run
    truth = ns.read_truth(os.path.join(outdir, "truth.jsonl"))
    checked = 0
    for step, kinds in seen.items():
        for kind, buckets in kinds.items():
            for bucket, norm in buckets.items():
                assert truth[step - 1][kind][bucket] == pytest.approx(norm, rel=1e-5)
                checked += 1
    assert checked == len(CHECKED_STEPS) * 2 * 6  # 6 buckets: 2 layers, embeddings, final norm, head


CLEAR_OF_NOISE = 2.5
"""A truth whose first departure rose above this stands clear of its rule's noise: over the suite's quiet steps
a bucket's gradient passes 2x its level once in about 400 bucket-steps, 2.5x once in about 1,700
(``benchmarks/results/natural_spikes.md``), so a 16-step look-back over 6 buckets holds a 2x noise departure about
one time in four, a 2.5x one about one time in eighteen."""


@pytest.mark.extended
def test_the_report_names_the_truth_s_signal_on_every_fire_and_agrees_where_the_truth_is_clear(early_run):
    """Issue 44's target, on a short slingshot run (fires at steps 446 and 463, one loss spike). Before its fixes to
    the answer (a bounded look-back, one scale, every bucket judged) the report dated fire 446's cause at step 40,
    the update's, where the truth has the gradient of layer 1 at step 441. The signal must agree on every fire; the
    buckets and step too where the truth's departure stands clear of its noise (``CLEAR_OF_NOISE``): here the
    truth's is at 2.1x, within it, and the report names the gradient of layers 0 and 1 at step 446."""
    outdir, record, _ = early_run
    rows = ns.evaluate_run(outdir)
    assert [row["fired_at"] for row in rows] == record["fires"]
    spiked = [row for row in rows if row["loss_spike"] is not None]
    assert len(spiked) >= 1, rows
    signals = [(row["fired_at"], row["answer"], ns._truth_cell(row["first"])) for row in spiked
               if "signal" in row["why"] or row["first"] is None]
    assert not signals, signals
    clear = [row for row in spiked if max(row["first"]["rises"]) >= CLEAR_OF_NOISE]
    disagreements = [(row["fired_at"], row["answer"], ns._truth_cell(row["first"])) for row in clear
                     if not row["agree"]]
    assert not disagreements, disagreements
    assert len(spiked) == len(record["fires"]) == 2 and len(clear) == 0  # the run as recorded; fails if it changes
