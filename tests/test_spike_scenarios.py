"""The report's spike answer on real runs with a known cause (issue 37, item 4): DeepSpeed ZeRO-2 on 2 CPU ranks,
a tiny Pre-LN GPT with AdamW, ``optimizer_statistics`` and the flight recorder, one fault injected at a known step
(tests/scenario_workers.py). Each fire is judged from the run's JSONL dump and from its TensorBoard logs, as
``layer-grad-norms report`` judges them (``spike_summaries``, ``format_spikes``), and the answer must name the
cause: the signal that left its level first, the layer (or every layer), and the step.

One launch runs every case (6 runs of 13 to 20 steps); the tier is ``extended`` (the launch took 9.5 minutes on 2
cores shared with other jobs). ``assert_answer`` is the one place the answers are checked.
"""

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Tuple, Union

import pytest

from megatron_integration.spike import format_spikes, spike_summaries
from scenario_workers import MODEL, TRIGGER, launch_runs

pytestmark = pytest.mark.extended

EVERY = "every layer"
LAYERS = MODEL.num_layers
FAULT_STEP = 12
"""The step of every fault but the lr held too high: after the trigger's warm-up, with 8 steps before it."""
HELD_FROM = 10
"""The step from which the lr is held too high; a measured step (the logs' interval, 5), so the logs show it."""
SKIP_TRIGGER = {**TRIGGER, "overflow_steps": 1}
"""A step the optimizer skips (fp16 overflow, and a NaN under ZeRO in fp32 too) fires at once, not after 3."""


@dataclass(frozen=True)
class Answer:
    """What the report must say moved first: the ``signal`` (``spike.SIGNAL_NAMES``' words), its ``scope`` (the
    layers named, or ``EVERY``), the ``step`` it left its level, and the ``way`` it did."""

    signal: str
    scope: Union[str, Tuple[int, ...]]
    step: int
    way: str = "rose"


@dataclass(frozen=True)
class Scenario:
    """A run (``scenario_workers.DEFAULT_RUN``'s overrides), the answer its report must give, and the first step
    whose fire is judged (the first fire at or after it)."""

    run: Dict
    answer: Answer
    judged_from: int = FAULT_STEP


SCENARIOS: Dict[str, Scenario] = {
    # the lr 1000x for 2 steps: every layer's update leaves its level at once, the gradients follow (the fire)
    "lr_jump": Scenario({"steps": 15, "faults": [{"kind": "lr", "step": FAULT_STEP, "until": FAULT_STEP + 2,
                                                  "factor": 1000}]},
                        Answer("update", EVERY, FAULT_STEP)),
    # the lr held 1000x from HELD_FROM: the gradient fires at once; the loss spike that fires after the cooldown
    # has its cause before its recorded steps, and is the fire judged
    "lr_held_too_high": Scenario({"steps": 20, "faults": [{"kind": "lr", "step": HELD_FROM, "factor": 1000}]},
                                 Answer("update", EVERY, HELD_FROM), judged_from=HELD_FROM + TRIGGER["history"] + 1),
    # every rank's batch one repeated token: every layer's gradient at that step
    "corrupted_batch": Scenario({"steps": 14, "faults": [{"kind": "batch", "step": FAULT_STEP}]},
                                Answer("gradient", EVERY, FAULT_STEP)),
    # layer 2's MLP input weights 2^16 times (an exponent bit flipped), model copy and fp32 master, every rank;
    # the global norm rises only 1.7x (measured), so this case's trigger fires at 1.5x (at 3x it never fires)
    "corrupted_weights": Scenario({"steps": 14, "trigger": {**TRIGGER, "grad_norm_factor": 1.5},
                                   "faults": [{"kind": "weights", "step": FAULT_STEP, "layer": 2,
                                               "param": "dense_h_to_4h.weight", "factor": 2.0**16}]},
                                  Answer("gradient", (2, ), FAULT_STEP)),
    # fp16: layer 2's gradient 2^20 times, beyond fp16's range: the loss scaler skips the step
    "fp16_overflow": Scenario({"steps": 13, "dtype": "fp16", "trigger": SKIP_TRIGGER,
                               "faults": [{"kind": "grad", "step": FAULT_STEP, "layer": 2, "factor": 2.0**20}]},
                              Answer("gradient", (2, ), FAULT_STEP, "went non-finite")),
    # one element of layer 1's gradient NaN on rank 1 only, before the ranks' reduction: ZeRO skips the step
    "nan_on_one_rank": Scenario({"steps": 13, "trigger": SKIP_TRIGGER,
                                 "faults": [{"kind": "nan", "step": FAULT_STEP, "layer": 1, "rank": 1}]},
                                Answer("gradient", (1, ), FAULT_STEP, "went non-finite")),
}


