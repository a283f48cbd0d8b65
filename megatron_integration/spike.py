"""The spike section of ``report``: where in the model each fire of the trigger began, and in which signal.

A fire's recorded steps (``fires.read_fires``) hold every bucket's pre-clip gradient norm (the layers, and those
outside them by their names), and, with ``optimizer_statistics``, its update, update-to-weight ratio and Adam
moments; the log may hold more of each signal from before the recorded steps: the recorder's blocks
(``deepspeed_patch.spikes.recorder``) and the steps measured at the configured interval.

Each signal of each bucket is judged against its level just before a step (``judge``), not against the recorded
steps' own median, which a cause that began before them raises with the rest: a learning rate set too high and held
there leaves the update at its own median throughout the recorded steps. A level is the median of the observations
in the ``LEVEL_STEPS`` steps before: the recorder's blocks or the interval steps, whichever is denser where both
reach (``before``), and, from the second recorded step on, the recorded steps before it too. A signal that left its
level abruptly before the recorded steps, no further back than the horizon (``LOOK_BACK_RINGS``), and stayed away
from it up to them departed before them, at the first step the data show; else it departs at its first recorded
step above its ``THRESHOLDS`` ratio times its level, or non-finite. The gradient and its running averages share one
scale; Adam's moments are judged without their growth from zero (``MOMENTS``). Where the log holds fewer than
``MIN_BASELINE`` observations before the recorded steps, their own median is the last resort. Every judgement names
the baseline it used.

Which signal moved first (``attribute``, where the log holds the update or a moment): the earliest departure of any
signal of any bucket. A tie at one step goes to the gradient (the step's update follows from its gradient), then the
moments, then the update and its ratio to the weights (``SIGNALS``). The buckets whose same signal departed at that
step are counted: where one stands apart (``STANDS_APART``), it is named; where more than ``MOST_LAYERS`` of the
layers did, the answer says so: ``update of every layer (12 of 12) rose first, step 100``, ``gradient of layer 3
rose first (step 150)``. A fire whose first departure came at or before the previous fire continues it, and says
which (``localise_all``); a loss fire that does is one incident, said once, with its lead (``lead_steps``).

Where in the model the gradient rose (``localise``): the layers whose pre-clip norm went non-finite first, at or
before the fire (an overflow's origin); else the layer that rose most over its baseline and the first above
``RISE_THRESHOLD`` x it. The section's lines are wrapped at ``LINE_WIDTH``; ``report --json`` holds every detail.
"""

import math
import statistics
import textwrap
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from deepspeed_patch.outputs.tags import UPDATE_TO_WEIGHT, is_layer, layer_position

from .fires import Fire, read_fires
from .tensorboard_reader import Points, layer_title

