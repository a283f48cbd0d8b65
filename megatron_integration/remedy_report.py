"""What the remedies did in a run, read back from its log: the steps ``skip_step`` skipped, with their reasons, and
the buckets whose ``adaptive_clipping`` factor fell below 1 (how often, how low); ``report``'s remedy section, and
what ``plot`` draws of them.

The logs carry them as the writers write them (``deepspeed_patch.outputs.tags``): the JSONL dump's lines hold
``skipped``, ``skip_reason`` and ``adaptive_clip`` (``{bucket: factor}``, ``None`` in the warm-up); TensorBoard,
DeepSpeed's monitors (its CSV files too) and the Trainer's ``log_history`` hold the factors as the phase
``adaptive-clip`` (each bucket's factor as its "norm", in the bucket's run or with the bucket ending the tag) and
``layer-grad-norms/skipped-step`` (1 skipped, 0 applied), without the reason, which only the dump keeps. The dump's
recorded steps (``"history": true``, a fire's copies of steps logged before) are left out: the live lines say what
the remedies did.
"""

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from deepspeed_patch.outputs.tags import ADAPTIVE_CLIP, SKIPPED, SKIPPED_TAG, TAG_ROOT, bucket_label, phase_label

from .log_sources import dump_records, is_dump, scalar_series
from .tensorboard_reader import BUCKET_RUN, json_bucket, latest_per_step

Points = List[Tuple[int, float]]

_FACTOR_TAG = re.compile(rf"(?:^|/)(?:non-)?{TAG_ROOT}/{phase_label(ADAPTIVE_CLIP)}(?:/(.+))?$")
"""A factor's tag, after any writer's prefix: the bucket ends it (the flat form), or names the part of the run's
layer (finer buckets), or the run is the bucket's."""
_SKIPPED_TAG = re.compile(rf"(?:^|/){re.escape(SKIPPED_TAG)}$")
SKIPPED_GID = "skipped-step"
"""The matplotlib ``gid`` of a skipped step's marker."""
FACTORS_DRAWN = 8
"""The buckets ``plot`` draws factors of: those clipped lowest."""


@dataclass
class RemedyLog:
    """The remedies' series of one log, one value per step (the last written, as every reader here keeps)."""

    skip_judged: Points = field(default_factory=list)
    """``(step, 1.0)`` for a skipped step, ``(step, 0.0)`` for an applied one: every step ``skip_step`` judged."""
    skip_reasons: Dict[int, str] = field(default_factory=dict)
    """A skipped step's reason, where the log keeps it (the dump)."""
    factors: Dict[str, Points] = field(default_factory=dict)
    """Each bucket's adaptive clipping factors, by its label in logs (``layer03``, ``embedding``)."""

    def skipped_steps(self) -> List[int]:
        return [step for step, skipped in self.skip_judged if skipped]

    def clipped(self) -> Dict[str, Points]:
        """The buckets ever clipped (a factor below 1), their factors below 1."""
        below = {label: [(step, value) for step, value in points if value < 1.0] for label, points in
                 self.factors.items()}
        return {label: points for label, points in below.items() if points}


def read_remedies(source: str) -> RemedyLog:
    """The remedies' series of ``source``, any log ``log_sources`` reads (empty where no remedy was on)."""
    return _from_dump(source) if is_dump(source) else _from_scalars(source)


def _from_dump(path: str) -> RemedyLog:
    judged: Points = []
    reasons: Dict[int, str] = {}
    factors: Dict[str, Points] = {}
    for record in dump_records(path):
        if record.get("history"):
            continue
        if SKIPPED in record:
            judged.append((record["step"], float(record[SKIPPED])))
            if record[SKIPPED]:
                reasons[record["step"]] = record.get("skip_reason") or ""
        buckets = record.get(ADAPTIVE_CLIP) or {}
        stacked = not any(key.isdigit() for key in buckets)
        for key, factor in buckets.items():
            factors.setdefault(bucket_label(json_bucket(key, stacked)), []).append((record["step"], factor))
    judged = latest_per_step(judged)
    kept = {step for step, skipped in judged if skipped}
    return RemedyLog(judged, {step: reason for step, reason in reasons.items() if step in kept},
                     {label: latest_per_step(points) for label, points in factors.items()})


