"""The spike section of ``report``: where in the model each fire of the trigger began, and in which signal.

A fire's recorded steps (``fires.read_fires``) hold every layer's pre-clip gradient norm, and, with
``optimizer_statistics``, its update and Adam moments.

Each layer is judged against itself: its baseline is the median of its finite pre-clip norms over the
window's steps before the fire (at least ``MIN_BASELINE`` of them, else it has none), and its rise at a step
is the norm over that baseline (over a zero baseline, any positive norm is an infinite rise). The answer names,
in this order: the layers whose norm went non-finite first, at or before the fire (an overflow's origin: the
others' rises may follow from it); else the layers that rose most (the largest rise in the window) and first
(the earliest step above ``RISE_FACTOR`` x the baseline); else why no layer can be judged (no layer bucket
recorded, a baseline too short).

Which signal moved first (``attribute``, where the log holds the update or a moment): each signal of each layer
(the gradient's pre-clip norm, the update's, ``exp_avg``'s, ``exp_avg_sq``'s) is judged against its own median
likewise, and departs at its first step above ``RISE_FACTOR`` x it or non-finite; ``exp_avg_sq`` also where it
falls below its median over ``RISE_FACTOR`` (second moments shrinking toward epsilon precede Adam's instability).
A step counts only after one within those bounds: a window at the start of training, where the second moment
grows from zero, has the second moment reach its median, not leave it.
The first departure names the signal and the layer; a tie at one step goes to the gradient (the step's update
follows from its gradient), then the moments, then the update (``SIGNALS``); between layers, to the larger
departure. The answer starts with it and what followed: ``update of layer 2 rose first (step 147), gradient
followed (step 150)``.
"""

import math
import statistics
from typing import Dict, List, Optional, Tuple

from .fires import Fire, read_fires
from .tensorboard_reader import Points, layer_title

RISE_FACTOR = 2.0
"""A layer has risen at a step once its norm there is above this many times its own baseline."""
MIN_BASELINE = 3
"""The fewest finite norms before the fire that make a layer's baseline: the median of one or two steps is
a single noisy step, not a baseline."""
SIGNALS = ("pre_clip", "exp_avg", "exp_avg_sq", "update")
"""The signals ``attribute`` compares, in the order that breaks a tie at one step."""
SIGNAL_NAMES = {"pre_clip": "gradient", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "update": "update"}
FALLING = ("exp_avg_sq", )
"""The signals that depart also by falling below their median over ``RISE_FACTOR``."""


def rise_over(value: float, baseline: float) -> float:
    """``value`` over ``baseline``. Over a zero baseline, a positive norm is an infinite rise and a zero norm
    no rise (1x); a NaN norm or baseline gives NaN."""
    if math.isnan(value) or math.isnan(baseline):
        return math.nan
    if baseline > 0:
        return value / baseline
    return math.inf if value > 0 else 1.0


def _baseline(points: Points, fired_at: int) -> Tuple[float, int]:
    """The median of a series' finite values before ``fired_at`` (NaN with fewer than ``MIN_BASELINE`` of them),
    and how many there are."""
    earlier = [value for step, value in points if step < fired_at and math.isfinite(value)]
    return statistics.median(earlier) if len(earlier) >= MIN_BASELINE else math.nan, len(earlier)


def _rise(points: Points, fired_at: int) -> Dict:
    """One layer against itself: its baseline (the median of its finite norms before ``fired_at``, NaN with
    fewer than ``MIN_BASELINE`` of them), its rise at its finite steps, and its first non-finite step up to
    the fire."""
    baseline, earlier = _baseline(points, fired_at)
    rises = [(step, rise_over(value, baseline)) for step, value in points
             if math.isfinite(value) and not math.isnan(baseline)]
    peak_step, peak = max(rises, key=lambda rise: rise[1], default=(None, math.nan))  # ties: the earliest
    first = next((step for step, rise in rises if rise > RISE_FACTOR), None)
    nonfinite = next((step for step, value in points if step <= fired_at and not math.isfinite(value)), None)
    return {"baseline": baseline, "baseline_points": earlier,
            "rise_at_fire": rise_over(dict(points).get(fired_at, math.nan), baseline), "peak_rise": peak,
            "peak_step": peak_step, "first_risen": first, "first_nonfinite": nonfinite}