THRESHOLDS = {"pre_clip": 2.0, "exp_avg": 2.0, "exp_avg_sq": 4.0, "update": 2.0, UPDATE_TO_WEIGHT: 2.0}
"""A signal departs above this many times its level. The gradient and its two running averages are on one scale:
2x the gradient's norm, which quiet training moves up to 1.6x against its level (``benchmarks/adam_dynamics.py``,
the table in docs/spikes.md); ``exp_avg`` averages the gradient (2x), ``exp_avg_sq`` its square (2x squared: 4x).
A running average is then named ahead of the gradient it averages only where it rose past the gradient's own
threshold first. The update and its ratio to the weights (Adam's normalised step: up to 1.1x in quiet training, 2.9x
for a 3x learning rate) are on the same scale, 2x: at 1.5x they were named ahead of the gradient on 24 of the
natural suite's 56 fires whose independent ground truth has the gradient first (``benchmarks/natural_spikes.py``); at
2x the report agrees with that truth on 42 of 56 (22 at 1.5x)."""
RISE_THRESHOLD = THRESHOLDS["pre_clip"]
"""A layer's gradient has risen at a step once its norm there is above this many times its own baseline."""
MIN_BASELINE = 3
"""The fewest finite observations that make a baseline: the median of one or two steps is a single noisy step."""
LEVEL_STEPS = 16
"""A signal's level before the recorded steps (or before an observation) is the median of its observations in the
16 steps before it, and at least of the last ``MIN_BASELINE``: recent, so that a slow drift is followed, and a step
change is not averaged away."""
LOOK_BACK_RINGS = 4
"""The horizon: no cause is dated more than 4 rings before its fire, 4 x the fire's recorded steps (K, the ring's
size, ``trigger.history``, once the ring is full). The trigger fires again at most ``cooldown`` steps (by default
``max(capture_steps + 1, K)``) after its last fire while a spike lasts, and its running median absorbs a raised
level within its ``window``: a cause that began further back and still lasts has had its own fire, which this one
continues (``continues``) or, beyond the horizon, is judged at its level, not as a departure. Four rings hold the
demo's lr spike's second fire (21 steps after its cause, K = 8) and stay within the recorder's 8 blocks before the
recorded steps."""
MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's running averages, which grow from zero: ``1 - beta ** t`` of their level at step t, bias-uncorrected.
For every beta, ``(1 - beta ** b) / (1 - beta ** a) <= b / a``: their values are judged divided by their step
(``_without_growth``), so that a moment growing from zero is not a departure, whatever its beta."""
SIGNALS = ("pre_clip", "exp_avg", "exp_avg_sq", "update", UPDATE_TO_WEIGHT)
"""The signals ``attribute`` compares, in the order that breaks a tie at one step."""
SIGNAL_NAMES = {"pre_clip": "gradient", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "update": "update",
                UPDATE_TO_WEIGHT: "update-to-weight ratio"}
MOST_LAYERS = 0.5
"""A first departure shared by more than this share of the judged layers at one step is the model's, not a
layer's: ``update of every layer (12 of 12) rose first``."""
STANDS_APART = 2.0
"""A layer whose departure is at least this many times the next largest at the same step, of the same signal, is
named alone, whatever the others did: a gradient spike injected into one layer, the others' gradients moved by its
loss."""


@dataclass(frozen=True)
class Observation:
    """A signal's norm before the recorded steps: one interval step (``first == last``), or a recorder block's root
    mean square over steps ``first`` to ``last``."""

    first: int
    last: int
    value: float
    source: str
    """``"recorder"`` (a block), ``"interval"`` (a measured step) or ``"recorded"`` (a recorded step)."""


@dataclass(frozen=True)
class Baseline:
    """The level a signal of a layer is judged against, and what it was taken from."""

    level: float
    source: str
    """``"recorder"``, ``"interval"``, ``"recent"`` (the steps just before a recorded step, recorded ones among
    them), or ``"recorded"``: the recorded steps' median, the last resort."""
    steps: Tuple[int, int]
    count: int

    def describe(self) -> str:
        """``against interval steps 92-99``, ``against its recorder blocks (steps 61-92) before the recorded
        steps``, ``against the recorded steps' median``."""
        first, last = self.steps
        if self.source == "recorded":
            return "against the recorded steps' median"
        if self.source == "recent":
            return f"against steps {first}-{last} just before it"
        if self.source == "interval":
            return f"against interval steps {first}-{last}"
        return f"against its recorder blocks (steps {first}-{last}) before the recorded steps"

    @property
    def noun(self) -> str:
        return "its median" if self.source == "recorded" else "its level before the recorded steps"


def rise_over(value: float, baseline: float) -> float:
    """``value`` over ``baseline``. Over a zero baseline, a positive norm is an infinite rise and a zero norm
    no rise (1x); a NaN norm or baseline gives NaN."""
    if math.isnan(value) or math.isnan(baseline):
        return math.nan
    if baseline > 0:
        return value / baseline
    return math.inf if value > 0 else 1.0


def before(fire: Fire, signal: str, layer) -> List[Observation]:
    """A signal's observations before the recorded steps, in step order: the interval steps where they are at least as
    dense as the recorder's blocks over the steps the blocks cover, else the blocks; beyond the blocks' steps, the
    interval steps."""
    blocks = [Observation(first, last, value, "recorder") for first, last, value in
              fire.blocks.get(signal, {}).get(layer, [])]
    steps = [Observation(step, step, value, "interval")
             for step, value in fire.interval.get(signal, {}).get(layer, [])]
    if not blocks:
        return steps
    start, end = blocks[0].first, blocks[-1].last
    inside = [point for point in steps if start <= point.first <= end]
    if len(inside) >= len(blocks):
        return steps
    return [point for point in steps if point.first < start] + blocks + [point for point in steps if point.first > end]


