"""Cost of the flight recorder (``trigger.history``): per-step time with it on against off, in one run, the
cost of one fire, and the ring's memory.

    python benchmarks/recorder.py [--steps N] [--history K]

Writes benchmarks/results/recorder.md and recorder.json. One engine (TinyGPT, 12 layers, hidden 256,
ZeRO-2, 2 CPU ranks of one thread) with a trigger that never fires (``grad_norm_factor`` 1e9) and nothing
measured on an interval: every other iteration runs with the ring attached (every step recorded), the
others without it (the trigger alone, with its one host sync per step). Each figure is the ratio of an
iteration to the mean of its two neighbours, as in step_time.py, and the time spent inside the call sites.
A fire's cost is the ring's reduction alone (one collective, K x (buckets + 1) x 9 float64), timed against
the median step.
"""

import argparse
import statistics
import time
from typing import Any, Dict, List, Tuple

from common import machine, mib, paired_ratios, percent, spread, write_results
from step_time import Spec, model_config, time_call_sites, tiny_engine

from megatron_integration.tiny_gpt import TinyGPT, synthetic_batch


def bench_rank(spec: Spec, history: int) -> Dict[str, Any]:
    """Tagged iteration times (``True``: recorder on), the seconds inside the call sites, the fire's cost."""
    from deepspeed import comm as dist

    inside = time_call_sites()
    engine = tiny_engine(spec, {"enabled": False, "trigger": {"grad_norm_factor": 1e9, "history": history}})
    config = model_config(spec)
    adapter = engine.layer_grad_norms
    recorder, rank = adapter.spikes.recorder, dist.get_rank()
    timings: Dict[str, List[Tuple[bool, float]]] = {"step": [], "inside": []}
    for step in range(4 + spec.steps):
        recording = step % 2 == 1
        adapter.spikes.recorder = recorder if recording else None
        batch = synthetic_batch(config, spec.micro_batch, seed=step * 7 + rank)
        inside_before = inside[0]
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(batch))
        engine.step()
        dist.barrier()
        if step >= 4:  # warm-up
            timings["step"].append((recording, time.perf_counter() - start))
            timings["inside"].append((recording, inside[0] - inside_before))
    fires = []
    for _ in range(10):
        dist.barrier()
        start = time.perf_counter()
        recorder.replay(adapter.process_group, adapter.layer_map.keys, adapter.extra)
        fires.append(time.perf_counter() - start)
    engine.destroy()
    return {"timings": timings, "fire": fires, "ring_bytes": recorder.nbytes, "rows": adapter.layer_map.num_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--history", type=int, default=16)
    options = parser.parse_args()
    from megatron_integration.cpu_launch import launch

    spec = Spec(12, 256, 2, options.steps, threads=1)
    result = launch(bench_rank, 2, spec, options.history)[0]
    timings = result["timings"]
    step_ratio = spread(paired_ratios(timings["step"]))
    median_step = statistics.median(seconds for _, seconds in timings["step"])
    inside_on = statistics.median(seconds for on, seconds in timings["inside"] if on)
    inside_off = statistics.median(seconds for on, seconds in timings["inside"] if not on)
    fire = statistics.median(result["fire"])
    params = sum(p.numel() for p in TinyGPT(model_config(spec)).parameters())
    data = {"machine": machine(), "step_ratio": step_ratio, "inside_share_on": inside_on / median_step,
            "inside_share_off": inside_off / median_step, "fire_share": fire / median_step,
            "ring_bytes": result["ring_bytes"], "rows": result["rows"], "history": options.history,
            "params": params}
    lines = [
        "# Cost of the flight recorder (`trigger.history`)", "", f"Machine: {data['machine']}.", "",
        f"TinyGPT, 12 layers, hidden 256 ({params / 1e6:.1f}M parameters), ZeRO-2, 2 CPU ranks (gloo) of one "
        f"thread, AdamW, clipping 1.0, micro-batch 4 of 64 tokens; K = {options.history}, a trigger that never "
        "fires, no interval measurement. The recorder is attached on every other iteration of the same engine "
        "(`benchmarks/recorder.py`, one run); ratios are an iteration with it over the mean of its two "
        "neighbours without it.", "",
        "| what | value |", "| --- | --- |",
        f"| step time, recorder on / off | {percent(step_ratio)} |",
        f"| time inside the call sites, share of the step: recorder on | {inside_on / median_step * 100:.2f}% |",
        f"| time inside the call sites, share of the step: recorder off (trigger only) "
        f"| {inside_off / median_step * 100:.2f}% |",
        f"| one fire (the ring reduced in one collective and turned into {options.history} results), "
        f"share of a step | {fire / median_step * 100:.1f}% |",
        f"| ring memory: K x (buckets + 1) x 9 x 8 bytes = {options.history} x {result['rows'] + 1} x 72 "
        f"| {mib(result['ring_bytes'])} |",
        "",
        "A recorded step adds no collective and no host copy: one fused read of the local partition (as a "
        "measured step does) and a device copy of its (buckets + 1) x 9 table into the ring. On a machine "
        "shared with other jobs the step-time ratio's spread is their noise; the time inside the call sites "
        "is the recorder's own cost, measured directly.",
    ]
    write_results("recorder", lines, data)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