def localise(fire: Fire) -> Dict:
    """Each layer's rise, the layers that went non-finite first, rose most and rose first, which signal moved
    first (``attribution``: ``None`` without the update or a moment in the log), and the one-line answer. A layer
    non-finite at or before the fire is named before any rise: its rise cannot be measured, and the others' rises
    may be its consequence."""
    layers = {layer: _rise(points, fire.fired_at) for layer, points in fire.norms.items() if points}
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
             "attribution": attribute(fire) if layers else None}
    head = f"spike at step {fire.fired_at}" + (f" ({fire.reason})" if fire.reason else "")
    moved = (spike["attribution"] or {}).get("answer")
    moved = f"{moved}; " if moved else ""
    spike["answer"] = f"{head}: {moved}{_finding(spike, broken)}"
    return spike


def _finding(spike: Dict, broken: Dict) -> str:
    layers, most, first, first_step = spike["layers"], spike["rose_most"], spike["rose_first"], spike["first_step"]
    if not layers:
        return "no layer bucket was recorded (only buckets outside the layers, or none)"
    if broken:
        return (f"{_titles(spike['nonfinite_first'])} went non-finite first, at step {spike['nonfinite_step']} "
                f"({len(broken)} of {len(layers)} layers non-finite by the fire)")
    if most is None:
        longest = max(rise["baseline_points"] for rise in layers.values())
        return (f"the baseline is too short: at most {longest} finite norms of a layer before the fire, "
                f"{MIN_BASELINE} needed (a longer trigger.history keeps more)")
    if first_step is None:
        return f"no layer rose above {RISE_FACTOR:g}x its median over the window; most: {layer_title(most)}"
    rise = layers[most]
    size = "from a zero median" if math.isinf(rise["peak_rise"]) else f"{rise['peak_rise']:.1f}x its median"
    finding = f"{layer_title(most)} rose most, {size} at step {rise['peak_step']}"
    if first != [most] or first_step != rise["peak_step"]:
        finding += f"; first above {RISE_FACTOR:g}x: {_titles(first)} at step {first_step}"
    return finding


def departure(points: Points, fired_at: int, falling: bool = False) -> Optional[Dict]:
    """Where a series left its own median before ``fired_at`` (``_baseline``): its ``step``, the ``way``
    (``"rose"`` above ``RISE_FACTOR`` x the median, ``"went non-finite"``, or, ``falling``, ``"fell"`` below the
    median over ``RISE_FACTOR``) and the ``factor`` away from the median; ``None`` where it never did, or has no
    baseline. Only a step after one within those bounds counts: a series that starts outside them (Adam's second
    moment growing from zero over the first steps, a gradient shrinking from its first size) has not reached its
    median yet, it has not left it."""
    baseline, _ = _baseline(points, fired_at)
    if math.isnan(baseline):
        return None
    reached = False
    for step, value in points:
        away = _away(value, baseline, falling)
        if away is None:
            reached = True
        elif reached:
            return {"step": step, **away}
    return None


def _away(value: float, baseline: float, falling: bool) -> Optional[Dict]:
    """How ``value`` is outside the bounds around ``baseline`` (``departure``), or ``None`` within them."""
    rise = rise_over(value, baseline)
    if not math.isfinite(value):
        return {"way": "went non-finite", "factor": math.inf}
    if rise > RISE_FACTOR:
        return {"way": "rose", "factor": rise}
    if falling and rise * RISE_FACTOR < 1:
        return {"way": "fell", "factor": 1 / rise if rise > 0 else math.inf}
    return None


