"""Step cost of two versions of the package, in one run: launches of each alternate, round after round.

    git worktree add /tmp/before <commit>
    python benchmarks/before_after.py --before /tmp/before [--models 10M 77M] [--rounds 2] [--steps N] [--name x]

Each launch times one version's package with this checkout's harness, ``step_time.layer_stats_rank``
(per-layer statistics on every other step, the time spent inside the call sites added up, the calls into
``deepspeed.comm`` counted), on 2 CPU ranks of one thread, ZeRO-2, one of the models of the step-time
table (``MODELS``). Both versions run the same harness, so only the package differs; the older one must
have this package's call sites (``hooks.CALL_SITES``, the ``adapters`` package). Within a round every
model runs once per version, the versions taking turns, so that the machine's load drifts over both
alike. Writes ``results/before_after_<name>.md`` and ``.json``.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List

from common import machine, paired_ratios, percent, spread, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
AFTER = os.path.dirname(HERE)
LAUNCH = ("import json\n"
          "from step_time import Spec, layer_stats_rank\n"
          "from megatron_integration.cpu_launch import launch\n"
          "spec = Spec({layers}, {hidden}, {stage}, {steps}, threads=1)\n"
          "print('TIMINGS', json.dumps(launch(layer_stats_rank, 2, spec, timeout=1800)[0]))\n")


@dataclass
class Model:
    layers: int
    hidden: int
    steps: int
    """steps after warm-up per launch, half of them measured (the 77M model's step takes about 4 s)"""


MODELS = {"10M": Model(12, 256, 40), "77M": Model(24, 512, 10)}


def run_version(root: str, model: Model, stage: int, steps: int) -> Dict[str, list]:
    """One launch of the package under ``root``: its tagged step times, time inside its call sites and
    calls into ``deepspeed.comm``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, HERE])}
    script = LAUNCH.format(layers=model.layers, hidden=model.hidden, stage=stage, steps=steps)
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                            check=True)
    line = next(line for line in result.stdout.splitlines() if line.startswith("TIMINGS "))
    return json.loads(line.removeprefix("TIMINGS "))


def extra_collectives(launches: List[Dict[str, list]]) -> Dict[str, float]:
    """Calls into ``deepspeed.comm`` by name that a measured step makes beyond an unmeasured one, on average."""
    means = {}
    for state in (True, False):
        records = [calls for timings in launches for measured, calls in timings["collectives"] if measured == state]
        totals: collections.Counter = collections.Counter()
        for calls in records:
            totals.update(calls)
        means[state] = {name: count / len(records) for name, count in totals.items()}
    extra = {name: means[True].get(name, 0.0) - means[False].get(name, 0.0) for name in means[True] | means[False]}
    return {name: count for name, count in sorted(extra.items()) if count}


def summarize(launches: List[Dict[str, list]]) -> Dict[str, dict]:
    """Step-time ratio of measured steps to their unmeasured neighbours, the time inside the call sites
    on measured steps as a share of the median unmeasured step, that step, and the extra collectives,
    over all launches of a version."""
    ratios, shares, steps = [], [], []
    for timings in launches:
        tagged = [tuple(pair) for pair in timings["layer_stats"]]
        unmeasured = [seconds for measured, seconds in tagged if not measured]
        baseline = spread(unmeasured)["median"]
        steps += unmeasured
        ratios += paired_ratios(tagged)
        shares += [seconds / baseline for measured, seconds in timings["inside"] if measured]
    return {"ratio": spread(ratios), "inside": spread(shares), "step_seconds": spread(steps)["median"],
            "extra_collectives": extra_collectives(launches)}


def share(inside: Dict[str, float]) -> str:
    return f"{inside['median'] * 100:.2f}% ({inside['q1'] * 100:.2f}-{inside['q3'] * 100:.2f}, n={inside['n']})"


def table(rows: Dict[str, Dict[str, dict]], commits: Dict[str, str]) -> List[str]:
    lines = [
        "| model | version | commit | unmeasured step | step time, measured / unmeasured neighbours "
        "| time inside the call sites, share of the step (median, IQR) | extra collectives per measured step |",
        "| --- | --- | --- | ---: | --- | --- | --- |"
    ]
    for model, versions in rows.items():
        for name, row in versions.items():
            calls = ", ".join(f"{count:g} {call}" for call, count in row["extra_collectives"].items()) or "none"
            lines.append(f"| {model} | {name} | {commits[name]} | {row['step_seconds'] * 1000:.0f} ms "
                         f"| {percent(row['ratio'])} | {share(row['inside'])} | {calls} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the version to compare with")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps per launch for every model (default: the model's own)")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--name", default="refactor")
    args = parser.parse_args()
    versions = {"before": os.path.abspath(args.before), "after": AFTER}
    steps = {model: args.steps or MODELS[model].steps for model in args.models}
    load = {"start": os.getloadavg()}
    launches: Dict[str, Dict[str, List[dict]]] = {model: {name: [] for name in versions} for model in args.models}
    for _ in range(args.rounds):
        for model in args.models:
            for name, root in versions.items():
                launches[model][name].append(run_version(root, MODELS[model], args.stage, steps[model]))
    load["end"] = os.getloadavg()
    rows = {model: {name: summarize(runs) for name, runs in runs_of.items()} for model, runs_of in launches.items()}
    commits = {name: subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() for name, root in versions.items()}
    sizes = "; ".join(f"{model}: {MODELS[model].layers} layers, hidden {MODELS[model].hidden}, {steps[model]} steps"
                      for model in args.models)
    lines = [
        f"# Step cost before and after ({args.name})", "", f"Machine: {machine()}. Load average (1, 5, 15 min) "
        f"{', '.join(f'{value:.1f}' for value in load['start'])} at the start, "
        f"{', '.join(f'{value:.1f}' for value in load['end'])} at the end.", "",
        f"ZeRO-{args.stage}, 2 CPU ranks of one thread, both versions timed by the harness of {commits['after']}; "
        f"{args.rounds} launches of each version per model, alternating ({sizes} each after warm-up, every other "
        "step measured: all layers, pre and post clip).", "", *table(rows, commits)
    ]
    print("\n".join(lines))
    write_results(f"before_after_{args.name}", lines, {
        "commits": commits, "load": load, "models": {model: vars(MODELS[model]) for model in args.models},
        "steps": steps, "rows": rows, "launches": launches
    })


if __name__ == "__main__":
    main()
