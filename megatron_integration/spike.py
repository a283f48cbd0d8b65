"""The spike section of ``report``: where in the model each fire of the trigger began.

A fire of the trigger with a flight recorder (``trigger.history: K``) leaves every layer's statistics of the
K steps up to the fire: in the JSONL dump, lines marked ``"history": true`` carrying the trigger's record;
in TensorBoard, the runs ``layer-grad-norms-history/fire-000123/layer00`` (``deepspeed_patch.tags``).

Each layer is judged against itself: its baseline is the median of its finite pre-clip norms over the
window's steps before the fire (at least ``MIN_BASELINE`` of them, else it has none), and its rise at a step
is the norm over that baseline (over a zero baseline, any positive norm is an infinite rise). The answer names,
in this order: the layers whose norm went non-finite first, at or before the fire (an overflow's origin: the
others' rises may follow from it); else the layers that rose most (the largest rise in the window) and first
(the earliest step above ``RISE_FACTOR`` x the baseline); else why no layer can be judged (no layer bucket
recorded, a baseline too short).
"""

import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from deepspeed_patch.tags import HISTORY_ROOT, HISTORY_RUN, is_layer, layer_of_label, layer_position, scalar_tag

from .log_sources import dump_records, is_dump, scalar_series
from .tensorboard_reader import Points, json_bucket, latest_per_step, layer_title

RISE_FACTOR = 2.0
"""A layer has risen at a step once its norm there is above this many times its own baseline."""
MIN_BASELINE = 3
"""The fewest finite norms before the fire that make a layer's baseline: the median of one or two steps is
a single noisy step, not a baseline."""


@dataclass
class Fire:
    """One fire's recorded steps: ``norms[layer]`` is the layer's pre-clip norm, ``(step, value)`` in step
    order; ``reason`` is the trigger's (``None`` where the log does not keep it: TensorBoard)."""

    fired_at: int
    reason: Optional[str] = None
    norms: Dict = field(default_factory=dict)


def read_fires(source: str) -> List[Fire]:
    """Every fire recorded in ``source`` (a TensorBoard directory or a JSONL dump), in step order; a fire
    written twice (a run rolled back past it) is read once, its steps the last written."""
    fires = _jsonl_fires(source) if is_dump(source) else _tensorboard_fires(source)
    for fire in fires.values():
        fire.norms = {layer: latest_per_step(fire.norms[layer]) for layer in sorted(fire.norms, key=_depth)}
    return [fires[step] for step in sorted(fires)]


def _depth(layer) -> tuple:
    stack, index = layer_position(layer)
    return stack or "", index


def _jsonl_fires(path: str) -> Dict[int, Fire]:
    fires: Dict[int, Fire] = {}
    for record in dump_records(path):
        if not record.get("history"):
            continue
        trigger = record["trigger"]
        fire = fires.setdefault(trigger["fired_at"], Fire(trigger["fired_at"]))
        fire.reason = trigger.get("reason")
        buckets = record["pre_clip"] or {}
        stacked = not any(key.isdigit() for key in buckets)
        for key, values in buckets.items():
            layer = json_bucket(key, stacked)
            if is_layer(layer):
                fire.norms.setdefault(layer, []).append((record["step"], values["norm"]))
    return fires


def _tensorboard_fires(logdir: str) -> Dict[int, Fire]:
    fires: Dict[int, Fire] = {}
    norm_tag = scalar_tag("pre_clip", "norm", root=HISTORY_ROOT)
    for run, tag, points in scalar_series(logdir):
        match = HISTORY_RUN.search(run)
        layer = layer_of_label(match.group(2)) if match else None
        if layer is not None and tag == norm_tag:
            fired_at = int(match.group(1))
            fires.setdefault(fired_at, Fire(fired_at)).norms[layer] = points
    return fires


def rise_over(value: float, baseline: float) -> float:
    """``value`` over ``baseline``. Over a zero baseline, a positive norm is an infinite rise and a zero norm
    no rise (1x); a NaN norm or baseline gives NaN."""
    if math.isnan(value) or math.isnan(baseline):
        return math.nan
    if baseline > 0:
        return value / baseline
    return math.inf if value > 0 else 1.0