def _median_of(observations: Sequence[Observation]) -> Optional[Baseline]:
    finite = [seen for seen in observations if math.isfinite(seen.value)]
    if len(finite) < MIN_BASELINE:
        return None
    sources = {seen.source for seen in finite}
    source = "recent" if "recorded" in sources else "recorder" if "recorder" in sources else "interval"
    return Baseline(statistics.median(seen.value for seen in finite), source, (finite[0].first, finite[-1].last),
                    len(finite))


def recorded_baseline(points: Points, fired_at: int) -> Optional[Baseline]:
    """The median of the recorded steps' finite values before ``fired_at`` (``None`` with fewer than
    ``MIN_BASELINE``)."""
    earlier = [value for step, value in points if step < fired_at and math.isfinite(value)]
    if len(earlier) < MIN_BASELINE:
        return None
    return Baseline(statistics.median(earlier), "recorded", (points[0][0], fired_at - 1), len(earlier))


def level_before(observed: Sequence[Observation]) -> Optional[Baseline]:
    """The median of the observations in the ``LEVEL_STEPS`` steps up to the last of ``observed``, and at least of
    the last ``MIN_BASELINE``; ``None`` with fewer than ``MIN_BASELINE`` finite ones."""
    if not observed:
        return None
    end = observed[-1].last
    recent = [seen for seen in observed if seen.last > end - LEVEL_STEPS]
    return _median_of(recent if len(recent) >= MIN_BASELINE else observed[-MIN_BASELINE:])


def baseline_of(points: Points, observed: Sequence[Observation], fired_at: int) -> Optional[Baseline]:
    """A signal's level before the recorded steps (``level_before``), or the recorded steps' median where fewer
    than ``MIN_BASELINE`` observations before them are finite; ``None`` where neither can be taken."""
    return level_before(observed) or recorded_baseline(points, fired_at)


def judge(points: Points, observed: Sequence[Observation], fired_at: int, threshold: float,
          horizon: Optional[int] = None) -> Dict:
    """One signal of one layer: its ``baseline`` and its ``departure`` (``None`` where it did not depart, or has no
    baseline): ``step``, ``steps`` (the observation's, a block's range before the recorded steps), ``way``
    (``"rose"`` or ``"went non-finite"``), ``rise`` over the level, ``before_recorded`` and ``baseline`` (its
    ``describe``).

    Before the recorded steps, from step ``horizon`` on (``LOOK_BACK_RINGS``), a departure is abrupt and lasting: an
    observation above ``threshold`` times both its level (``level_before`` the observations just before it) and the
    one before it, or non-finite, that persists up to the recorded steps: every later observation and the first
    recorded step away from that level too, and, where it rose, the recorded steps' median still above ``threshold``
    times it (a slow drift is not abrupt; a past episode that ended, an fp16 overflow the loss scaler skipped, does
    not last). Among the recorded steps, the first above ``threshold`` times the level just before it
    (``level_before`` the observations and the recorded steps before it: a drift among them is followed), or
    non-finite. Against the recorded steps' median, only a step after one within those bounds counts: steps recorded
    at the start of training, where the second moment grows from zero, have it reach its median, not leave it."""
    early = _left_before(points, observed, fired_at, threshold, horizon)
    if early is not None:
        return early
    baseline = baseline_of(points, observed, fired_at)
    if baseline is None:
        return {"baseline": None, "departure": None}
    reached = baseline.source != "recorded"
    recorded = [Observation(step, step, value, "recorded") for step, value in points]
    for index, (step, value) in enumerate(points):
        level = baseline if baseline.source == "recorded" else level_before(list(observed) + recorded[:index])
        way = _away(value, level.level, threshold)
        if way is None:
            reached = True
        elif reached:
            return {"baseline": baseline, "departure": {
                "step": step, "steps": [step, step], "way": way, "rise": _departure_rise(value, level.level),
                "before_recorded": False, "baseline": level.describe()}}
    return {"baseline": baseline, "departure": None}


