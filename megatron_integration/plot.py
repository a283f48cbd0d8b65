"""``layer-grad-norms plot``: the NormFormer-style figure of a run's per-layer gradient norms.

Left and middle: gradient norm over steps, pre- and post-clip, for layers 0, 1, mid, -2, -1 of those
logged, on a log scale, and every layer logged on only some of the steps (captured around a fire of the trigger,
recorded by its flight recorder), with the layer that rose most at each fire. Right: the depth profile,
log10 of the pre-clip norm for every logged layer
against step, as a heatmap. In a model of several layer stacks (an encoder's and a decoder's) each
stack gets its five lines, in a line style of its own, and its band of the depth profile. Lines take their colour
from their depth (``depth_colour``); one layer per figure, the one that rose most at the first fire, is highlighted
(``HIGHLIGHT``); legends sit under the panels, off the data. Where a remedy was on (``remedy_report``), each
skipped step is a dotted vertical line on the norms, and a fourth panel draws adaptive clipping's factors. Where the
log holds the loss or the global gradient norm (``run_scalars``), a panel under the norms draws them on the same steps.

``plot --history``: the flight recorder's steps of each fire (``plot_spike_history``), every layer: the gradient,
the update-to-weight ratio where the log holds it, and each layer's rise.
"""

import math
import textwrap
from typing import Dict, Iterable, List, Optional

from deepspeed_patch.outputs.tags import UPDATE_TO_WEIGHT, LayerId, layer_position

from .fires import Fire, read_fires
from .remedy_report import RemedyLog, draw_factors, draw_skipped, read_remedies
from .run_scalars import RunScalars, draw_run_scalars, read_run_scalars
from .spike import figure_words, localise_all, spiked_layers
from .tensorboard_reader import LayerSeries, layer_title, read_layer_series

LINE_STYLES = ("-", "--", ":", "-.")
HIGHLIGHT = "tab:red"
"""The one highlighted layer of a figure (of each fire in ``plot --history``): the layer that rose most, drawn
thick, in a colour the depth colour map does not use."""
DEPTH_COLOURS = "viridis"
"""The other lines' colours, by depth: a sequential map, so that 32 layers get 32 colours, in order."""
DEPTH_RANGE = 0.9
"""The part of the map used: its palest end is hard to see on white."""
LEGEND_BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "ncol": 3, "fontsize": "small"}
"""A line panel's legend, under its axis: never over the data."""
SCALARS_HEIGHT = 2.6
"""The height in inches of the loss and global norm's panel, under the norms (theirs: 5.4)."""


def depth_colour(position: int, count: int):
    """The line colour of the layer at ``position`` (from 0) of ``count`` layers, by depth."""
    from matplotlib import colormaps

    return colormaps[DEPTH_COLOURS](DEPTH_RANGE * position / max(count - 1, 1))


def line_layers(layers: List[LayerId], series: LayerSeries, spiked: Iterable[LayerId] = ()) -> List[LayerId]:
    """The layers of one stack drawn as lines: the NormFormer paper's five (0, 1, mid, -2, -1) among those
    logged, those logged on fewer steps than the most (around a fire), and the ``spiked`` ones."""
    picks = [layers[0], layers[min(1, len(layers) - 1)], layers[len(layers) // 2], layers[max(len(layers) - 2, 0)],
             layers[-1]]
    counts = {layer: len(series.series("pre-clip", "norm", layer)) for layer in layers}
    fewer = {layer for layer, count in counts.items() if count < max(counts.values())}
    wanted = set(picks) | fewer | set(spiked)
    return [layer for layer in layers if layer in wanted]


def line_label(series: LayerSeries, layer: LayerId, steps: int) -> str:
    """A line's legend entry: ``layer 3``, with ``(28 of 200 steps)`` for a layer logged on fewer steps."""
    count = len(series.series("pre-clip", "norm", layer))
    return layer_title(layer) + (f" ({count} of {steps} steps)" if count < steps else "")


def plot_layer_norms(series: LayerSeries, out: str, spiked: Iterable[LayerId] = (),
                     remedies: Optional[RemedyLog] = None, scalars: Optional[RunScalars] = None):
    """Draw the figure into ``out`` (PNG or SVG, from its extension), with the ``spiked`` layers (those that
    rose most at a fire, ``spike.localise``) among the lines, the first of them highlighted, what the
    ``remedies`` did: skipped steps marked on the norms, adaptive clipping's factors in a fourth panel, and the
    run's loss and global norm (``scalars``, where the log holds them) in a panel under the norms; returns the
    matplotlib Figure."""
    stacks, spiked = series.stacks(), list(spiked)
    highlight = spiked[0] if spiked else None
    steps = len({step for layer in series.layers() for step, _ in series.series("pre-clip", "norm", layer)})
    remedies, scalars = remedies or RemedyLog(), scalars or RunScalars()
    figure, axes = _panels(4 if remedies.factors else 3, bool(scalars))
    pre_axis, post_axis, depth_axis = axes[:3]
    for axis, phase in ((pre_axis, "pre-clip"), (post_axis, "post-clip")):
        for position, stack in enumerate(stacks):
            drawn = line_layers(series.stack_layers(stack), series, spiked)
            for order, layer in enumerate(drawn):  # in depth order: the map's ends for the first and last
                points = series.series(phase, "norm", layer)
                thick = layer == highlight
                axis.plot([step for step, _ in points], [value for _, value in points],
                          LINE_STYLES[position % len(LINE_STYLES)], label=line_label(series, layer, steps),
                          marker="." if len(points) < steps else None, markersize=3, linewidth=2.5 if thick else 1.5,
                          color=HIGHLIGHT if thick else depth_colour(order, len(drawn)), zorder=3 if thick else 2)
        axis.set_yscale("log")
        axis.set_xlabel("step")
        axis.set_ylabel("gradient L2 norm")
        axis.set_title(f"per-layer gradient norm, {phase}")
    draw_skipped([pre_axis, post_axis, *axes[3:]], remedies)
    handles, labels = pre_axis.get_legend_handles_labels()  # the same lines in both panels: one legend, below
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6), fontsize="small")
    _depth_profile(depth_axis, series, figure)
    if remedies.factors:
        draw_factors(axes[3], remedies)
    if scalars:
        draw_run_scalars(axes[-1], scalars)
    return _saved(figure, out)


