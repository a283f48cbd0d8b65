"""Scaling: cost of the statistics against the number of layers and the parameters per rank, and the
collectives of a measured step against the number of layers.

- Statistics alone (one thread) on rank 0's partition of a TinyGPT laid out as ZeRO-1/2 lays it out
  (``layout.py``: the package's own layer map and partition runs), 4 to 96 layers at hidden 128, and
  12 layers at hidden 64 to 768.
- Collectives: real 2-rank DeepSpeed engines (hidden 32, so that 96 layers stay small), every call into
  ``deepspeed.comm``'s backend counted during ``engine.backward`` and during ``engine.step()``, on
  measured and unmeasured steps (``interval: 2``). The same run records the peak memory of a measured
  and of an unmeasured ``engine.step()`` for ``memory.py``.
"""

import collections
from typing import Dict, List, Sequence, Tuple

import statistics_before
import torch
from common import CollectiveCounter, interleaved, machine, ratio_of, times
from layout import gpt_config, tiny_gpt_partition

from deepspeed_patch.statistics.partition_stats import accumulate_spans
from deepspeed_patch.statistics.statistics import empty_stats

LAYER_COUNTS = (4, 8, 16, 32, 64, 96)
SCALING_HIDDEN = 128
PARAMS_LAYERS = 12
PARAMS_HIDDEN = (64, 128, 256, 512, 768)
COLLECTIVES_HIDDEN = 32
def time_partition(num_layers: int, hidden: int, rounds: int) -> dict:
    part = tiny_gpt_partition(num_layers, hidden)
    runs, buckets = part.runs, part.slices.buckets
    fns = {
        "one_read": lambda: torch.linalg.vector_norm(part.flat).item(),
        "deepspeed_norm": lambda: torch.stack(torch._foreach_norm(part.param_views, 2.0)).sum().item(),
        "layer_stats": lambda: accumulate_spans(empty_stats(part.num_buckets, "cpu"), runs, buckets),
        "layer_stats_before": lambda: statistics_before.accumulate_spans(empty_stats(part.num_buckets, "cpu"), runs,
                                                                        buckets),
    }
    timing = interleaved(fns, rounds, "one_read")
    return {"layers": num_layers, "hidden": hidden, "buckets": part.num_buckets, "runs": len(runs),
            "params": part.num_params, "partition": part.flat.numel(), "timing": timing}


def stats_rows(points: Sequence[dict]) -> List[str]:
    rows = []
    for point in points:
        timing = point["timing"]
        extra_us = (timing["layer_stats"]["seconds"] - timing["one_read"]["seconds"]) / point["buckets"] * 1e6
        rows.append(f"| {point['layers']} | {point['hidden']} | {point['buckets']} | {point['params'] / 1e6:.1f}M "
                    f"| {point['partition'] / 1e6:.2f}M | {timing['one_read']['seconds'] * 1e3:.2f} ms "
                    f"| {timing['layer_stats']['seconds'] * 1e3:.2f} ms "
                    f"| **{times(ratio_of(timing['layer_stats']))}** "
                    f"| {times(ratio_of(timing['layer_stats_before']))} "
                    f"| {timing['layer_stats']['seconds'] / timing['deepspeed_norm']['seconds']:.1f}x "
                    f"| {extra_us:.0f} us |")
    return rows


def collectives_rank(layer_counts: Sequence[int], stages: Sequence[int], steps: int) -> List[dict]:
    """For each ZeRO stage and layer count: collectives per backward and per step, measured or not, and
    the memory of one measured and one unmeasured step."""
    import deepspeed
    from memory import step_memory

    import deepspeed_patch
    from megatron_integration.tiny_gpt import TinyGPT, synthetic_batch

    deepspeed_patch.install()
    counter = None
    rows = []
    for stage in stages:
        for num_layers in layer_counts:
            torch.manual_seed(0)
            config = gpt_config(num_layers, COLLECTIVES_HIDDEN)
            model = TinyGPT(config)
            ds_config = {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_clipping": 1.0,
                "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
                "layer_grad_norms": {"enabled": True, "interval": 2},
            }
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                              config=ds_config)
            counter = counter or CollectiveCounter()
            records, memory, buckets = [], {}, None
            for step in range(steps):
                batch = synthetic_batch(config, 2, seed=step)
                counter.take()
                engine.backward(engine(batch))
                backward = counter.take()
                profiled = step >= steps - 2
                peak = step_memory(engine.step) if profiled else engine.step()
                in_step = counter.take()
                result = engine.get_layer_grad_norms()
                measured = result is not None and result["step"] == engine.global_steps
                if measured:
                    buckets = len(result["pre_clip"])
                if profiled:
                    memory["measured" if measured else "unmeasured"] = peak
                if step >= 2:  # after warm-up: optimizer states exist, the loss scale settled
                    records.append({"measured": measured, "backward": backward, "step": in_step})
            rows.append({"zero": stage, "layers": num_layers, "buckets": buckets,
                         "params": sum(p.numel() for p in model.parameters()), "records": records,
                         "memory": memory})
            engine.destroy()
    return rows