def _left_before(points: Points, observed: Sequence[Observation], fired_at: int, threshold: float,
                 horizon: Optional[int]) -> Optional[Dict]:
    """The first abrupt departure before the recorded steps, from step ``horizon`` on, that lasts up to them
    (``judge``), with the level it left."""
    recorded = [value for step, value in points if step <= fired_at]
    finite_recorded = [value for value in recorded if math.isfinite(value)]
    recorded_level = statistics.median(finite_recorded) if finite_recorded else math.nan
    for index, seen in enumerate(observed):
        if horizon is not None and seen.first < horizon:
            continue
        level = level_before(observed[:index])
        previous = next((earlier.value for earlier in reversed(observed[:index]) if math.isfinite(earlier.value)),
                        None)
        if level is None or previous is None:
            continue
        way = _away(seen.value, level.level, threshold)
        if way is None or (way == "rose" and seen.value <= threshold * previous):
            continue
        later = [after.value for after in observed[index + 1:]] + recorded[:1]
        lasting = all(_away(value, level.level, threshold) for value in later)
        if way == "rose":
            lasting = lasting and rise_over(recorded_level, level.level) > threshold
        if lasting:
            return {"baseline": level, "departure": {
                "step": seen.first, "steps": [seen.first, seen.last], "way": way,
                "rise": _departure_rise(seen.value, level.level), "before_recorded": True,
                "baseline": level.describe()}}
    return None


def _away(value: float, level: float, threshold: float) -> Optional[str]:
    """``"went non-finite"``, ``"rose"`` above ``threshold`` x ``level``, or ``None`` within."""
    if not math.isfinite(value):
        return "went non-finite"
    return "rose" if rise_over(value, level) > threshold else None


def _departure_rise(value: float, level: float) -> float:
    """A departure's ``rise`` over its level: ``rise_over``, infinite for a non-finite value."""
    return math.inf if not math.isfinite(value) else rise_over(value, level)


def _rise(fire: Fire, layer) -> Dict:
    """One layer's gradient against its baseline (``baseline_of``): its rise at its finite steps, the first above
    ``RISE_THRESHOLD``, and its first non-finite step up to the fire."""
    points = fire.norms[layer]
    found = baseline_of(points, before(fire, "pre_clip", layer), fire.fired_at)
    level = math.nan if found is None else found.level
    rises = [(step, rise_over(value, level)) for step, value in points if math.isfinite(value) and found]
    peak_step, peak = max(rises, key=lambda rise: rise[1], default=(None, math.nan))  # ties: the earliest
    first = next((step for step, rise in rises if rise > RISE_THRESHOLD), None)
    nonfinite = next((step for step, value in points if step <= fire.fired_at and not math.isfinite(value)), None)
    earlier = sum(1 for step, value in points if step < fire.fired_at and math.isfinite(value))
    return {"baseline": level, "baseline_from": None if found is None else found.describe(),
            "baseline_noun": "its median" if found is None else found.noun, "baseline_points": earlier,
            "rise_at_fire": rise_over(dict(points).get(fire.fired_at, math.nan), level), "peak_rise": peak,
            "peak_step": peak_step, "first_risen": first, "first_nonfinite": nonfinite}


def localise(fire: Fire, earlier: Optional[Dict] = None) -> Dict:
    """Each layer's rise, the layers that went non-finite first, rose most and rose first, which signal moved
    first (``attribution``: ``None`` without the update or a moment in the log), and the one-line answer.
    ``earlier``: the previous fire's ``localise``, which this fire continues where its first departure came at or
    before that fire. A layer non-finite at or before the fire is named before any rise: its rise cannot be
    measured, and the others' rises may be its consequence."""
    layers = {layer: _rise(fire, layer) for layer, points in fire.norms.items() if points}
    steps = sorted({step for points in fire.norms.values() for step, _ in points})
    broken = {layer: rise["first_nonfinite"] for layer, rise in layers.items() if rise["first_nonfinite"] is not None}
    nonfinite_step = min(broken.values()) if broken else None
    judged = {layer: rise for layer, rise in layers.items() if not math.isnan(rise["peak_rise"])}
    most = max(judged, key=lambda layer: (judged[layer]["peak_rise"], -judged[layer]["peak_step"]), default=None)
    risen = {layer: rise["first_risen"] for layer, rise in judged.items() if rise["first_risen"] is not None}
    first_step = min(risen.values()) if risen else None
    first = sorted((layer for layer, step in risen.items() if step == first_step),
                   key=lambda layer: -judged[layer]["peak_rise"])
    spike = {"fired_at": fire.fired_at, "reason": fire.reason, "steps": [steps[0], steps[-1]] if steps else [],
             "layers": layers, "nonfinite_first": [layer for layer, step in broken.items() if step == nonfinite_step],
             "nonfinite_step": nonfinite_step, "rose_most": most, "rose_first": first, "first_step": first_step,
             "attribution": attribute(fire, earlier) if fire.buckets else None}
    claim = (spike["attribution"] or {}).get("verdict")
    spike["lead_steps"] = _lead_steps(fire, claim)
    head = f"spike at step {fire.fired_at}" + (f" ({fire.reason})" if fire.reason else "")
    said = _incident(spike, claim) or "; ".join(
        part for part in ((spike["attribution"] or {}).get("answer"), _finding(spike, broken, claim)) if part)
    spike["answer"] = f"{head}: {said}"
    return spike