def _panels(columns: int, scalars: bool):
    """The figure and its axes: ``columns`` panels side by side, and where the log has its ``scalars`` (the loss,
    the global norm) one more under the pre- and post-clip norms, sharing their step axis, last in the list."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    width = 16 * columns / 3
    if not scalars:
        figure, axes = plt.subplots(1, columns, figsize=(width, 5.4), layout="constrained")
        return figure, list(axes)
    top = [f"panel{column}" for column in range(columns)]
    figure, named = plt.subplot_mosaic([top, ["scalars", "scalars"] + ["."] * (columns - 2)],
                                       figsize=(width, 5.4 + SCALARS_HEIGHT), height_ratios=(5.4, SCALARS_HEIGHT),
                                       layout="constrained")
    named["scalars"].sharex(named["panel0"])
    return figure, [named[name] for name in top] + [named["scalars"]]


def _saved(figure, out: str):
    """``figure`` written to ``out`` and closed (pyplot keeps every open figure: a process drawing many, the
    tests or a notebook, would hold them all); returned for a caller that inspects it."""
    from matplotlib import pyplot as plt

    figure.savefig(out)
    plt.close(figure)
    return figure


def plot_run(source: str, out: str, layers: str = "all"):
    """``plot``'s figure of any log ``source`` (``log_sources``), of the ``layers`` it selects (``plot --layers``;
    ``LayerSeries.selected``), the layer that rose most at each of its fires among the lines, and what its remedies
    did; returns the matplotlib Figure."""
    series = read_layer_series(source).selected(layers)
    spikes = localise_all(read_fires(source))
    return plot_layer_norms(series, out, [layer for layer in spiked_layers(spikes) if layer in series.layers()],
                            read_remedies(source), read_run_scalars(source))


def _depth_profile(axis, series: LayerSeries, figure) -> None:
    """The heatmap of every logged layer's log10 pre-clip norm, stack after stack, split by white lines."""
    layers = series.layers()
    steps = sorted({step for step, _ in series.series("pre-clip", "norm", layers[0])})
    grid = []
    for layer in layers:
        by_step = dict(series.series("pre-clip", "norm", layer))
        grid.append([math.log10(by_step[s]) if by_step.get(s, 0) > 0 and math.isfinite(by_step[s]) else math.nan
                     for s in steps])
    image = axis.imshow(grid, aspect="auto", origin="lower", interpolation="nearest",
                        extent=(steps[0], steps[-1], -0.5, len(layers) - 0.5))
    names = [" ".join(str(part) for part in layer_position(layer) if part is not None) for layer in layers]
    axis.set_yticks(range(len(layers)), names, fontsize="small")
    for row in range(1, len(layers)):
        if layer_position(layers[row])[0] != layer_position(layers[row - 1])[0]:
            axis.axhline(row - 0.5, color="white", linewidth=2)
    axis.set_xlabel("step")
    axis.set_ylabel("layer" if series.stacks() == [None] else "stack, layer")
    axis.set_title("depth profile: log10 pre-clip norm")
    figure.colorbar(image, ax=axis)