def _rise(points: Points, fired_at: int) -> Dict:
    """One layer against itself: its baseline (the median of its finite norms before ``fired_at``, NaN with
    fewer than ``MIN_BASELINE`` of them), its rise at its finite steps, and its first non-finite step up to
    the fire."""
    earlier = [value for step, value in points if step < fired_at and math.isfinite(value)]
    baseline = statistics.median(earlier) if len(earlier) >= MIN_BASELINE else math.nan
    rises = [(step, rise_over(value, baseline)) for step, value in points
             if math.isfinite(value) and not math.isnan(baseline)]
    peak_step, peak = max(rises, key=lambda rise: rise[1], default=(None, math.nan))  # ties: the earliest
    first = next((step for step, rise in rises if rise > RISE_FACTOR), None)
    nonfinite = next((step for step, value in points if step <= fired_at and not math.isfinite(value)), None)
    return {"baseline": baseline, "baseline_points": len(earlier),
            "rise_at_fire": rise_over(dict(points).get(fired_at, math.nan), baseline), "peak_rise": peak,
            "peak_step": peak_step, "first_risen": first, "first_nonfinite": nonfinite}


def localise(fire: Fire) -> Dict:
    """Each layer's rise, the layers that went non-finite first, rose most and rose first, and the one-line
    answer. A layer non-finite at or before the fire is named before any rise: its rise cannot be measured,
    and the others' rises may be its consequence."""
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
             "nonfinite_step": nonfinite_step, "rose_most": most, "rose_first": first, "first_step": first_step}
    spike["answer"] = _answer(spike, broken)
    return spike


def _answer(spike: Dict, broken: Dict) -> str:
    head = f"spike at step {spike['fired_at']}" + (f" ({spike['reason']})" if spike["reason"] else "")
    layers, most, first, first_step = spike["layers"], spike["rose_most"], spike["rose_first"], spike["first_step"]
    if not layers:
        return f"{head}: no layer bucket was recorded (only buckets outside the layers, or none)"
    if broken:
        return (f"{head}: {_titles(spike['nonfinite_first'])} went non-finite first, at step "
                f"{spike['nonfinite_step']} ({len(broken)} of {len(layers)} layers non-finite by the fire)")
    if most is None:
        longest = max(rise["baseline_points"] for rise in layers.values())
        return (f"{head}: the baseline is too short: at most {longest} finite norms of a layer before the fire, "
                f"{MIN_BASELINE} needed (a longer trigger.history keeps more)")
    if first_step is None:
        return f"{head}: no layer rose above {RISE_FACTOR:g}x its median over the window; most: {layer_title(most)}"
    rise = layers[most]
    size = "from a zero median" if math.isinf(rise["peak_rise"]) else f"{rise['peak_rise']:.1f}x its median"
    answer = f"{head}: {layer_title(most)} rose most, {size} at step {rise['peak_step']}"
    if first != [most] or first_step != rise["peak_step"]:
        answer += f"; first above {RISE_FACTOR:g}x: {_titles(first)} at step {first_step}"
    return answer


def _titles(layers: List) -> str:
    return ", ".join(layer_title(layer) for layer in layers)


def spike_summaries(source: str) -> List[Dict]:
    """``localise`` of every fire recorded in ``source``; empty without a recorder's fire."""
    return [localise(fire) for fire in read_fires(source)]


def spiked_layers(spikes: List[Dict]) -> List:
    """The layer that rose most at each fire (``localise``), each once."""
    return list(dict.fromkeys(spike["rose_most"] for spike in spikes if spike["rose_most"] is not None))


def format_spikes(spikes: List[Dict], shown: int = 5) -> str:
    """The spike section: per fire, the layers that went non-finite, then the ``shown`` layers that rose most,
    and the answer."""
    lines = []
    for spike in spikes:
        steps = f"recorded steps {spike['steps'][0]}-{spike['steps'][1]}" if spike["steps"] else "no step recorded"
        lines.append(f"spike: the trigger fired at step {spike['fired_at']}, {steps}; pre-clip norm over each "
                     "layer's median before it:")
        for layer, rise in sorted(spike["layers"].items(), key=_rank)[:shown]:
            lines.append(f"  {layer_title(layer):>16}: {_row(rise)}")
        lines.append(spike["answer"])
    return "\n".join(lines)


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
