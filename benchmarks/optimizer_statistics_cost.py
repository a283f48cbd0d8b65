"""Step share of ``optimizer_statistics`` (issue 31): all four kinds on, against the gradient statistics alone.

    python benchmarks/optimizer_statistics_cost.py [--quick]

For each model of the step-time table (10M: 12 layers hidden 256; 77M: 24 layers hidden 512) under ZeRO-1 and
ZeRO-2 (fp32, AdamW, clipping 1.0, 2 CPU ranks of one thread), one launch builds two engines in turn, round
after round: one with the gradient statistics alone, one with ``optimizer_statistics: [param, update, exp_avg,
exp_avg_sq]``, both ``interval: 2``. Per iteration it adds up the seconds spent inside the call sites
(``step_time.time_call_sites``) and, of those, inside the optimizer statistics' read
(``OptimizerStatistics.accumulate``: the weights and moments read once by the host kernel, which derives the
update per element), as a share of the median unmeasured step; and the ratio of a measured step to its
unmeasured neighbours. Writes ``results/optimizer_statistics_cost.md`` and ``.json``.
"""

import argparse
import time
from typing import Callable, Dict, List, Tuple

from common import machine, paired_ratios, percent, spread, write_results
from step_time import Spec, iterations, layer_stats_timings, model_config, time_call_sites, tiny_engine

from megatron_integration.tiny_gpt import TinyGPT

KINDS = ["param", "update", "exp_avg", "exp_avg_sq"]
BLOCKS = {"gradient": {"enabled": True, "interval": 2},
          "all four": {"enabled": True, "interval": 2, "optimizer_statistics": KINDS}}


def time_optimizer_read() -> List[float]:
    """Wrap ``OptimizerStatistics.accumulate`` to add up its seconds into the returned one-element list."""
    from deepspeed_patch.optimizer_state.optimizer_stats import OptimizerStatistics

    spent = [0.0]
    original = OptimizerStatistics.accumulate

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    OptimizerStatistics.accumulate = timed
    return spent


def bench_rank(spec: Spec, rounds: int) -> Dict[str, Dict[str, list]]:
    """Per block, the tagged step times, seconds inside the call sites and inside the optimizer read, over
    ``rounds`` engines each, the blocks taking turns."""
    inside, read = time_call_sites(), time_optimizer_read()
    timings: Dict[str, Dict[str, list]] = {name: {} for name in BLOCKS}
    for _ in range(rounds):
        for name, block in BLOCKS.items():
            engine = tiny_engine(spec, block)
            reads: List[float] = []
            steps = layer_stats_timings(engine, reading(iterations(engine, spec), read, reads), spec.steps, inside)
            tags = [measured for measured, _ in steps["inside"]]
            steps["read"] = list(zip(tags, reads[-spec.steps:]))
            for key, values in steps.items():
                timings[name].setdefault(key, []).extend(values)
            engine.destroy()
    return timings


def reading(iteration: Callable[..., float], read: List[float], reads: List[float]) -> Callable[..., float]:
    """``iteration`` that also appends to ``reads`` the seconds the optimizer read took in it."""

    def wrapped(step: int, **options) -> float:
        before = read[0]
        seconds = iteration(step, **options)
        reads.append(read[0] - before)
        return seconds

    return wrapped


def _share(values: List[float], step: float) -> str:
    shares = spread([value / step for value in values])
    return f"{shares['median'] * 100:.2f}% ({shares['q1'] * 100:.2f}-{shares['q3'] * 100:.2f})"


def specs(quick: bool) -> List[Tuple[Spec, int]]:
    """(spec, rounds): one thread per rank, 2 ranks on 2 cores."""
    if quick:
        return [(Spec(12, 256, 2, 10, threads=1), 1)]
    return ([(Spec(12, 256, stage, 20, threads=1), 2) for stage in (1, 2)]
            + [(Spec(24, 512, stage, 8, threads=1), 1) for stage in (1, 2)])


def run(quick: bool) -> Tuple[List[str], dict]:
    from megatron_integration.cpu_launch import launch

    data = {"machine": machine(), "rows": []}
    lines = [
        "# Cost of optimizer_statistics: step share with all four kinds", "", f"Machine: {data['machine']}.", "",
        __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
        "| model | ZeRO | params | unmeasured step | block | inside the call sites, measured step "
        "| of which the optimizer read | measured step / neighbours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"
    ]
    for spec, rounds in specs(quick):
        timings = launch(bench_rank, 2, spec, rounds, timeout=3600)[0]
        params = sum(p.numel() for p in TinyGPT(model_config(spec)).parameters())
        baseline = spread([s for name in BLOCKS for m, s in timings[name]["layer_stats"] if not m])["median"]
        for name in BLOCKS:
            steps = timings[name]
            inside = [s for m, s in steps["inside"] if m]
            read = [s for m, s in steps["read"] if m]
            ratio = spread(paired_ratios(steps["layer_stats"]))
            data["rows"].append({"layers": spec.num_layers, "hidden": spec.hidden, "zero": spec.zero_stage,
                                 "params": params, "block": name, "step_seconds": baseline,
                                 "inside_measured": spread([s / baseline for s in inside]),
                                 "read_measured": spread([s / baseline for s in read]), "ratio": ratio})
            row = (f"| {spec.num_layers} layers, hidden {spec.hidden} | {spec.zero_stage} | {params / 1e6:.1f}M "
                   f"| {baseline * 1000:.0f} ms | {name} | {_share(inside, baseline)} | {_share(read, baseline)} "
                   f"| {percent(ratio)} |")
            print(row, flush=True)
            lines.append(row)
    lines += [
        "", "Shares: median (interquartile range) over the measured steps of all rounds, of the median unmeasured "
        "step of both blocks. The ratio column is the noisy one on this shared machine; the shares inside the "
        "call sites are measured directly (the all-reduces' wait for the other rank included)."
    ]
    return lines, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 10M model under ZeRO-2 only, one round")
    args = parser.parse_args()
    write_results("optimizer_statistics_cost", *run(args.quick))


if __name__ == "__main__":
    main()
