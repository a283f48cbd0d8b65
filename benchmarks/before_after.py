"""Step cost of two versions of the package, in one run: launches of each alternate, round after round.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before [--rounds 3] [--steps 20] [--name refactor]

Each launch runs that version's own ``benchmarks/step_time.py`` ``bench_rank`` (per-layer statistics on
every other step, the time spent inside the call sites added up) on 2 CPU ranks, the model of the issue-6
table (12 layers, hidden 256, ZeRO-2, one thread per rank). The two versions take turns, so that the
machine's load drifts over both alike. Writes ``results/before_after_<name>.md`` and ``.json``.
"""

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

from common import machine, paired_ratios, percent, spread, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.dirname(HERE)
LAUNCH = ("import json, sys\n"
          "from step_time import Spec, bench_rank\n"
          "from megatron_integration.cpu_launch import launch\n"
          "timings = launch(bench_rank, 2, Spec({layers}, {hidden}, {stage}, {steps}, threads=1), timeout=1800)[0]\n"
          "print('TIMINGS', json.dumps({{k: timings[k] for k in ('layer_stats', 'inside')}}))\n")


def run_version(root: str, layers: int, hidden: int, stage: int, steps: int) -> Dict[str, list]:
    """One launch of the package under ``root``: its tagged step times and the time inside its call sites."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "benchmarks")])}
    script = LAUNCH.format(layers=layers, hidden=hidden, stage=stage, steps=steps)
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                            check=True)
    line = next(line for line in result.stdout.splitlines() if line.startswith("TIMINGS "))
    return json.loads(line.removeprefix("TIMINGS "))


def summarize(launches: List[Dict[str, list]]) -> Dict[str, dict]:
    """Step-time ratio of measured steps to their unmeasured neighbours, and the time inside the call
    sites on measured steps as a share of the median unmeasured step, over all launches of a version."""
    ratios, shares = [], []
    for timings in launches:
        tagged = [tuple(pair) for pair in timings["layer_stats"]]
        baseline = spread([seconds for measured, seconds in tagged if not measured])["median"]
        ratios += paired_ratios(tagged)
        shares += [seconds / baseline for measured, seconds in timings["inside"] if measured]
    return {"ratio": spread(ratios), "inside": spread(shares)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the version to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--name", default="refactor")
    args = parser.parse_args()
    versions = {"before": os.path.abspath(args.before), "after": AFTER}
    launches: Dict[str, List[dict]] = {name: [] for name in versions}
    for _ in range(args.rounds):
        for name, root in versions.items():
            launches[name].append(run_version(root, args.layers, args.hidden, args.stage, args.steps))
    rows = {name: summarize(runs) for name, runs in launches.items()}
    commits = {name: subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() for name, root in versions.items()}
    lines = [
        f"# Step cost before and after ({args.name})", "", f"Machine: {machine()}.", "",
        f"{args.layers} layers, hidden {args.hidden}, ZeRO-{args.stage}, 2 CPU ranks of one thread; "
        f"{args.rounds} launches of each version, alternating; {args.steps} steps each after warm-up, every other "
        "step measured (all layers, pre and post clip).", "",
        "| version | commit | step time, measured / unmeasured neighbours | time inside the call sites, "
        "share of the step (median, IQR) |", "| --- | --- | --- | --- |"
    ]
    for name, row in rows.items():
        inside = row["inside"]
        lines.append(f"| {name} | {commits[name]} | {percent(row['ratio'])} | {inside['median'] * 100:.2f}% "
                     f"({inside['q1'] * 100:.2f}-{inside['q3'] * 100:.2f}, n={inside['n']}) |")
    print("\n".join(lines))
    write_results(f"before_after_{args.name}", lines, {"commits": commits, "rows": rows, "launches": launches})


if __name__ == "__main__":
    main()
