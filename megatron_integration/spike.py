"""The spike section of ``report``: where in the model each fire of the trigger began.

A fire of the trigger with a flight recorder (``trigger.history: K``) leaves every layer's statistics of the
K steps up to the fire: in the JSONL dump, lines marked ``"history": true`` carrying the trigger's record;
in TensorBoard, the runs ``layer-grad-norms-history/fire-000123/layer00`` (``deepspeed_patch.tags``).

Each layer is judged against itself: its baseline is the median of its pre-clip norm over the window's steps
before the fire, and its rise at a step is the norm over that baseline. The layers that rose most (the
largest rise in the window) and first (the earliest step above ``factor`` x the baseline) localise the spike.
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


def _rise(points: Points, fired_at: int) -> Dict:
    """One layer's rise over its baseline, the median of its finite norms before ``fired_at``."""
    earlier = [value for step, value in points if step < fired_at and math.isfinite(value)]
    baseline = statistics.median(earlier) if earlier else math.nan
    rises = [(step, value / baseline if baseline > 0 else math.nan) for step, value in points]
    peak_step, peak = max(rises, key=lambda rise: rise[1] if not math.isnan(rise[1]) else -math.inf)
    first = next((step for step, rise in rises if rise > RISE_FACTOR), None)
    at_fire = dict(rises).get(fired_at, math.nan)
    return {"baseline": baseline, "rise_at_fire": at_fire, "peak_rise": peak, "peak_step": peak_step,
            "first_risen": first}


def localise(fire: Fire) -> Dict:
    """Each layer's rise, the layers that rose most and first, and the one-line answer."""
    layers = {layer: _rise(points, fire.fired_at) for layer, points in fire.norms.items() if points}
    steps = sorted({step for points in fire.norms.values() for step, _ in points})
    judged = {layer: rise for layer, rise in layers.items() if not math.isnan(rise["peak_rise"])}
    most = max(judged, key=lambda layer: judged[layer]["peak_rise"]) if judged else None
    risen = {layer: rise["first_risen"] for layer, rise in judged.items() if rise["first_risen"] is not None}
    first_step = min(risen.values()) if risen else None
    first = sorted((layer for layer, step in risen.items() if step == first_step),
                   key=lambda layer: -judged[layer]["peak_rise"])
    return {"fired_at": fire.fired_at, "reason": fire.reason, "steps": [steps[0], steps[-1]] if steps else [],
            "layers": layers, "rose_most": most, "rose_first": first, "first_step": first_step,
            "answer": _answer(fire, judged, most, first, first_step)}


def _answer(fire: Fire, judged: Dict, most, first: List, first_step: Optional[int]) -> str:
    head = f"spike at step {fire.fired_at}" + (f" ({fire.reason})" if fire.reason else "")
    if most is None:
        return f"{head}: no layer has a baseline (the window holds no step before the fire)"
    if first_step is None:
        return f"{head}: no layer rose above {RISE_FACTOR:g}x its median over the window; most: {layer_title(most)}"
    rise = judged[most]
    answer = (f"{head}: {layer_title(most)} rose most, {rise['peak_rise']:.1f}x its median at step "
              f"{rise['peak_step']}")
    if first != [most] or first_step != rise["peak_step"]:
        answer += (f"; first above {RISE_FACTOR:g}x: {', '.join(layer_title(layer) for layer in first)} at step "
                   f"{first_step}")
    return answer


def spike_summaries(source: str) -> List[Dict]:
    """``localise`` of every fire recorded in ``source``; empty without a recorder's fire."""
    return [localise(fire) for fire in read_fires(source)]


def spiked_layers(spikes: List[Dict]) -> List:
    """The layer that rose most at each fire (``localise``), each once."""
    return list(dict.fromkeys(spike["rose_most"] for spike in spikes if spike["rose_most"] is not None))


def format_spikes(spikes: List[Dict], shown: int = 5) -> str:
    """The spike section: per fire, the ``shown`` layers that rose most, and the answer."""
    lines = []
    for spike in spikes:
        lines.append(f"spike: the trigger fired at step {spike['fired_at']}, recorded steps "
                     f"{spike['steps'][0]}-{spike['steps'][1]}; pre-clip norm over each layer's median before it:")
        ranked = sorted(spike["layers"].items(), key=lambda item: -_sortable(item[1]["peak_rise"]))
        for layer, rise in ranked[:shown]:
            first = rise["first_risen"]
            lines.append(f"  {layer_title(layer):>16}: {rise['peak_rise']:8.2f}x at step {rise['peak_step']}, "
                         f"{rise['rise_at_fire']:8.2f}x at the fire, above {RISE_FACTOR:g}x from "
                         f"{'-' if first is None else f'step {first}'}")
        lines.append(spike["answer"])
    return "\n".join(lines)


def _sortable(value: float) -> float:
    return -math.inf if math.isnan(value) else value
