"""``layer-grad-norms report``: does this run show larger gradients in early layers than late ones?"""

import math
import statistics
from typing import Dict

from .tensorboard_reader import LayerSeries


def summarize(series: LayerSeries, window: float = 0.5) -> Dict:
    """Median pre-clip norm per layer over the last ``window`` of the steps, the early/late ratio
    (mean of the first two layers over the last two), clipped steps and overflowed layers."""
    layers = series.layers()
    if len(layers) < 2:
        raise ValueError(f"the early/late ratio needs at least 2 logged layers; found {layers}")
    steps = sorted({step for layer in layers for step, _ in series.series("pre-clip", "norm", layer)})
    first = steps[min(int(len(steps) * (1 - window)), len(steps) - 1)]
    medians = {}
    for layer in layers:
        recent = [value for step, value in series.series("pre-clip", "norm", layer)
                  if step >= first and math.isfinite(value)]
        medians[layer] = statistics.median(recent) if recent else math.nan
    early, late = layers[:2], layers[-2:]
    ratio = statistics.mean(medians[layer] for layer in early) / statistics.mean(medians[layer] for layer in late)
    pre = dict(series.series("pre-clip", "norm", layers[0]))
    clipped = [step for step, post in series.series("post-clip", "norm", layers[0])
               if step in pre and math.isfinite(pre[step]) and post < pre[step] * (1 - 1e-6)]
    overflowed = {layer: [step for step, value in series.series("pre-clip", "norm", layer) if not math.isfinite(value)]
                  for layer in layers}
    return {
        "steps": [steps[0], steps[-1]],
        "window": [first, steps[-1]],
        "median_norm": medians,
        "early_layers": early,
        "late_layers": late,
        "early_late_ratio": ratio,
        "early_larger": ratio > 1,
        "clipped_steps": clipped,
        "overflowed": {layer: found for layer, found in overflowed.items() if found},
        "answer": (f"{'yes' if ratio > 1 else 'no'}: in this run early layers' gradients (layers "
                   f"{', '.join(map(str, early))}) are {ratio:.2f}x those of late layers "
                   f"({', '.join(map(str, late))}), median over steps {first}-{steps[-1]}"),
    }


def format_report(summary: Dict) -> str:
    lines = [f"per-layer pre-clip gradient norm, median over steps {summary['window'][0]}-{summary['window'][1]}:"]
    lines += [f"  layer {layer:>3}: {norm:.4e}" for layer, norm in summary["median_norm"].items()]
    clipped = summary["clipped_steps"]
    lines.append(f"clipping active on {len(clipped)} logged steps" + (f" (first: {clipped[:5]})" if clipped else ""))
    overflowed = summary["overflowed"]
    lines.append("overflow (non-finite gradients): " +
                 (", ".join(f"layer {layer} at steps {steps[:5]}" for layer, steps in overflowed.items()) or "none"))
    lines.append(f"early/late ratio: {summary['early_late_ratio']:.2f}")
    lines.append(summary["answer"])
    return "\n".join(lines)