def plot_spike_history(fires: List[Fire], spikes: List[Dict], out: str):
    """One row per fire (``fires.read_fires``, with their ``spike.localise``): left, every layer's pre-clip
    norm over the recorded steps, the layer that rose most drawn thick and named; beside it, where the log holds
    the update-to-weight ratio (``optimizer_statistics`` with ``update`` and ``param``), every layer's ratio,
    the same layer drawn thick (one highlighted layer per fire); right, each layer's rise, log10 of its norm over
    its median before the fire, layer against step. Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    ratios = any(fire.series.get(UPDATE_TO_WEIGHT) for fire in fires)
    columns = 3 if ratios else 2
    figure, axes = plt.subplots(len(fires), columns, figsize=(6.5 * columns, 4.2 * len(fires)), squeeze=False,
                                layout="constrained")
    for row, fire, spike in zip(axes, fires, spikes):
        _recorded_lines(row[0], fire.norms, spike["layers"], spike["rose_most"], fire.fired_at)
        row[0].set_ylabel("pre-clip gradient L2 norm")
        words = figure_words(spike)
        _title(row[0], f"recorded steps of the fire at step {fire.fired_at}, every layer", words)
        if ratios:
            _update_to_weight(row[1], fire, spike)
        _rise_map(row[-1], fire, spike, figure)
    return _saved(figure, out)


TITLE_CHARACTERS = 58
"""A ``plot --history`` panel's title lines at most this long: a 6.5-inch panel holds about 60 characters at
matplotlib's medium font size, so wrapped titles never run into their neighbours' (constrained layout makes
room above the panels for their lines, not beside them)."""


def _title(axis, *parts: str) -> None:
    """``axis``'s title, its parts on lines of their own, each wrapped to ``TITLE_CHARACTERS``."""
    lines = [line for part in parts if part for line in textwrap.wrap(part, TITLE_CHARACTERS)]
    axis.set_title("\n".join(lines), fontsize="medium")


def _recorded_lines(axis, series: Dict, layers: Iterable[LayerId], marked, fired_at: int) -> None:
    """Each of ``layers``' ``series`` over the recorded steps, on a log scale, the ``marked`` layer thick and red,
    the others from the depth colour map."""
    layers = [layer for layer in layers if series.get(layer)]
    for position, layer in enumerate(layers):
        points = series[layer]
        thick = layer == marked
        axis.plot([step for step, _ in points], [value for _, value in points], marker=".",
                  color=HIGHLIGHT if thick else depth_colour(position, len(layers)),
                  linewidth=2.5 if thick else 1, zorder=3 if thick else 2,
                  label=layer_title(layer) if thick or position in (0, len(layers) - 1) else None)
    axis.axvline(fired_at, color="grey", linestyle="--", linewidth=1, label=f"fire, step {fired_at}")
    axis.set_yscale("log")
    axis.set_xlabel("step")
    axis.legend(**LEGEND_BELOW)


def _update_to_weight(axis, fire: Fire, spike: Dict) -> None:
    """Every layer's update-to-weight ratio over the recorded steps, the row's one highlighted layer (the one that
    rose most) marked as in the gradient's panel; the title names the layer whose signal moved first."""
    ratios = fire.series.get(UPDATE_TO_WEIGHT, {})
    if not ratios:
        _title(axis, "update/weight: not recorded at this fire")
        return
    _recorded_lines(axis, ratios, ratios, spike["rose_most"], fire.fired_at)
    axis.set_ylabel("|update| / |weights|")
    claim = (spike["attribution"] or {}).get("verdict")
    _title(axis, "update-to-weight ratio, every layer" + (f"; first to move: {claim['signal_name']} of "
                                                          f"{claim['where']}" if claim else ""))


def _rise_map(axis, fire: Fire, spike: Dict, figure) -> None:
    layers = list(spike["layers"])
    if not layers:  # nothing to map: the fire recorded no layer bucket
        _title(axis, "rise: no layer bucket was recorded")
        return
    steps = sorted({step for points in fire.norms.values() for step, _ in points})
    grid = []
    for layer in layers:
        baseline, by_step = spike["layers"][layer]["baseline"], dict(fire.norms[layer])
        grid.append([math.log10(by_step[s] / baseline) if baseline > 0 and by_step.get(s, 0) > 0
                     and math.isfinite(by_step[s]) else math.nan for s in steps])
    image = axis.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", cmap="magma",
                        extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(layers) - 0.5))
    axis.set_yticks(range(len(layers)), [layer_title(layer) for layer in layers], fontsize="small")
    axis.set_xlabel("step")
    _title(axis, "rise: log10 of the norm over the layer's baseline")
    figure.colorbar(image, ax=axis)
