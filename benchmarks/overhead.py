"""Cost of per-layer gradient statistics: the whole benchmark of issue 6, by one command.

    python benchmarks/overhead.py [--quick] [--only steps|stats|scaling|memory|plot]

Writes into benchmarks/results/ a Markdown table and a JSON file per part, then the PNG of all parts:

- overhead.md         step time with and without the statistics, and today's alternatives
                      (``safe_get_full_grad`` loop, module backward hooks, per-parameter ``.norm()`` loop),
                      ZeRO-1/2 (and without ZeRO), 12 layers hidden 256 and 24 layers hidden 512, 2 ranks
                      (step_time.py)
- statistics_alone.md the statistics computation alone against one read of the partition and DeepSpeed's
                      norm, before and after the issue-6 change, and what each pass costs (stats_alone.py)
- fused_statistics.md the fused kernel beside the stock operators, one read and DeepSpeed's norm, 1M to 50M
                      elements, 12 to 10,000 buckets (fused_alone.py)
- scaling.md          cost against layers (4 to 96) and parameters per rank; collectives per measured
                      step against layers (scaling.py)
- memory.md           extra peak memory against layers and partition size (memory.py)
- benchmarks.png      all of the above (plot.py)

Timings on a shared machine are noisy, so every figure is a ratio of interleaved iterations or rounds
of the same run, reported as median and interquartile range. The full run takes about 11 minutes on
2 cores; ``--quick`` about 2.
"""

import argparse
import time

import fused_alone
import memory
import scaling
import stats_alone
import step_time
from common import read_results, write_results

PARTS = ("steps", "stats", "scaling", "memory", "plot")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, rounds and sizes")
    parser.add_argument("--only", choices=PARTS, help="run one part (plot: redraw from the JSON files)")
    args = parser.parse_args()
    wanted = PARTS if args.only is None else (args.only, )
    start = time.time()
    if "steps" in wanted:
        write_results("overhead", *step_time.run(args.quick))
    if "stats" in wanted:
        write_results("statistics_alone", *stats_alone.run(args.quick))
        write_results("fused_statistics", *fused_alone.run(args.quick))
    rank_rows = ()
    if "scaling" in wanted:
        lines, data = scaling.run(args.quick)
        write_results("scaling", lines, data)
        rank_rows = data["collectives"]
    if "memory" in wanted:
        if not rank_rows:  # --only memory: the step rows of the last scaling run, if any
            rank_rows = (read_results("scaling") or {}).get("collectives", ())
        write_results("memory", *memory.run(args.quick, rank_rows))
    if "plot" in wanted:
        import plot

        print(f"wrote {plot.plot()}")
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