def _is_loss_fire(fire_reason: Optional[str]) -> bool:
    return bool(fire_reason) and fire_reason.startswith("loss")


def _lead_steps(fire: Fire, claim: Optional[Dict]) -> Optional[int]:
    """How many steps the first departure came before a loss fire (``trigger.loss_factor``): the precursor a user
    could have acted on; ``None`` for another fire, or one where no signal departed."""
    return fire.fired_at - claim["step"] if claim and _is_loss_fire(fire.reason) else None


def _incident(spike: Dict, claim: Optional[Dict]) -> Optional[str]:
    """A loss fire that continues an earlier fire, said once: ``the loss spiked at step 130, 2 steps after the
    gradient of every layer rose (step 128, the fire at step 128)``; ``None`` for any other fire."""
    if claim is None or claim["continues"] is None or spike["lead_steps"] is None:
        return None
    return (f"the loss spiked at step {spike['fired_at']}, {spike['lead_steps']} steps after the "
            f"{claim['signal_name']} of {claim['where']} {claim['way']} (step {claim['step']}, the fire at step "
            f"{claim['continues']})")


def localise_all(fires: Sequence[Fire]) -> List[Dict]:
    """``localise`` of each fire in step order, each told the one before it (a fire inside a sustained spike
    names the fire it continues)."""
    spikes: List[Dict] = []
    for fire in fires:
        spikes.append(localise(fire, spikes[-1] if spikes else None))
    return spikes


def _finding(spike: Dict, broken: Dict, claim: Optional[Dict]) -> str:
    """Where the gradient rose, in words that do not repeat nor contradict the ``claim`` (``verdict``) before it."""
    layers, most, first, first_step = spike["layers"], spike["rose_most"], spike["rose_first"], spike["first_step"]
    if not layers:
        return "no layer bucket was recorded (only buckets outside the layers, or none)"
    if broken:
        count = f"{len(broken)} of {len(layers)} layers non-finite by the fire"
        if claim and claim["way"] == "went non-finite" and claim["step"] == spike["nonfinite_step"]:
            return count
        return f"{_titles(spike['nonfinite_first'])} went non-finite first, at step {spike['nonfinite_step']} " \
            f"({count})"
    if most is None:
        longest = max(rise["baseline_points"] for rise in layers.values())
        return (f"the baseline is too short: at most {longest} finite norms of a layer before the fire, "
                f"{MIN_BASELINE} needed (a longer trigger.history keeps more)")
    rise = layers[most]
    if first_step is None:
        if claim and claim["before_recorded"]:
            return (f"no layer's gradient rose further in the recorded steps (above {RISE_THRESHOLD:g}x); largest: "
                    f"{layer_title(most)}, {rise['peak_rise']:.1f}x")
        return f"no layer's gradient rose above {RISE_THRESHOLD:g}x {rise['baseline_noun']}; most: {layer_title(most)}"
    zero = "median" if rise["baseline_noun"] == "its median" else "level"
    size = (f"from a zero {zero}" if math.isinf(rise["peak_rise"]) else
            f"{rise['peak_rise']:.1f}x {rise['baseline_noun']}")
    finding = f"{layer_title(most)} rose most, {size} at step {rise['peak_step']}"
    if first != [most] or first_step != rise["peak_step"]:
        finding += f"; first above {RISE_THRESHOLD:g}x: {_some_layers(first, len(layers))} at step {first_step}"
    return finding


def _some_layers(layers: List, of: int) -> str:
    """A few layers by name; more than ``MOST_LAYERS`` of ``of`` once, with the count: ``every layer (12 of 12)``,
    ``most layers (9 of 12)``; else more than 3 by their count: ``5 of 12 layers``."""
    if len(layers) > MOST_LAYERS * of:
        return f"{'every layer' if len(layers) == of else 'most layers'} ({len(layers)} of {of})"
    return _titles(layers) if len(layers) <= 3 else f"{len(layers)} of {of} layers"