def attribute(fire: Fire) -> Optional[Dict]:
    """Which signal of which layer left its own median first (``departure``), per layer and over the model, and
    the first departure of each other signal after it (``followed``); ``None`` where the fire holds no update nor
    moment (a log without ``optimizer_statistics``)."""
    signals = [signal for signal in SIGNALS if fire.series.get(signal)]
    if signals in ([], ["pre_clip"]):
        return None
    layers = {}
    for layer in fire.norms:
        departures = {signal: departure(fire.series[signal][layer], fire.fired_at, signal in FALLING)
                      for signal in signals if fire.series[signal].get(layer)}
        first = min((signal for signal, found in departures.items() if found),
                    key=lambda signal: _order(signal, departures[signal]), default=None)
        layers[layer] = {"first": first, "departures": departures}
    moves = [(layer, signal, found) for layer, judged in layers.items()
             for signal, found in judged["departures"].items() if found]
    moves.sort(key=lambda move: _order(move[1], move[2]))  # stable: between equal departures, the shallower layer
    firsts = {}
    for layer, signal, found in moves:
        firsts.setdefault(signal, {"signal": signal, "layer": layer, **found})
    ordered = list(firsts.values())
    attribution = {"signals": signals, "layers": layers, "first": ordered[0] if ordered else None,
                   "followed": ordered[1:]}
    attribution["answer"] = _moved_first(attribution)
    return attribution


def _order(signal: str, found: Dict) -> tuple:
    return found["step"], SIGNALS.index(signal), -found["factor"]


def _moved_first(attribution: Dict) -> Optional[str]:
    """``update of layer 2 rose first (step 147), gradient followed (step 150), then exp_avg (step 151)``;
    ``None`` where no signal left its median."""
    first, followers = attribution["first"], attribution["followed"]
    if first is None:
        return None
    answer = (f"{SIGNAL_NAMES[first['signal']]} of {layer_title(first['layer'])} {first['way']} first "
              f"(step {first['step']})")
    if not followers:
        return f"{answer}, no other signal left its median"
    then = "".join(f", then {SIGNAL_NAMES[move['signal']]} (step {move['step']})" for move in followers[1:])
    return f"{answer}, {SIGNAL_NAMES[followers[0]['signal']]} followed (step {followers[0]['step']}){then}"


def _titles(layers: List) -> str:
    return ", ".join(layer_title(layer) for layer in layers)


def spike_summaries(source: str) -> List[Dict]:
    """``localise`` of every fire recorded in ``source``; empty without a recorder's fire."""
    return [localise(fire) for fire in read_fires(source)]


def spiked_layers(spikes: List[Dict]) -> List:
    """The layer that rose most at each fire (``localise``), each once."""
    return list(dict.fromkeys(spike["rose_most"] for spike in spikes if spike["rose_most"] is not None))


def format_spikes(spikes: List[Dict], shown: int = 5) -> str:
    """The spike section: per fire, the layers that went non-finite, then the ``shown`` layers that rose most, the
    ``shown`` layers whose signals left their median first (with the optimizer's statistics in the log), and the
    answer."""
    lines = []
    for spike in spikes:
        steps = f"recorded steps {spike['steps'][0]}-{spike['steps'][1]}" if spike["steps"] else "no step recorded"
        lines.append(f"spike: the trigger fired at step {spike['fired_at']}, {steps}; pre-clip norm over each "
                     "layer's median before it:")
        for layer, rise in sorted(spike["layers"].items(), key=_rank)[:shown]:
            lines.append(f"  {layer_title(layer):>16}: {_row(rise)}")
        if spike["attribution"]:
            lines += _attribution_lines(spike["attribution"], shown)
        lines.append(spike["answer"])
    return "\n".join(lines)


def _attribution_lines(attribution: Dict, shown: int) -> List[str]:
    """Per layer, the signal that left its median first, and the step each signal did (``-``: it did not), the
    ``shown`` layers that moved first."""
    falling = "".join(f", {SIGNAL_NAMES[signal]} also below 1/{RISE_FACTOR:g}x"
                      for signal in attribution["signals"] if signal in FALLING)
    lines = [f"which signal left its own median first (above {RISE_FACTOR:g}x{falling}), per layer:"]
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
        row = (f"{rise['peak_rise']:8.2f}x at step {rise['peak_step']}, {rise['rise_at_fire']:8.2f}x at the fire, "
               f"above {RISE_FACTOR:g}x from {'-' if first is None else f'step {first}'}")
    if rise["first_nonfinite"] is not None:
        row += f"; non-finite from step {rise['first_nonfinite']}"
    return row


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value
