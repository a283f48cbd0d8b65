"""The fires of the trigger a log recorded, each with every signal's per-layer series over its recorded steps.

A fire of the trigger with a flight recorder (``trigger.history: K``) leaves every layer's statistics of the
K steps up to the fire: in the JSONL dump, lines marked ``"history": true`` carrying the trigger's record;
in TensorBoard, the runs ``layer-grad-norms-history/fire-000123/layer00`` (``deepspeed_patch.outputs.tags``). A signal
is a phase of the logs (``tags.ALL_PHASES``): the gradient's ``pre_clip`` and ``post_clip``, and, with
``optimizer_statistics``, the optimizer's kinds (``update``, ``exp_avg``, ...) and the update-to-weight ratio
(logged in TensorBoard, derived from ``update`` and ``param`` in the dump). Only the norms are read: they are
what ``spike`` judges and ``plot --history`` draws. The buckets outside the transformer layers (the embedding, the
final norm, the output head, by their names) are read beside the layers (``Fire.outside``), for ``spike`` to judge.

Each fire also gets what the log holds of every signal before its recorded steps, the level ``spike`` judges them
against: the recorder's blocks of steps that left the ring (the dump's first recorded line of the fire carries
them under ``"before"``, ``deepspeed_patch.spikes.recorder``), and the steps measured at the configured interval before
the recorded steps (the live lines of the dump, the live runs of TensorBoard).
"""

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Tuple

from deepspeed_patch.outputs.tags import (
    ALL_PHASES,
    HISTORY_ROOT,
    HISTORY_RUN,
    OUTSIDE_LAYERS_ROOT,
    LayerId,
    history_root,
    is_layer,
    layer_of_label,
    layer_position,
    logged_result,
    phase_label,
    scalar_tag,
)

from .log_sources import LogSourceError, Points, dump_records, is_dump, scalar_series
from .tensorboard_reader import json_bucket, latest_per_step, read_layer_series

Block = Tuple[int, int, float]
"""A recorder's block before the recorded steps: its first and last step, and the root mean square of its norms."""


@dataclass
class Fire:
    """One fire's recorded steps: ``series[signal][layer]`` is the layer's norm of that signal (a phase of the
    logs: ``"pre_clip"``, ``"update"``, ...), ``(step, value)`` in step order, layers in depth order; ``reason``
    is the trigger's (``None`` where the log does not keep it: TensorBoard)."""

    fired_at: int
    reason: Optional[str] = None
    series: Dict[str, Dict[LayerId, Points]] = field(default_factory=dict)
    blocks: Dict[str, Dict[LayerId, List[Block]]] = field(default_factory=dict)
    """Each signal's recorder blocks before the recorded steps (``deepspeed_patch.spikes.recorder``), oldest first."""
    interval: Dict[str, Dict[LayerId, Points]] = field(default_factory=dict)
    """Each signal's steps measured at the configured interval before the recorded steps, in step order."""
    outside: Dict[str, Dict[str, Points]] = field(default_factory=dict)
    """Each signal's recorded steps of the buckets outside the layers (``"embed"``, ``"head"``), by name."""

    def points(self, signal: str, bucket: Hashable) -> Points:
        """A bucket's recorded steps of ``signal``: a layer's (``series``) or another bucket's (``outside``)."""
        found = self.series if is_layer(bucket) else self.outside
        return found.get(signal, {}).get(bucket, [])

    @property
    def buckets(self) -> List[Hashable]:
        """Every recorded bucket: the layers in depth order, then the others by name."""
        names = sorted({name for buckets in self.outside.values() for name in buckets})
        return list(self.norms) + names

    @property
    def recorded(self) -> Tuple[Optional[int], Optional[int]]:
        """The first and the last recorded step (``None`` where none was recorded)."""
        steps = [step for points in self.norms.values() for step, _ in points]
        return (min(steps), max(steps)) if steps else (None, None)

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
        fire.outside = {signal: {name: latest_per_step(points) for name, points in buckets.items()}
                        for signal, buckets in fire.outside.items()}
    if fires:
        _add_interval_steps(source, fires.values())
    return [fires[step] for step in sorted(fires)]


def _add_interval_steps(source: str, fires) -> None:
    """Each fire's ``interval``: every layer's steps the log holds before the fire's recorded steps, of each
    signal."""
    try:
        series = read_layer_series(source)
    except LogSourceError:
        return
    for fire in fires:
        start = fire.recorded[0]
        if start is None:
            continue
        for signal in ALL_PHASES:
            for layer, points in series.values.get((phase_label(signal), "norm"), {}).items():
                earlier = [point for point in points if point[0] < start]
                if earlier:
                    fire.interval.setdefault(signal, {})[layer] = earlier


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
        for signal, bucket, norm in _bucket_norms(record):
            found = fire.series if is_layer(bucket) else fire.outside
            found.setdefault(signal, {}).setdefault(bucket, []).append((record["step"], norm))
        if record.get("before"):
            fire.blocks = {}  # a fire written again (a run rolled back past it): its last writing
            for block in record["before"]:
                first, last = block["steps"]
                for signal, bucket, norm in _bucket_norms(block):
                    fire.blocks.setdefault(signal, {}).setdefault(bucket, []).append((first, last, norm))
    return fires


def _bucket_norms(result: dict):
    """``(signal, bucket, norm)`` of every bucket of a dumped result (or recorder block), every signal: a layer
    as ``json_bucket`` keys it, another bucket by its name."""
    logged = logged_result(result)
    for signal in ALL_PHASES:
        buckets = logged.get(signal) or {}
        stacked = not any(key.isdigit() for key in buckets)
        for key, values in buckets.items():
            yield signal, json_bucket(key, stacked), values["norm"]


def _tensorboard_fires(logdir: str) -> Dict[int, Fire]:
    fires: Dict[int, Fire] = {}
    signals = {scalar_tag(signal, "norm", root=HISTORY_ROOT): signal for signal in ALL_PHASES}
    others = {scalar_tag(signal, "norm", root=history_root(OUTSIDE_LAYERS_ROOT)): signal for signal in ALL_PHASES}
    for run, tag, points in scalar_series(logdir):
        match = HISTORY_RUN.search(run)
        if match is None:
            continue
        fire = fires.setdefault(int(match.group(1)), Fire(int(match.group(1))))
        layer = layer_of_label(match.group(2))
        if layer is not None and tag in signals:
            fire.series.setdefault(signals[tag], {})[layer] = points
        elif layer is None and tag in others:
            fire.outside.setdefault(others[tag], {})[match.group(2)] = points
    return {fired_at: fire for fired_at, fire in fires.items() if fire.series or fire.outside}
