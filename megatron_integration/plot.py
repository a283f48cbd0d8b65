"""``layer-grad-norms plot``: the NormFormer-style figure of a run's per-layer gradient norms.

Left and middle: gradient norm over steps, pre- and post-clip, for layers 0, 1, mid, -2, -1 of those
logged, on a log scale. Right: the depth profile, log10 of the pre-clip norm for every logged layer
against step, as a heatmap.
"""

import math
from typing import List

from .tensorboard_reader import LayerSeries


def line_layers(layers: List[int]) -> List[int]:
    """The NormFormer paper's five layers (0, 1, mid, -2, -1) among those logged."""
    picks = [layers[0], layers[min(1, len(layers) - 1)], layers[len(layers) // 2], layers[-2], layers[-1]]
    return sorted(set(picks))


def plot_layer_norms(series: LayerSeries, out: str):
    """Draw the figure into ``out`` (PNG or SVG, from its extension); returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    layers = series.layers()
    figure, (pre_axis, post_axis, depth_axis) = plt.subplots(1, 3, figsize=(16, 4.8))
    for axis, phase in ((pre_axis, "pre-clip"), (post_axis, "post-clip")):
        for layer in line_layers(layers):
            points = series.series(phase, "norm", layer)
            axis.plot([step for step, _ in points], [value for _, value in points], label=f"layer {layer}")
        axis.set_yscale("log")
        axis.set_xlabel("step")
        axis.set_ylabel("gradient L2 norm")
        axis.set_title(f"per-layer gradient norm, {phase}")
        axis.legend(fontsize="small")
    steps = sorted({step for step, _ in series.series("pre-clip", "norm", layers[0])})
    grid = []
    for layer in layers:
        by_step = dict(series.series("pre-clip", "norm", layer))
        grid.append([math.log10(by_step[s]) if by_step.get(s, 0) > 0 and math.isfinite(by_step[s]) else math.nan
                     for s in steps])
    image = depth_axis.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                              extent=(steps[0], steps[-1], -0.5, len(layers) - 0.5))
    depth_axis.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize="small")
    depth_axis.set_xlabel("step")
    depth_axis.set_ylabel("layer")
    depth_axis.set_title("depth profile: log10 pre-clip norm")
    figure.colorbar(image, ax=depth_axis)
    figure.tight_layout()
    figure.savefig(out)
    return figure