def attribute(fire: Fire, earlier: Optional[Dict] = None) -> Optional[Dict]:
    """Which signal of which buckets left its level first (``judge``), per bucket (every layer, and those outside
    the layers by their names) and over the model, the first departure of each other signal after it
    (``followed``), and the ``verdict`` (``verdict``); ``None`` where the fire holds no update nor moment (a log
    without ``optimizer_statistics``)."""
    signals = [signal for signal in SIGNALS if fire.series.get(signal) or fire.outside.get(signal)]
    if signals in ([], ["pre_clip"]):
        return None
    horizon = horizon_of(fire)
    layers = {}
    for bucket in fire.buckets:
        departures = {}
        for signal in signals:
            points = fire.points(signal, bucket)
            if points:
                points, observed = _without_growth(signal, points, before(fire, signal, bucket))
                departures[signal] = judge(points, observed, fire.fired_at, THRESHOLDS[signal], horizon)["departure"]
        first = min((signal for signal, found in departures.items() if found),
                    key=lambda signal: _order(signal, departures[signal]), default=None)
        layers[bucket] = {"first": first, "departures": departures}
    moves = [(layer, signal, found) for layer, judged in layers.items()
             for signal, found in judged["departures"].items() if found]
    moves.sort(key=lambda move: _order(move[1], move[2]))  # stable: between equal departures, the shallower layer
    firsts = {}
    for layer, signal, found in moves:
        firsts.setdefault(signal, {"signal": signal, "layer": layer, **found})
    ordered = list(firsts.values())
    attribution = {"signals": signals, "layers": layers, "first": ordered[0] if ordered else None,
                   "followed": ordered[1:], "horizon": horizon}
    attribution["verdict"] = verdict(attribution, earlier)
    attribution["answer"] = _moved_first(attribution)
    return attribution


def horizon_of(fire: Fire) -> Optional[int]:
    """The earliest step a cause of ``fire`` may be dated: ``LOOK_BACK_RINGS`` times its recorded steps before it."""
    first, last = fire.recorded
    return None if first is None else fire.fired_at - LOOK_BACK_RINGS * (last - first + 1)


def _without_growth(signal: str, points: Points, observed: Sequence[Observation]) -> Tuple[Points, List[Observation]]:
    """A moment's (``MOMENTS``) values divided by their step (a block's by its middle step), which takes out its
    growth from zero whatever its beta; another signal's as they are."""
    if signal not in MOMENTS:
        return points, list(observed)
    return ([(step, value / max(step, 1)) for step, value in points],
            [replace(seen, value=seen.value / max((seen.first + seen.last) / 2, 1)) for seen in observed])


def _order(signal: str, found: Dict) -> tuple:
    """Departures in the order they are known to have come: by the last step of their observation (a recorder
    block's departure may have come at any of its steps), then ``SIGNALS``' order, then the larger first."""
    return found["steps"][1], found["step"], SIGNALS.index(signal), -found["rise"]


