"""How far each signal moves when a gradient spikes or the learning rate jumps, on real DeepSpeed runs: the
measurements behind the spike report's departure rules (issue 37, item 2). Not a test.

Each run trains the tiny Pre-LN GPT of tests/scenario_workers.py (4 layers, width 32) under ZeRO-2 on 2 CPU ranks,
with Adam or AdamW, clipping at 1.0 or off, ``optimizer_statistics`` (``param``, ``update``, ``exp_avg``,
``exp_avg_sq``) and the flight recorder (``trigger.history``) on, every step measured. At ``--spike-step`` S one
injection: layer 1's gradient times 3, 10 or 100, or the loss (every layer's gradient) times 10, or the learning
rate 10x for that step. For every layer and signal (the pre-clip gradient norm, the update's norm, the
update-to-weight ratio, ``exp_avg``'s and ``exp_avg_sq``'s norms) it reports the value at S and the steps after,
over its level before (the median of the ``BEFORE`` steps before S) and over the same step of a run without the
injection (the control: same seed, same data); the JSON keeps every bucket's norms of every step. One launch
runs every run.

    PYTHONPATH=. python3 benchmarks/spike_calibration.py   # writes results/spike_calibration.{md,json}
"""

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from common import machine, write_results  # noqa: E402

from scenario_workers import MODEL, launch_runs  # noqa: E402

BEFORE = 8
"""The steps before the spike whose median is a signal's level: as many as a fire's recorded steps in the
scenarios (``trigger.history``)."""
HIT_LAYER = 1
"""The layer whose gradient the per-layer injections scale."""
GRADIENT_FACTORS = (3, 10, 100)
"""The factors layer ``HIT_LAYER``'s gradient is scaled by at the spike step."""
LOSS_FACTORS = (10, )
"""The factors the loss (every layer's gradient) is scaled by: one, to keep the launch short on shared cores."""
SIGNALS = ("pre_clip", "update", "ratio", "exp_avg", "exp_avg_sq")
SIGNAL_NAMES = {"pre_clip": "gradient", "update": "update", "ratio": "update/weight", "exp_avg": "exp_avg",
                "exp_avg_sq": "exp_avg_sq"}
CONFIGS = {
    "AdamW, clip 1.0": {"optimizer": "adamw", "clip": 1.0},
    "AdamW, no clip": {"optimizer": "adamw", "clip": 0.0},
    "Adam, clip 1.0": {"optimizer": "adam", "clip": 1.0},
    "Adam, no clip": {"optimizer": "adam", "clip": 0.0},
}


def injections(step: int) -> Dict[str, List[Dict]]:
    """Each injection's faults at ``step`` (scenario_workers' kinds); ``control``: none."""
    found: Dict[str, List[Dict]] = {"control": []}
    for factor in GRADIENT_FACTORS:
        found[f"layer {HIT_LAYER} gradient {factor}x"] = [{"kind": "grad", "step": step, "layer": HIT_LAYER,
                                                           "factor": factor}]
    for factor in LOSS_FACTORS:
        found[f"loss {factor}x"] = [{"kind": "loss", "step": step, "factor": factor}]
    found["lr 10x, one step"] = [{"kind": "lr", "step": step, "until": step + 1, "factor": 10}]
    return found


def series(norms: List[Dict]) -> Dict[str, Dict[str, List[float]]]:
    """Per signal and layer, the norm of every step (index 0: step 1); ``ratio`` is update over weights."""
    layers = [str(layer) for layer in range(MODEL.num_layers)]
    found = {signal: {layer: [step[signal][layer] for step in norms] for layer in layers}
             for signal in SIGNALS if signal != "ratio"}
    found["ratio"] = {layer: [step["update"][layer] / step["param"][layer] for step in norms] for layer in layers}
    return found


def movement(run: Dict, control: Dict, step: int, after: int) -> Dict[str, Dict[str, Dict[str, List[float]]]]:
    """Per signal and layer, the value at ``step`` .. ``step + after`` over its level before (``vs_before``) and
    over the control run's value at the same step (``vs_control``)."""
    measured, baseline = series(run["norms"]), series(control["norms"])
    moved = {}
    for signal, layers in measured.items():
        moved[signal] = {}
        for layer, values in layers.items():
            level = statistics.median(values[step - 1 - BEFORE:step - 1])
            around = range(step - 1, step + after)
            moved[signal][layer] = {"vs_before": [values[index] / level for index in around],
                                    "vs_control": [values[index] / baseline[signal][layer][index] for index in around]}
    return moved