def fault_step(name: str) -> int:
    return min(fault["step"] for fault in SCENARIOS[name].run["faults"])


@lru_cache(maxsize=None)
def results_of(workdir: str) -> Dict:
    return launch_runs({name: scenario.run for name, scenario in SCENARIOS.items()}, workdir)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("scenarios"))


def record_of(workdir: str, name: str) -> Dict:
    record = results_of(workdir)[name]
    if "error" in record:
        pytest.fail(record["error"])
    return record


def judged_spike(source: str, name: str) -> Dict:
    """The report's spike section (``spike_summaries``) of the scenario's judged fire (``Scenario.judged_from``),
    checked to be in ``format_spikes``' text as ``report`` prints it."""
    spikes = spike_summaries(source)
    judged_from = SCENARIOS[name].judged_from
    after = [spike for spike in spikes if spike["fired_at"] >= judged_from]
    assert after, f"{name}: no fire at or after step {judged_from} in {source}: {spikes}"
    assert " ".join(after[0]["answer"].split()) in " ".join(format_spikes(spikes).split())  # lines wrap at 120
    return after[0]


def answer_pattern(expected: Answer) -> str:
    """The words of the answer: ``update of every layer (4 of 4) rose first, step 12`` or ``gradient of layer 2
    went non-finite first (step 12)`` (the step after a comma or in brackets); of a loss fire that continues an
    earlier fire, the incident: ``9 steps after the update of every layer rose (step 10, ...``."""
    if expected.scope == EVERY:
        scope = rf"every layer(?: \({LAYERS} of {LAYERS}\))?"
    else:
        scope = "layers? " + ", ".join(str(layer) for layer in expected.scope)
    return rf"\b{expected.signal} of {scope} {expected.way}(?: first,? \(?| \()step {expected.step}\b"


def assert_answer(spike: Dict, expected: Answer) -> None:
    """The one place the scenarios' answers are checked: the answer line names the signal, the scope and the step
    (``answer_pattern``), and the structured attribution agrees (signal, step, and the layer where one is
    named)."""
    assert re.search(answer_pattern(expected), spike["answer"]), (
        f"expected {expected}; the report says: {spike['answer']}")
    first = spike["attribution"]["first"]
    signal = {"gradient": "pre_clip"}.get(expected.signal, expected.signal)
    assert (first["signal"], first["step"], first["way"]) == (signal, expected.step, expected.way), first
    if expected.scope != EVERY:
        assert first["layer"] in expected.scope, first


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_fire_before_the_fault(workdir, name):
    """The trigger fires, and only once the fault is there: the fire judged has the injected cause."""
    record = record_of(workdir, name)
    assert record["fires"], f"{name}: the trigger never fired"
    assert min(record["fires"]) >= fault_step(name), record["fires"]


def test_the_lr_held_too_high_spikes_the_loss_after_the_recorded_steps(workdir):
    """The scenario's premise: a loss spike fires with the cause (the lr raised at HELD_FROM) before its recorded
    steps."""
    spike = judged_spike(record_of(workdir, "lr_held_too_high")["dump"], "lr_held_too_high")
    assert spike["reason"].startswith("loss"), spike["reason"]
    assert spike["steps"][0] > HELD_FROM, spike["steps"]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_report_names_the_cause(workdir, name):
    spike = judged_spike(record_of(workdir, name)["dump"], name)
    assert_answer(spike, SCENARIOS[name].answer)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_tensorboard_gives_the_dump_s_answer(workdir, name):
    """The same fire read from the Megatron hook's TensorBoard runs: the same signal, layer and step moved first
    (TensorBoard keeps no trigger reason, so the answers are compared from the signal on, and a loss fire's
    incident by its claim)."""
    record = record_of(workdir, name)
    from_dump, from_tensorboard = (judged_spike(source, name) for source in (record["dump"], record["tensorboard"]))
    assert from_tensorboard["fired_at"] == from_dump["fired_at"]
    claims = [spike["attribution"]["verdict"] for spike in (from_tensorboard, from_dump)]
    assert claims[0] == claims[1]
    if from_dump["lead_steps"] is None:  # a loss fire's incident needs the reason, which TensorBoard does not keep
        assert from_tensorboard["answer"].split(": ", 1)[1] == from_dump["answer"].split(": ", 1)[1]
    assert len(from_tensorboard["layers"]) == len(from_dump["layers"]) == LAYERS