def verdict(attribution: Dict, earlier: Optional[Dict] = None) -> Optional[Dict]:
    """The first departure as a claim (``None`` where no signal departed): ``signal`` (the result's key:
    ``"update"``), ``signal_name`` (``"update"``), ``scope`` (``"layer"``: one bucket stands apart, a layer or one
    outside the layers; ``"every"`` or ``"most"``: more than ``MOST_LAYERS`` of the judged layers departed at that
    step, counted over the layers; ``"layers"``: a few, none apart), ``where`` (``"every layer"``, ``"most layers"``,
    ``"layer 3"``, ``"layers 2, 5"``, ``"the head bucket"``), ``layers`` (those
    that departed at that step, the largest departure first), ``count`` and ``of`` (of the layers judged in that
    signal), ``step``, ``steps``, ``way``, ``before_recorded``, ``baseline`` (which one it was judged against),
    ``continues`` (the step of the earlier fire it continues, or ``None``), ``words`` (``update of every layer (12
    of 12) rose first, step 100``) and ``line`` (the words and the baseline: the answer's start)."""
    first = attribution["first"]
    if first is None:
        return None
    signal, step = first["signal"], first["step"]
    found = {layer: judged["departures"][signal] for layer, judged in attribution["layers"].items()
             if judged["departures"].get(signal)}
    judged = [layer for layer, row in attribution["layers"].items() if signal in row["departures"]]
    together = sorted((layer for layer, move in found.items() if move["step"] == step),
                      key=lambda layer: -found[layer]["rise"])
    rises = [found[layer]["rise"] for layer in together]
    in_layers = [layer for layer in together if is_layer(layer)]
    judged_layers = [layer for layer in judged if is_layer(layer)]
    if len(together) == 1 or rises[0] >= STANDS_APART * rises[1]:
        scope, where = "layer", bucket_title(together[0])
        together = together[:1]
    elif len(in_layers) > MOST_LAYERS * len(judged_layers):
        scope = "every" if len(in_layers) == len(judged_layers) else "most"
        where = f"{scope} layer{'s' if scope == 'most' else ''}"
        together, judged = in_layers, judged_layers
    elif len(in_layers) == len(together):
        scope, where = "layers", "layers " + ", ".join(str(layer_position(layer)[1]) for layer in together)
        judged = judged_layers
    else:
        scope, where = "layers", _titles(together)
    continues = None
    if earlier is not None and step <= earlier["fired_at"]:
        continues = earlier["fired_at"]
    claim = {"signal": signal, "signal_name": SIGNAL_NAMES[signal], "scope": scope, "where": where,
             "layers": together, "count": len(together), "of": len(judged), "step": step, "steps": first["steps"],
             "way": first["way"], "before_recorded": first["before_recorded"], "baseline": first["baseline"],
             "continues": continues}
    claim["words"] = _claim_words(claim)
    claim["line"] = f"{claim['words']} {claim['baseline']}"
    return claim


def _claim_words(claim: Dict) -> str:
    """``update of every layer (12 of 12) rose first, step 100``; ``gradient of layer 3 rose first (step 150)``;
    then where it was before the recorded steps (the answer adds the baseline, ``line``; figure titles use these
    words)."""
    head = f"{claim['signal_name']} of {claim['where']}"
    if claim["scope"] == "layer":
        line = f"{head} {claim['way']} first (step {claim['step']})"
    else:
        line = f"{head} ({claim['count']} of {claim['of']}) {claim['way']} first, step {claim['step']}"
    if claim["before_recorded"]:
        first, last = claim["steps"]
        line += " before the recorded steps" + (f" (in steps {first}-{last})" if last != first else "")
    return line


def figure_words(spike: Dict) -> Optional[str]:
    """What a figure of the fire says moved first: the verdict's words (``verdict``) and the fire it continues;
    ``None`` where no signal left its level, or the log holds none but the gradient."""
    claim = (spike.get("attribution") or {}).get("verdict")
    if claim is None:
        return None
    continues = claim["continues"]
    return claim["words"] + ("" if continues is None else f"; continues the fire at step {continues}")


def _moved_first(attribution: Dict) -> Optional[str]:
    """The verdict's line, the first departure of each other signal after it, and the fire it continues:
    ``update of every layer (12 of 12) rose first, step 100 against interval steps 92-99, gradient followed (step
    101)``; ``None`` where no signal left its level."""
    claim, followers = attribution["verdict"], attribution["followed"]
    if claim is None:
        return None
    answer = claim["line"]
    if not followers:
        answer += ", no other signal left its level"
    else:
        answer += f", {SIGNAL_NAMES[followers[0]['signal']]} followed (step {followers[0]['step']})"
        answer += "".join(f", then {SIGNAL_NAMES[move['signal']]} (step {move['step']})" for move in followers[1:])
    if claim["signal"] in ("update", UPDATE_TO_WEIGHT) and claim["scope"] in ("every", "most"):
        answer += ": this points at the optimizer step (the learning rate or its schedule)"
    if claim["continues"] is not None:
        answer += f"; continues the fire at step {claim['continues']}"
    return answer


def bucket_title(bucket) -> str:
    """``layer 3``, ``encoder layer 3``; a bucket outside the layers by its name: ``the head bucket``."""
    return layer_title(bucket) if is_layer(bucket) else f"the {bucket} bucket"


def _titles(layers: List) -> str:
    return ", ".join(bucket_title(layer) for layer in layers)


def spike_summaries(source: str) -> List[Dict]:
    """``localise_all`` of the fires recorded in ``source``; empty without a recorder's fire."""
    return localise_all(read_fires(source))