def _from_scalars(source: str) -> RemedyLog:
    log = RemedyLog()
    for run, tag, points in scalar_series(source):
        if _SKIPPED_TAG.search(tag):
            log.skip_judged = latest_per_step(log.skip_judged + points)
            continue
        match = _FACTOR_TAG.search(tag)
        label = _factor_label(run, match.group(1)) if match else None
        if label is not None:
            log.factors[label] = latest_per_step(log.factors.get(label, []) + points)
    return log


def _factor_label(run: str, suffix: Optional[str]) -> Optional[str]:
    """The bucket of a factor series: its run's (``layer03``), with the tag's part of the layer (``layer03/dense``),
    or the tag's own (the flat form, every bucket in one run)."""
    bucket_run = BUCKET_RUN.search(run)
    if bucket_run is None:
        return suffix
    return bucket_run.group(1) if suffix is None else f"{bucket_run.group(1)}/{suffix}"


def remedy_summary(log: RemedyLog) -> Optional[Dict]:
    """``report``'s remedy section of ``log``: ``skip_step`` (the steps judged, each skipped step and its reason)
    and ``adaptive_clipping`` (the steps with factors, and per clipped bucket: how many steps below 1, the lowest
    factor and its step, the median of those below 1), for the remedies the log shows; ``None`` for neither."""
    summary: Dict = {}
    if log.skip_judged:
        summary["skip_step"] = {
            "judged_steps": len(log.skip_judged),
            "skipped": [{"step": step, "reason": log.skip_reasons.get(step)} for step in log.skipped_steps()],
        }
    if log.factors:
        steps = {step for points in log.factors.values() for step, _ in points}
        clipped = {label: _clipping(points) for label, points in log.clipped().items()}
        summary["adaptive_clipping"] = {
            "steps": len(steps),
            "buckets": len(log.factors),
            "clipped": dict(sorted(clipped.items(), key=lambda item: item[1]["lowest"])),
        }
    return summary or None


def _clipping(below: Points) -> Dict:
    lowest_step, lowest = min(below, key=lambda point: point[1])
    return {"steps": len(below), "lowest": lowest, "lowest_step": lowest_step,
            "median": statistics.median(value for _, value in below)}


def remedy_section(log: RemedyLog) -> Dict:
    """``{"remedies": remedy_summary(log)}`` for ``report``'s summary; nothing where no remedy was on."""
    summary = remedy_summary(log)
    return {"remedies": summary} if summary else {}


def format_remedies(summary: Dict, shown: int = 10) -> str:
    """The remedy section as ``report`` prints it; at most ``shown`` skipped steps and clipped buckets."""
    lines = ["remedies:"]
    skip = summary.get("skip_step")
    if skip is not None:
        skipped = skip["skipped"]
        lines.append(f"  skip_step: {len(skipped)} of {skip['judged_steps']} judged steps skipped")
        lines += [f"    step {entry['step']}: {entry['reason'] or 'reason not in this log (the JSONL dump has it)'}"
                  for entry in skipped[:shown]]
    adaptive = summary.get("adaptive_clipping")
    if adaptive is not None:
        clipped = adaptive["clipped"]
        lines.append(f"  adaptive_clipping: {len(clipped)} of {adaptive['buckets']} buckets clipped (factor below 1) "
                     f"over {adaptive['steps']} steps after the warm-up" + (", lowest first:" if clipped else ""))
        lines += [f"    {label}: {entry['steps']} steps, lowest {entry['lowest']:.3g} (step {entry['lowest_step']}), "
                  f"median {entry['median']:.3g}" for label, entry in list(clipped.items())[:shown]]
    return "\n".join(lines)


def draw_skipped(axes: Iterable, log: RemedyLog) -> None:
    """A vertical line at each skipped step on each of ``axes``, labelled once."""
    for axis in axes:
        for index, step in enumerate(log.skipped_steps()):
            axis.axvline(step, color="black", linestyle=":", linewidth=1, gid=SKIPPED_GID,
                         label="skipped step (skip_step)" if index == 0 else None)


def draw_factors(axis, log: RemedyLog) -> None:
    """The panel of adaptive clipping's factors: the ``FACTORS_DRAWN`` buckets clipped lowest, one line each."""
    lowest = sorted(log.factors, key=lambda label: min((value for _, value in log.factors[label]), default=math.inf))
    for label in lowest[:FACTORS_DRAWN]:
        points = log.factors[label]
        axis.plot([step for step, _ in points], [value for _, value in points], linewidth=1, label=label)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("step")
    axis.set_ylabel("factor (1: not clipped)")
    axis.set_title(f"adaptive clipping, the {min(len(lowest), FACTORS_DRAWN)} buckets clipped lowest")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small")
