"""The fires of the trigger a log recorded, each with every signal's per-layer series over its recorded steps.

A fire of the trigger with a flight recorder (``trigger.history: K``) leaves every layer's statistics of the
K steps up to the fire: in the JSONL dump, lines marked ``"history": true`` carrying the trigger's record;
in TensorBoard, the runs ``layer-grad-norms-history/fire-000123/layer00`` (``deepspeed_patch.tags``). A signal
is a phase of the logs (``tags.ALL_PHASES``): the gradient's ``pre_clip`` and ``post_clip``, and, with
``optimizer_statistics``, the optimizer's kinds (``update``, ``exp_avg``, ...) and the update-to-weight ratio
(logged in TensorBoard, derived from ``update`` and ``param`` in the dump). Only the norms are read: they are
what ``spike`` judges and ``plot --history`` draws.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from deepspeed_patch.tags import (
    ALL_PHASES,
    HISTORY_ROOT,
    HISTORY_RUN,
    LayerId,
    is_layer,
    layer_of_label,
    layer_position,
    logged_result,
    scalar_tag,
)

from .log_sources import Points, dump_records, is_dump, scalar_series
from .tensorboard_reader import json_bucket, latest_per_step


@dataclass
class Fire:
    """One fire's recorded steps: ``series[signal][layer]`` is the layer's norm of that signal (a phase of the
    logs: ``"pre_clip"``, ``"update"``, ...), ``(step, value)`` in step order, layers in depth order; ``reason``
    is the trigger's (``None`` where the log does not keep it: TensorBoard)."""

    fired_at: int
    reason: Optional[str] = None
    series: Dict[str, Dict[LayerId, Points]] = field(default_factory=dict)

    @property
    def norms(self) -> Dict[LayerId, Points]:
        """The pre-clip gradient norm of every recorded layer: what the trigger judged."""
        return self.series.get("pre_clip", {})


def read_fires(source: str) -> List[Fire]:
    """Every fire recorded in ``source`` (a TensorBoard directory or a JSONL dump), in step order; a fire
    written twice (a run rolled back past it) is read once, its steps the last written."""
    fires = _jsonl_fires(source) if is_dump(source) else _tensorboard_fires(source)
    for fire in fires.values():
        fire.series = {
            signal: {layer: latest_per_step(layers[layer])
                     for layer in sorted(layers, key=_depth)}
            for signal, layers in sorted(fire.series.items(), key=lambda item: ALL_PHASES.index(item[0]))
        }
    return [fires[step] for step in sorted(fires)]


def _depth(layer: LayerId) -> tuple:
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
        logged = logged_result(record)
        for signal in ALL_PHASES:
            buckets = logged.get(signal) or {}
            stacked = not any(key.isdigit() for key in buckets)
            for key, values in buckets.items():
                layer = json_bucket(key, stacked)
                if is_layer(layer):
                    fire.series.setdefault(signal, {}).setdefault(layer, []).append((record["step"], values["norm"]))
    return fires


def _tensorboard_fires(logdir: str) -> Dict[int, Fire]:
    fires: Dict[int, Fire] = {}
    signals = {scalar_tag(signal, "norm", root=HISTORY_ROOT): signal for signal in ALL_PHASES}
    for run, tag, points in scalar_series(logdir):
        match = HISTORY_RUN.search(run)
        layer = layer_of_label(match.group(2)) if match else None
        if layer is not None and tag in signals:
            fired_at = int(match.group(1))
            fires.setdefault(fired_at, Fire(fired_at)).series.setdefault(signals[tag], {})[layer] = points
    return fires