def verdicts(source: str) -> List[Optional[Dict]]:
    """The claim of each fire recorded in ``source`` (``verdict``), in step order: ``None`` for a fire where no
    signal left its level, or whose log holds the gradient alone."""
    return [(spike["attribution"] or {}).get("verdict") for spike in spike_summaries(source)]


def spiked_layers(spikes: List[Dict]) -> List:
    """The layer that rose most at each fire (``localise``), each once."""
    return list(dict.fromkeys(spike["rose_most"] for spike in spikes if spike["rose_most"] is not None))


def format_spikes(spikes: List[Dict], shown: int = 5) -> str:
    """The spike section: per fire, the layers that went non-finite, then the ``shown`` layers that rose most, the
    ``shown`` layers whose signals left their level first (with the optimizer's statistics in the log), and the
    answer."""
    lines = []
    for spike in spikes:
        steps = f"recorded steps {spike['steps'][0]}-{spike['steps'][1]}" if spike["steps"] else "no step recorded"
        lines.append(f"spike: the trigger fired at step {spike['fired_at']}, {steps}; pre-clip norm over each "
                     "layer's baseline:")
        for layer, rise in sorted(spike["layers"].items(), key=_rank)[:shown]:
            lines.append(f"  {layer_title(layer):>16}: {_row(rise)}")
        if spike["attribution"]:
            lines += _attribution_lines(spike["attribution"], shown)
        lines.append(spike["answer"])
    return "\n".join(wrapped(lines))


LINE_WIDTH = 120
"""The report's lines are at most this long: longer ones wrap, their continuation indented."""


def wrapped(lines: Sequence[str]) -> List[str]:
    """``lines`` wrapped at ``LINE_WIDTH``, each continuation indented 4 more than its line, words kept whole."""
    found = []
    for line in (part for text in lines for part in text.split("\n")):
        indent = " " * (len(line) - len(line.lstrip(" ")))
        found += textwrap.wrap(line, LINE_WIDTH, subsequent_indent=indent + "    ", break_long_words=False,
                               break_on_hyphens=False) or [line]
    return found


def _attribution_lines(attribution: Dict, shown: int) -> List[str]:
    """Per layer, the signal that left its level first, and the step each signal did (``-``: it did not), the
    ``shown`` layers that moved first."""
    rules = ", ".join(f"{SIGNAL_NAMES[signal]} {THRESHOLDS[signal]:g}x" for signal in attribution["signals"])
    lines = [f"which signal left its level first (above: {rules}; or non-finite), per layer:"]
    for layer, judged in sorted(attribution["layers"].items(), key=_first_move)[:shown]:
        first = judged["first"]
        found = judged["departures"].get(first)
        head = f"{SIGNAL_NAMES[first]} {found['way']} at step {found['step']}" if first else "none"
        steps = ", ".join(f"{SIGNAL_NAMES[signal]} {'-' if move is None else move['step']}"
                          for signal, move in judged["departures"].items())
        lines.append(f"  {layer_title(layer):>16}: {head} ({steps})")
    return lines


def _first_move(item) -> tuple:
    """The layer whose first departure came first (``_order``) before the others; those that did not move last."""
    judged = item[1]
    first = judged["first"]
    return (first is None, ) + (_order(first, judged["departures"][first]) if first else ())


def _rank(item) -> tuple:
    """Non-finite layers first, earliest first; then the largest rise; then the layers with no baseline."""
    rise = item[1]
    broken = rise["first_nonfinite"]
    return (broken is None, broken or 0, -_sortable(rise["peak_rise"]))


def _row(rise: Dict) -> str:
    if math.isnan(rise["baseline"]):
        row = f"baseline too short ({rise['baseline_points']} finite norms before the fire, {MIN_BASELINE} needed)"
    else:
        first = rise["first_risen"]
        above = f"never above {RISE_THRESHOLD:g}x" if first is None else f"above {RISE_THRESHOLD:g}x from step {first}"
        row = (f"{rise['peak_rise']:8.2f}x at step {rise['peak_step']}, {rise['rise_at_fire']:8.2f}x at the fire, "
               f"{above} {rise['baseline_from']}")
    if rise["first_nonfinite"] is not None:
        row += f"; non-finite from step {rise['first_nonfinite']}"
    return row


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value