def summary(moved: Dict[str, Dict], configs: List[str]) -> List[str]:
    """Per injection and signal, layer ``HIT_LAYER``'s value at the spike step over its level before: the range
    over the configurations (then, in brackets, the range of the largest over the steps from S on)."""
    injected = list(moved[configs[0]])
    lines = [f"| injection | {' | '.join(SIGNAL_NAMES[signal] for signal in SIGNALS)} |",
             "|---|" + "---|" * len(SIGNALS)]
    for injection in injected:
        cells = []
        for signal in SIGNALS:
            rises = [moved[config][injection][signal][str(HIT_LAYER)]["vs_before"] for config in configs]
            cells.append(f"{_range([rise[0] for rise in rises])} ({_range([max(rise) for rise in rises])})")
        lines.append(f"| {injection} | {' | '.join(cells)} |")
    return lines + [""]


def rounded(norms: List[Dict]) -> List[Dict]:
    """Each step's norms to 4 significant digits, without ``post_clip`` (the table's figures come from the other
    signals): the raw JSON stays small."""
    return [{signal: {key: float(f"{value:.4g}") for key, value in buckets.items()}
             for signal, buckets in step.items() if signal != "post_clip"} for step in norms]


def _range(values: List[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spike-step", type=int, default=12, help="the step of every injection (S)")
    parser.add_argument("--after", type=int, default=3, help="the steps after S reported")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), help="a subset of: " + ", ".join(CONFIGS))
    parser.add_argument("--workdir", default="/tmp/spike_calibration")
    options = parser.parse_args()
    step, after = options.spike_step, options.after
    runs = {f"{config}: {injection}": {**CONFIGS[config], "faults": faults, "steps": step + after,
                                       "every_step": True, "tensorboard": False}
            for config in options.configs for injection, faults in injections(step).items()}
    os.makedirs(options.workdir, exist_ok=True)
    started = time.time()
    results = launch_runs(runs, options.workdir, timeout=6 * 3600)
    failed = {name: record["error"] for name, record in results.items() if "error" in record}
    if failed:
        raise SystemExit(f"runs failed: {failed}")
    moved = {config: {injection: movement(results[f"{config}: {injection}"], results[f"{config}: control"], step,
                                          after)
                      for injection in injections(step) if injection != "control"} for config in options.configs}
    lines = [
        "# Spike calibration: how far each signal moves", "",
        f"`benchmarks/spike_calibration.py` on {machine()}; {len(runs)} runs in one launch, "
        f"{time.time() - started:.0f} s.", "",
        f"Tiny Pre-LN GPT (tests/scenario_workers.py: {MODEL.num_layers} layers, width {MODEL.hidden}, micro-batch 4"
        f" on each of 2 CPU ranks), DeepSpeed ZeRO-2, fp32, lr 1e-3, weight decay 0.01, betas (0.9, 0.999); "
        f"`optimizer_statistics` all four kinds, the flight recorder on (history 8), every step measured. At step "
        f"S = {step} one injection: layer {HIT_LAYER}'s gradient (a hook on its parameters' gradients, every "
        "rank, before the reduction), or the loss (every layer's gradient), times the factor; or the learning rate "
        "10x for step S only. Each value is a layer's norm of that signal at that step over its level before: the "
        f"median of steps S-{BEFORE} to S-1 of the same run (what a judge of the recorded steps sees); "
        "'/ control' divides by the same step of a run without the injection (same seed and data) instead. "
        "'update/weight' is the update's norm over the weights' norm. The raw numbers, every layer, are in "
        "spike_calibration.json, written beside this table (not kept in git), and so is each configuration's "
        "table: per injection and signal, every layer over its level before at S to S+3 and over the control run "
        "at S ('moved').", ""]
    lines += [f"## Layer {HIT_LAYER} at S over its level before, range over the {len(options.configs)} "
              "configurations (in brackets: of the largest from S to the last step reported)", ""]
    lines += summary(moved, options.configs)
    write_results("spike_calibration", lines, {"spike_step": step, "after": after, "before": BEFORE, "moved": moved,
                                               "hit_layer": HIT_LAYER, "machine": machine(),
                                               "norms": {name: rounded(record["norms"])
                                                         for name, record in results.items()},
                                               "losses": {name: record["losses"] for name, record in results.items()},
                                               "fires": {name: record["fires"] for name, record in results.items()}})


if __name__ == "__main__":
    main()
