"""Cost of per-layer statistics: step-time ratios measured in one run, and the statistics alone.

    python benchmarks/overhead.py [--quick] [--only steps|stats]

Writes benchmarks/results/overhead.md (step time) and benchmarks/results/statistics_alone.md.
Timings on a shared machine are noisy, so every figure is a
ratio of interleaved iterations of the same run (measured vs unmeasured with ``interval: 2``;
with vs without a ``safe_get_full_grad`` loop), reported as median and interquartile range.
"""

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List

import torch

from megatron_integration.cpu_launch import launch
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass
class Spec:
    num_layers: int
    hidden: int
    zero_stage: int
    steps: int
    micro_batch: int = 4


def model_config(spec: Spec) -> TinyGPTConfig:
    return TinyGPTConfig(vocab_size=1024, seq_len=64, hidden=spec.hidden, num_layers=spec.num_layers, num_heads=8)


def full_grad_loop(model: torch.nn.Module) -> None:
    """What a user can do today: gather every full gradient, then per-parameter norm, min and max."""
    from deepspeed.utils import safe_get_full_grad

    for param in model.parameters():
        grad = safe_get_full_grad(param)
        torch.stack([grad.norm(), grad.min(), grad.max()]).tolist()


def bench_rank(spec: Spec) -> Dict[str, List]:
    """Per-iteration wall time, tagged measured or not, for both phases; rank 0 returns them."""
    import deepspeed
    from deepspeed import comm as dist

    import deepspeed_patch

    deepspeed_patch.install()
    torch.manual_seed(0)
    model = TinyGPT(model_config(spec))
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": spec.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "layer_grad_norms": {"enabled": True, "interval": 2},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    rank = dist.get_rank()
    timings = {"layer_stats": [], "full_grad_loop": []}

    def iteration(step: int, with_loop: bool) -> float:
        batch = synthetic_batch(model_config(spec), spec.micro_batch, seed=step * 7 + rank)
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(batch))
        if with_loop:
            full_grad_loop(engine.module)
        engine.step()
        dist.barrier()
        return time.perf_counter() - start

    for step in range(4):  # warm-up; leaves the optimizer step count even
        iteration(step, False)
    for step in range(spec.steps):
        seconds = iteration(step, False)
        measured = engine.get_layer_grad_norms()["step"] == engine.global_steps
        timings["layer_stats"].append((measured, seconds))
    for step in range(spec.steps):
        with_loop = step % 2 == 1
        timings["full_grad_loop"].append((with_loop, iteration(step, with_loop)))
    engine.destroy()
    return timings


def paired_ratios(tagged: List) -> List[float]:
    """Each tagged iteration's time over the mean of its untagged neighbours."""
    ratios = []
    for index in range(1, len(tagged) - 1):
        tagged_now, seconds = tagged[index]
        before, after = tagged[index - 1], tagged[index + 1]
        if tagged_now and not before[0] and not after[0]:
            ratios.append(seconds / ((before[1] + after[1]) / 2))
    return ratios


def summarize(ratios: List[float]) -> str:
    quartiles = statistics.quantiles(ratios, n=4)
    return (f"{(statistics.median(ratios) - 1) * 100:+.1f}% "
            f"(IQR {(quartiles[0] - 1) * 100:+.1f}% .. {(quartiles[2] - 1) * 100:+.1f}%, n={len(ratios)})")


def stats_alone(num_elements: int, num_runs: int, repeats: int = 20) -> Dict[str, float]:
    """Seconds of the per-bucket statistics on one flat partition, against one read of it."""
    from deepspeed_patch.statistics import accumulate_runs, empty_stats

    flat = torch.randn(num_elements)
    bounds = [round(index * num_elements / num_runs) for index in range(num_runs + 1)]
    runs = [flat[start:end] for start, end in zip(bounds, bounds[1:])]
    buckets = torch.arange(num_runs)
    # DeepSpeed's own norm reads the same partition as one view per parameter (here 16 per bucket)
    param_bounds = [round(index * num_elements / (16 * num_runs)) for index in range(16 * num_runs + 1)]
    per_param = [flat[start:end] for start, end in zip(param_bounds, param_bounds[1:])]

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    param_buckets = torch.arange(len(per_param))
    return {
        "one_read": best(lambda: torch.linalg.vector_norm(flat).item()),
        "deepspeed_norm": best(lambda: torch.stack(torch._foreach_norm(per_param, 2.0)).sum().item()),
        "layer_stats": best(lambda: accumulate_runs(empty_stats(num_runs, "cpu"), runs, buckets)),
        "param_stats": best(lambda: accumulate_runs(empty_stats(len(per_param), "cpu"), per_param, param_buckets)),
    }


def step_time_table(quick: bool) -> List[str]:
    steps = 10 if quick else 40
    specs = [Spec(12, 256, stage, steps) for stage in (1, 2)]
    if not quick:
        specs += [Spec(24, 512, stage, steps // 2) for stage in (1, 2)]
    lines = [
        "# Cost of per-layer gradient statistics: step time", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, CPU (gloo), 2 ranks. "
        "Each figure is the median (and interquartile range) of per-iteration ratios within one run.", "",
        "| model | ZeRO | params | step time | per-layer stats (all layers, pre+post clip) "
        "| safe_get_full_grad loop |", "| --- | --- | --- | --- | --- | --- |"
    ]
    for spec in specs:
        timings = launch(bench_rank, 2, spec)[0]
        baseline = statistics.median(seconds for measured, seconds in timings["layer_stats"] if not measured)
        params = sum(p.numel() for p in TinyGPT(model_config(spec)).parameters())
        row = (f"| {spec.num_layers} layers, hidden {spec.hidden} | {spec.zero_stage} | {params / 1e6:.1f}M "
               f"| {baseline * 1000:.0f} ms | {summarize(paired_ratios(timings['layer_stats']))} "
               f"| {summarize(paired_ratios(timings['full_grad_loop']))} |")
        print(row, flush=True)
        lines.append(row)
    return lines


def statistics_table(quick: bool) -> List[str]:
    lines = ["# Cost of per-layer gradient statistics: the computation alone", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}. One flat fp32 "
             "partition in 14 buckets (224 parameters), median of 20 runs: one read of it "
             "(`torch.linalg.vector_norm`), DeepSpeed's per-parameter norm, the per-layer statistics, and the "
             "statistics at `granularity: param` (224 buckets).", "",
             "| elements | one read | DeepSpeed-style norm | per-layer stats | stats / one read "
             "| per-param stats | per-param / one read |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for num_elements in (1_000_000, 5_000_000) if quick else (1_000_000, 5_000_000, 25_000_000):
        timing = stats_alone(num_elements, 14)
        row = (f"| {num_elements / 1e6:.0f}M | {timing['one_read'] * 1e3:.2f} ms "
               f"| {timing['deepspeed_norm'] * 1e3:.2f} ms | {timing['layer_stats'] * 1e3:.2f} ms "
               f"| {timing['layer_stats'] / timing['one_read']:.1f}x | {timing['param_stats'] * 1e3:.2f} ms "
               f"| {timing['param_stats'] / timing['one_read']:.1f}x |")
        print(row, flush=True)
        lines.append(row)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, small model only")
    parser.add_argument("--only", choices=("steps", "stats"), help="run one of the two tables")
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    tables = {"steps": ("overhead.md", step_time_table), "stats": ("statistics_alone.md", statistics_table)}
    for name, (filename, table) in tables.items():
        if args.only in (None, name):
            with open(os.path.join(RESULTS, filename), "w") as out:
                out.write("\n".join(table(args.quick)) + "\n")


if __name__ == "__main__":
    main()
