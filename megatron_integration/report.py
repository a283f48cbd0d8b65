"""``layer-grad-norms report``: does this run show larger gradients in early layers than late ones?

In a model of several layer stacks (an encoder's and a decoder's) each stack is compared with itself:
its first two logged layers against its last two, which must be disjoint: with fewer than ``MIN_COMPARED`` logged
layers the report says it cannot compare. The medians are taken over the last half of the steps, the steps around
each fire of the trigger left out (a spike is not the run's level). A run whose trigger fired with a flight recorder
gets a spike section per fire (``spike``).
"""

import math
import statistics
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from deepspeed_patch.outputs.tags import LayerId, layer_position

from .remedy_report import format_remedies, read_remedies, remedy_section
from .spike import format_spikes, spike_summaries, wrapped
from .tensorboard_reader import LayerSeries, NoLayerDataError, layer_title, read_layer_series


def _indices(layers: Sequence[LayerId]) -> str:
    return ", ".join(str(layer_position(layer)[1]) for layer in layers)


MIN_COMPARED = 4
"""The fewest logged layers of a stack that give two early and two late layers, none of them both."""


def _early_late(layers: List[LayerId], medians: Dict[LayerId, float]) -> Dict:
    """The early/late comparison of one stack's logged ``layers``; ``None`` in its fields with fewer than
    ``MIN_COMPARED`` (``logged``: how many there are)."""
    if len(layers) < MIN_COMPARED:
        return {"early_layers": None, "late_layers": None, "early_late_ratio": None, "early_larger": None,
                "logged": layers}
    early, late = layers[:2], layers[-2:]
    ratio = statistics.mean(medians[layer] for layer in early) / statistics.mean(medians[layer] for layer in late)
    return {"early_layers": early, "late_layers": late, "early_late_ratio": ratio, "early_larger": ratio > 1}


def _verdict(comparison: Dict) -> str:
    if comparison["early_late_ratio"] is None:
        return (f"cannot compare: early and late layers need {MIN_COMPARED} logged layers, two of each, disjoint; "
                f"this run logs {len(comparison['logged'])} (layers {_indices(comparison['logged'])})")
    return (f"{'yes' if comparison['early_larger'] else 'no'}: in this run early layers' gradients (layers "
            f"{_indices(comparison['early_layers'])}) are {comparison['early_late_ratio']:.2f}x those of late "
            f"layers ({_indices(comparison['late_layers'])})")


def fire_steps(spikes: Sequence[Dict]) -> List[Tuple[int, int]]:
    """The steps around each fire (``spike.localise``), left out of the medians: its recorded steps, and as many
    steps after the fire (the capture that follows it)."""
    return [(spike["steps"][0], 2 * spike["fired_at"] - spike["steps"][0] + 1) for spike in spikes if spike["steps"]]


def summarize(series: LayerSeries, window: float = 0.5, spikes: Sequence[Dict] = ()) -> Dict:
    """Median pre-clip norm per layer over the last ``window`` of the steps, the steps around each of ``spikes``
    left out (``fire_steps``; all of them kept where nothing else is left) (``median_steps``: the first and last
    step of a layer's finite norms there, and how many: fewer for a layer logged only around a fire), the early/late
    ratio (mean of the first two layers over the last two, ``MIN_COMPARED`` layers at least) of each layer stack,
    clipped steps and overflowed layers. A model of one stack has its comparison at the top level, one of several
    under ``stacks``; ``axis``: what the log's x axis counts (``"steps"``, or ``"samples"`` for DeepSpeed's
    monitor)."""
    stacks = series.stacks()
    for stack in stacks:
        if len(series.stack_layers(stack)) < 2:
            raise NoLayerDataError(f"the early/late ratio needs at least 2 logged layers{_of_stack(stack)}; found "
                                   f"{series.stack_layers(stack)}")
    layers = series.layers()
    steps = sorted({step for layer in layers for step, _ in series.series("pre-clip", "norm", layer)})
    first = steps[min(int(len(steps) * (1 - window)), len(steps) - 1)]
    around = fire_steps(spikes)
    quiet = {step for step in steps if step >= first and not any(start <= step <= end for start, end in around)}
    kept = quiet or {step for step in steps if step >= first}
    medians, median_steps = {}, {}
    for layer in layers:
        recent = [(step, value) for step, value in series.series("pre-clip", "norm", layer)
                  if step in kept and math.isfinite(value)]
        medians[layer] = statistics.median(value for _, value in recent) if recent else math.nan
        median_steps[layer] = [recent[0][0], recent[-1][0], len(recent)] if recent else []
    comparisons = {stack: _early_late(series.stack_layers(stack), medians) for stack in stacks}
    pre = dict(series.series("pre-clip", "norm", layers[0]))
    clipped = [step for step, post in series.series("post-clip", "norm", layers[0])
               if step in pre and math.isfinite(pre[step]) and post < pre[step] * (1 - 1e-6)]
    overflowed = {layer: [step for step, value in series.series("pre-clip", "norm", layer) if not math.isfinite(value)]
                  for layer in layers}
    summary = {"steps": [steps[0], steps[-1]], "window": [first, steps[-1]], "median_norm": medians,
               "median_steps": median_steps, "window_steps": len(kept), "axis": series.axis,
               "left_out": [[start, end] for start, end in around] if quiet else []}
    if stacks == [None]:
        summary.update(comparisons[None])
        answer = _verdict(comparisons[None])
    else:
        summary["stacks"] = comparisons
        answer = "; ".join(f"{stack}: {_verdict(comparison)}" for stack, comparison in comparisons.items())
    summary.update({
        "clipped_steps": clipped,
        "overflowed": {layer: found for layer, found in overflowed.items() if found},
        "answer": f"{answer}, median over {series.axis} {first}-{steps[-1]}{_left_out(summary)}",
    })
    return summary