def collective_summary(row: dict) -> Dict[str, Tuple[float, float]]:
    """Per phase (backward, step): collectives per unmeasured and per measured step, and their names."""
    summary = {}
    for phase in ("backward", "step"):
        per_kind = {}
        for measured in (False, True):
            counts = [sum(record[phase].values()) for record in row["records"] if record["measured"] == measured]
            names = collections.Counter()
            for record in row["records"]:
                if record["measured"] == measured:
                    names.update(record[phase])
            per_kind[measured] = (sum(counts) / len(counts), {k: v / len(counts) for k, v in names.items()})
        summary[phase] = per_kind
    return summary


def run(quick: bool) -> Tuple[List[str], dict]:
    from megatron_integration.cpu_launch import launch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rounds = 5 if quick else 11
    layer_points = [time_partition(layers, SCALING_HIDDEN, rounds) for layers in LAYER_COUNTS]
    hiddens = PARAMS_HIDDEN[:3] if quick else PARAMS_HIDDEN
    param_points = [time_partition(PARAMS_LAYERS, hidden, rounds) for hidden in hiddens]
    torch.set_num_threads(threads)
    stages = (2, ) if quick else (1, 2)
    rank_rows = launch(collectives_rank, 2, LAYER_COUNTS, stages, 6, timeout=1200)[0]
    data = {"machine": machine(), "layers": layer_points, "params": param_points, "collectives": rank_rows}
    header = [
        "| layers | hidden | buckets | params (model) | partition (rank 0) | one read | per-layer stats "
        "| stats / one read | before / one read | stats / DeepSpeed norm | stats beyond one read, per bucket |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    ]
    lines = [
        "# Scaling of per-layer gradient statistics", "", f"Machine: {data['machine']}.", "",
        "## Statistics alone against the number of layers", "",
        "Rank 0's fp32 gradient partition of a TinyGPT on 2 ranks, laid out as ZeRO-1/2 does (parameters back to "
        "back, the package's own layer map and partition runs), random values; one thread; median over "
        f"{rounds} interleaved rounds (interquartile range of the ratio). Buckets are the layers plus the "
        "embeddings, final norm and head.", ""
    ] + header + stats_rows(layer_points) + [
        "", "## Statistics alone against the parameters per rank", "",
        f"{PARAMS_LAYERS} layers, hidden {hiddens[0]} to {hiddens[-1]}; as above.", ""
    ] + header + stats_rows(param_points) + [
        "", "## Collectives per step against the number of layers", "",
        f"2 ranks, TinyGPT hidden {COLLECTIVES_HIDDEN}, `interval: 2`; every call into `deepspeed.comm`'s backend "
        "object counted (a call made from inside another counts once), averaged over 2 measured and 2 unmeasured "
        "steps after warm-up.", "",
        "| ZeRO | layers | buckets | params | backward: collectives | step, unmeasured | step, measured "
        "| extra per measured step | extra ones |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    ]
    for row in rank_rows:
        summary = collective_summary(row)
        plain, plain_names = summary["step"][False]
        measured, measured_names = summary["step"][True]
        extra = {name: count - plain_names.get(name, 0) for name, count in measured_names.items()}
        extra_text = ", ".join(f"{count:g} {name}" for name, count in sorted(extra.items()) if count) or "none"
        row["extra_collectives"] = measured - plain
        lines.append(f"| {row['zero']} | {row['layers']} | {row['buckets']} | {row['params'] / 1e6:.2f}M "
                     f"| {summary['backward'][False][0]:g} | {plain:g} | {measured:g} | **{measured - plain:+g}** "
                     f"| {extra_text} |")
    print("\n".join(lines[-len(rank_rows):]), flush=True)
    return lines, data
