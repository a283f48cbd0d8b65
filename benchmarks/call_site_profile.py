"""Where the time inside the call sites of a measured step goes, on the 10M model (issue 33's 1% question).

    python benchmarks/call_site_profile.py [--steps N]

Writes results/call_site_profile.md and .json. The step-time harness's engine (TinyGPT, 12 layers, hidden 256,
ZeRO-2, 2 CPU ranks of one thread, ``interval: 2``); on measured steps the seconds inside the call sites are
split into the statistics kernel (``accumulate_partition``), the reduction (``reduce_stats``: its two
all-reduces, including the wait for the other rank), the host copy and the result (``host_copy``,
``step_result``) and the rest (Python). The reduction is also given on the rank that reached it last (the
smaller of the two ranks' figures): the collective's own latency, without the wait for the other rank.
"""

import argparse
import statistics
import time
from typing import Dict, List

from common import machine, write_results
from step_time import Spec, model_config, time_call_sites, tiny_engine

from megatron_integration.tiny_gpt import synthetic_batch

PARTS = ("accumulate_partition", "reduce_stats", "host_copy", "step_result")


def _timed_parts(spent: Dict[str, float]) -> None:
    """Wrap ``PARTS`` where ``measurement`` calls them, adding their seconds to ``spent``."""
    from deepspeed_patch.statistics import measurement

    for name in PARTS:
        original = getattr(measurement, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(measurement, name, timed)


def profile_rank(spec: Spec) -> List[dict]:
    """Per step after warm-up: measured or not, its seconds, the seconds inside the call sites, and ``PARTS``."""
    from deepspeed import comm as dist

    inside = time_call_sites()
    spent = dict.fromkeys(PARTS, 0.0)
    _timed_parts(spent)
    engine = tiny_engine(spec, {"enabled": True, "interval": 2})
    config, rows = model_config(spec), []
    for step in range(4 + spec.steps):
        batch = synthetic_batch(config, spec.micro_batch, seed=step)
        before, inside_before = dict(spent), inside[0]
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(batch))
        engine.step()
        dist.barrier()
        seconds = time.perf_counter() - start
        if step >= 4:
            rows.append({
                "measured": engine.global_steps % 2 == 0,
                "step": seconds,
                "inside": inside[0] - inside_before,
                **{
                    name: spent[name] - before[name]
                    for name in PARTS
                }
            })
    engine.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    options = parser.parse_args()
    from megatron_integration.cpu_launch import launch

    ranks = launch(profile_rank, 2, Spec(12, 256, 2, options.steps, threads=1), timeout=1800)
    measured = [row for row in ranks[0] if row["measured"]]
    step = statistics.median(row["step"] for row in ranks[0] if not row["measured"])
    median = {key: statistics.median(row[key] for row in measured) for key in ("inside", *PARTS)}
    last = statistics.median(
        min(a["reduce_stats"], b["reduce_stats"]) for a, b in zip(ranks[0], ranks[1]) if a["measured"])
    rest = median["inside"] - sum(median[name] for name in PARTS)
    lines = [
        "# Where a measured step's time inside the call sites goes (10M model)",
        "",
        f"Machine: {machine()}.",
        "",
        "TinyGPT, 12 layers, hidden 256, ZeRO-2, 2 CPU ranks (gloo) of one thread, `interval: 2` "
        f"(`benchmarks/call_site_profile.py`, {len(measured)} measured steps, medians, rank 0).",
        "",
        "| what | ms | share of the unmeasured step |",
        "| --- | ---: | ---: |",
        f"| unmeasured step | {step * 1e3:.0f} | |",
        f"| inside the call sites, measured step | {median['inside'] * 1e3:.2f} | {median['inside'] / step:.2%} |",
        *(f"| - {name} | {median[name] * 1e3:.2f} | {median[name] / step:.2%} |" for name in PARTS),
        f"| - the rest (Python: schedule, read points, publishing) | {rest * 1e3:.2f} | {rest / step:.2%} |",
        f"| reduce_stats on the rank that reached it last | {last * 1e3:.2f} | {last / step:.2%} |",
    ]
    write_results("call_site_profile", lines, {
        "machine": machine(),
        "step": step,
        "median": median,
        "reduce_last_rank": last,
        "rows": ranks
    })
    print("\n".join(lines))


if __name__ == "__main__":
    main()
