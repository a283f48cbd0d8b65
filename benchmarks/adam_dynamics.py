"""How far each signal the spike rules judge moves under Adam, for a known cause: the table behind
``megatron_integration.spike.THRESHOLDS`` (docs/spikes.md).

Plain PyTorch, one process (``tests/adam_dynamics.py``): a TinyGPT of 4 layers trained by AdamW or Adam for 120
steps; at step 100 a cause is injected (one layer's gradient, or every layer's, times 3, 10 or 100; the learning
rate times 3 or 10, for one step or held), with clipping off or at 1.0. A signal's move is its largest norm over
steps 100-102 over its level (the median of steps 92-99), of the injected layer (layer 1) or the median over layers
for a cause of every layer. The quiet rows are the same run without a cause, steps 30-120: ``step to step``, a
step's norm over the median of the 8 before it (the largest, over layers); ``drift``, a step's norm over the median
of steps 16 to 9 before it (the last of 8 recorded steps against the level before them).

    python benchmarks/adam_dynamics.py [--out benchmarks/results/adam_dynamics.md]
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from adam_dynamics import Cause, Run, train  # noqa: E402

from megatron_integration.spike import SIGNAL_NAMES, SIGNALS, THRESHOLDS  # noqa: E402

STEP, LAYER = 100, 1
ORDER = ("pre_clip", "update", "update_to_weight", "exp_avg", "exp_avg_sq")
CAUSES = {
    "gradient x3, layer 1": Cause("gradient", STEP, 3.0, LAYER),
    "gradient x10, layer 1": Cause("gradient", STEP, 10.0, LAYER),
    "gradient x100, layer 1": Cause("gradient", STEP, 100.0, LAYER),
    "gradient x10, every layer": Cause("gradient", STEP, 10.0),
    "lr x3, one step": Cause("lr", STEP, 3.0),
    "lr x10, held": Cause("lr", STEP, 10.0, steps=100),
    "lr x3000, one step": Cause("lr", STEP, 3000.0),
}
RUNS = {
    "AdamW, betas (0.9, 0.999)": Run(),
    "AdamW, clip 1.0": Run(clip=1.0),
    "Adam, betas (0.9, 0.95)": Run(optimizer="adam", betas=(0.9, 0.95)),
}


def move(series, signal: str, layer) -> float:
    """The signal's largest norm over steps 100-102 over its median over steps 92-99."""
    values = dict(series[signal][layer])
    level = statistics.median(values[step] for step in range(STEP - 8, STEP))
    return max(values[step] for step in range(STEP, STEP + 3)) / level


def quiet(series, signal: str, lag: int) -> float:
    """The largest norm of steps 30-120 over the median of the 8 steps ending ``lag`` steps before it."""
    worst = 0.0
    for points in series[signal].values():
        values = dict(points)
        for step in range(30, max(values) + 1):
            level = statistics.median(values[earlier] for earlier in range(step - lag - 7, step - lag + 1))
            worst = max(worst, values[step] / level)
    return worst


def table() -> str:
    header = "| run | cause | " + " | ".join(SIGNAL_NAMES[signal] for signal in ORDER) + " |"
    lines = [header, "|" + "---|" * (2 + len(ORDER))]
    for run_name, run in RUNS.items():
        calm = train(Cause(), run)
        for label, lag in (("quiet, step to step", 1), ("quiet, drift over 8 recorded steps", 9)):
            lines.append(f"| {run_name} | {label} | " + " | ".join(f"{quiet(calm, signal, lag):.2f}"
                                                                  for signal in ORDER) + " |")
        for cause_name, cause in CAUSES.items():
            series = train(cause, run)
            row = []
            for signal in ORDER:
                if cause.layer is None:
                    row.append(statistics.median(move(series, signal, layer) for layer in series[signal]))
                else:
                    row.append(move(series, signal, cause.layer))
            lines.append(f"| {run_name} | {cause_name} | " + " | ".join(f"{value:.2f}" for value in row) + " |")
        print(f"{run_name}: done", file=sys.stderr)
    rules = ", ".join(f"{SIGNAL_NAMES[signal]} {THRESHOLDS[signal]:g}x" for signal in SIGNALS)
    return "\n".join(lines) + f"\n\nThe rules: a signal departs above {rules} its level.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = parser.parse_args()
    text = table()
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write("# Adam dynamics: how far each signal moves (benchmarks/adam_dynamics.py)\n\n" + text)


if __name__ == "__main__":
    main()
