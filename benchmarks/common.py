"""What the benchmark modules share: the machine, interleaved timing, ratios, collective counts, result files."""

import collections
import json
import os
import platform
import random
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# The collective entry points of deepspeed.comm's backend object (TorchBackend, or CCL's).
COLLECTIVES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "all_gather", "all_gather_into_tensor",
               "all_gather_base", "all_gather_coalesced", "all_gather_object", "all_to_all_single", "all_to_all",
               "send", "recv", "isend", "irecv", "gather", "scatter", "barrier", "monitored_barrier")


def machine() -> str:
    """One line naming the CPU, its cores and the software versions."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            model = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return (f"{model} ({platform.machine()}), {os.cpu_count()} cores, shared with other jobs; "
            f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__} ({accelerator.device_name()} "
            f"accelerator, {accelerator.communication_backend_name()})")


def paired_ratios(tagged: Sequence[Tuple[bool, float]]) -> List[float]:
    """Each tagged iteration's time over the mean of its untagged neighbours."""
    ratios = []
    for index in range(1, len(tagged) - 1):
        tagged_now, seconds = tagged[index]
        before, after = tagged[index - 1], tagged[index + 1]
        if tagged_now and not before[0] and not after[0]:
            ratios.append(seconds / ((before[1] + after[1]) / 2))
    return ratios


def spread(values: Sequence[float]) -> Dict[str, float]:
    """Median, quartiles and count; quartiles fall back to the median below 2 values."""
    values = list(values)
    if not values:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "n": 0}
    median = statistics.median(values)
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (median, median, median)
    return {"median": median, "q1": q1, "q3": q3, "n": len(values)}


def percent(ratios: Dict[str, float]) -> str:
    """A ratio spread as an overhead in percent: ``+1.2% (IQR -3.0% .. +4.1%, n=12)``."""
    if not ratios["n"]:
        return "n/a"
    return (f"{(ratios['median'] - 1) * 100:+.1f}% (IQR {(ratios['q1'] - 1) * 100:+.1f}% .. "
            f"{(ratios['q3'] - 1) * 100:+.1f}%, n={ratios['n']})")


def times(ratios: Dict[str, float]) -> str:
    """A ratio spread as a factor: ``2.6x (2.5-2.8)``."""
    return f"{ratios['median']:.2f}x ({ratios['q1']:.2f}-{ratios['q3']:.2f})"


def interleaved(fns: Dict[str, Callable[[], object]], rounds: int, baseline: str,
                warmup: int = 2) -> Dict[str, Dict[str, float]]:
    """Run every function once per round, in a shuffled order; per function, the median seconds and the
    spread of its per-round ratio to ``baseline`` (a slow moment of the shared machine hits both sides,
    and no function always runs after the same one, whose traces in the caches it would inherit)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    seconds: Dict[str, List[float]] = {name: [] for name in fns}
    order = list(fns)
    shuffler = random.Random(0)
    for _ in range(rounds):
        shuffler.shuffle(order)
        for name in order:
            start = time.perf_counter()
            fns[name]()
            seconds[name].append(time.perf_counter() - start)
    base = seconds[baseline]
    return {
        name: dict(seconds=statistics.median(values), **{
            f"ratio_{key}": value
            for key, value in spread([a / b for a, b in zip(values, base)]).items()
        })
        for name, values in seconds.items()
    }


def ratio_of(result: Dict[str, float]) -> Dict[str, float]:
    """The ratio spread stored by ``interleaved`` under plain keys."""
    return {key[len("ratio_"):]: value for key, value in result.items() if key.startswith("ratio_")}


def write_results(name: str, lines: List[str], data: Optional[dict] = None, folder: str = RESULTS) -> None:
    """``<folder>/<name>.md`` and, for the plot, ``<folder>/<name>.json`` (``folder``: ``results/``). The tables
    are kept in git, the JSON (raw output) is not (.gitignore): a run writes it again."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.md"), "w", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
    if data is not None:
        with open(os.path.join(folder, f"{name}.json"), "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1, default=str)


def read_results(name: str) -> Optional[dict]:
    path = os.path.join(RESULTS, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def mib(num_bytes: float) -> str:
    if abs(num_bytes) >= 1 << 20:
        return f"{num_bytes / (1 << 20):.1f} MiB"
    if abs(num_bytes) >= 1 << 10:
        return f"{num_bytes / (1 << 10):.1f} KiB"
    return f"{num_bytes:.0f} B"


class CollectiveCounter:
    """Counts the calls into ``deepspeed.comm``'s backend; a call made from inside another counts once."""

    def __init__(self) -> None:
        from deepspeed.comm import comm

        self.counts: collections.Counter = collections.Counter()
        self._depth = 0
        for name in COLLECTIVES:
            original = getattr(comm.cdb, name, None)
            if original is not None:
                setattr(comm.cdb, name, self._counted(name, original))

    def _counted(self, name: str, original):

        def counted(*args, **kwargs):
            if self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def take(self) -> Dict[str, int]:
        counts = dict(self.counts)
        self.counts.clear()
        return counts