def _left_out(summary: Dict) -> str:
    around = summary["left_out"]
    if not around:
        return ""
    return ", the steps around " + ("the fire" if len(around) == 1 else "each fire") + " (" + ", ".join(
        f"{start}-{end}" for start, end in around) + ") left out"


def summarize_source(source: str) -> Dict:
    """``summarize`` of a TensorBoard directory or JSONL dump, with its fires' spike sections under ``spikes`` and,
    where a remedy was on, what it did under ``remedies`` (``remedy_report``)."""
    spikes = spike_summaries(source)
    summary = summarize(read_layer_series(source), spikes=spikes)
    summary["spikes"] = spikes
    summary.update(remedy_section(read_remedies(source)))
    return summary


def csv_rows(series: LayerSeries) -> Iterator[List]:
    """``report --csv``: a header, then one row per step and layer: the step, the layer (as the report names it)
    and each statistic the log holds (``pre-clip norm``, ``post-clip max``, ...; empty where that step lacks
    it)."""
    columns = sorted(series.values)
    yield ["step", "layer", *(f"{phase} {statistic}" for phase, statistic in columns)]
    for layer in series.layers():
        by_column = [dict(series.series(phase, statistic, layer)) for phase, statistic in columns]
        for step in sorted({step for values in by_column for step in values}):
            yield [step, layer_title(layer), *(values.get(step, "") for values in by_column)]


def _own_steps(steps: List[int], window_steps: int) -> str:
    """`` (median over 28 steps, 143-170)`` for a layer whose median is over fewer steps than the window's."""
    if not steps:
        return " (no finite norm in the window)"
    first, last, count = steps
    return "" if count == window_steps else f" (median over {count} steps, {first}-{last})"


def _ratio(comparison: Dict) -> str:
    ratio = comparison["early_late_ratio"]
    return "-" if ratio is None else f"{ratio:.2f}"


def _of_stack(stack: Optional[str]) -> str:
    return "" if stack is None else f" of the stack {stack!r}"


def format_report(summary: Dict) -> str:
    axis = summary["axis"]
    lines = [f"per-layer pre-clip gradient norm, median over {axis} {summary['window'][0]}-{summary['window'][1]}"
             f"{_left_out(summary)} ({summary['window_steps']} logged {axis}):"]
    for layer, norm in summary["median_norm"].items():
        stack, index = layer_position(layer)
        lines.append(f"  {'' if stack is None else stack + ' '}layer {index:>3}: {norm:.4e}"
                     f"{_own_steps(summary['median_steps'][layer], summary['window_steps'])}")
    clipped = summary["clipped_steps"]
    lines.append(f"clipping active on {len(clipped)} logged {axis}" + (f" (first: {clipped[:5]})" if clipped else ""))
    overflowed = summary["overflowed"]
    lines.append("overflow (non-finite gradients): " +
                 (", ".join(f"{layer_title(layer)} at steps {steps[:5]}" for layer, steps in overflowed.items())
                  or "none"))
    if "stacks" in summary:
        lines += [f"early/late ratio{_of_stack(stack)}: {_ratio(comparison)}"
                  for stack, comparison in summary["stacks"].items()]
    else:
        lines.append(f"early/late ratio: {_ratio(summary)}")
    lines.append(summary["answer"])
    if summary.get("spikes"):
        lines.append(format_spikes(summary["spikes"]))
    if summary.get("remedies"):
        lines.append(format_remedies(summary["remedies"]))
    return "\n".join(wrapped(lines))
