"""The fused statistics kernels against today's stock operators and a plain float64 reference.

Each kernel (the host's C++, and Triton: on CUDA where there is one, else in Triton's interpreter on
the host) folds partitions into a ``(buckets, 9)`` table; ``partition_stats.accumulate_spans`` (the stock
operators) and ``reference_table`` (float64 PyTorch, one span at a time) fold the same spans. Min, max,
abs-min and the counts must match both exactly (NaN where NaN); the sums must match the reference to
float64 rounding and the stock operators to their own (fp32) rounding.
"""

import functools
import importlib
import logging
import math
import os
import subprocess
import sys
import textwrap
from typing import List, Optional, Sequence, Tuple

import pytest
import torch

from deepspeed_patch.statistics import kernels, partition_stats
from deepspeed_patch.statistics.kernels import HOST, STOCK, TRITON, chunk_partition
from deepspeed_patch.statistics.partition_slices import PartitionSlices, partition_spans, slices_of_spans
from deepspeed_patch.statistics.partition_stats import accumulate_partition, accumulate_spans
from deepspeed_patch.statistics.statistics import (
    L1,
    MAX,
    NEG_ABS_MIN,
    NEG_MIN,
    NONFINITE,
    NUM_SUMMED,
    NUMEL,
    SUM,
    SUMSQ,
    ZEROS,
    empty_stats,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALL_EXTRA = ("l1", "mean", "zeros")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    # Triton's interpreter runs the kernel on host tensors. It must be chosen before the kernel module is
    # imported, and triton reads it again later, so it stays set for this process.
    os.environ.setdefault("TRITON_INTERPRET", "1")
TRITON_DEVICE = "cuda" if ON_CUDA else "cpu"
# The interpreter takes about 0.1 s a program (a chunk): its cases keep to a few dozen chunks.
INTERPRETED = not ON_CUDA


def triton_unavailable() -> Optional[str]:
    """Why the Triton kernel cannot run in this process, or None."""
    try:
        importlib.import_module("deepspeed_patch.statistics.partition_stats_triton")
    except ImportError as error:
        return f"triton is not installed ({error}); pip install -e '.[test]' installs it on Linux"
    return None


KERNELS = [
    pytest.param(HOST, "cpu", id="host"),
    pytest.param(TRITON, TRITON_DEVICE, id="triton-cuda" if ON_CUDA else "triton-interpreted"),
]

# --- the independent reference -----------------------------------------------------------------------


def reference_table(flat: torch.Tensor, spans: Sequence[Tuple[int, int, int]], stats: torch.Tensor,
                    extra: Sequence[str]) -> torch.Tensor:
    """``stats`` with ``spans`` (start, length, bucket) of ``flat`` folded in: float64 PyTorch, span by span."""
    table = stats.double().cpu().clone()
    for start, length, bucket in spans:
        if length == 0:
            continue
        values = flat[start:start + length].double().cpu()
        row = table[bucket]
        row[SUMSQ] += (values * values).sum()
        row[NONFINITE] += (~torch.isfinite(values)).sum()
        row[NUMEL] += length
        if "l1" in extra:
            row[L1] += values.abs().sum()
        if "mean" in extra:
            row[SUM] += values.sum()
        if "zeros" in extra:
            row[ZEROS] += (values == 0).sum()
        has_nan = bool(torch.isnan(values).any())
        for column, value in ((MAX, values.max()), (NEG_MIN, -values.min()), (NEG_ABS_MIN, -values.abs().min())):
            if has_nan or math.isnan(row[column]):
                row[column] = math.nan
            else:
                row[column] = max(row[column], value)
    return table


# --- helpers ----------------------------------------------------------------------------------------


def slices_on(spans: Sequence[Tuple[int, int, int]], device) -> PartitionSlices:
    return slices_of_spans(list(spans), device)


def fused(kernel: str, device, flat: torch.Tensor, spans, stats: torch.Tensor, extra=(), chunk=None) -> torch.Tensor:
    """``stats`` (a copy) with the spans of ``flat`` folded in by ``kernel``."""
    slices = slices_on(spans, device)
    chunking = chunk_partition(slices, device, kernel=kernel, **({} if chunk is None else {"chunk": chunk}))
    out = stats.clone().to(device)
    accumulate_partition(out, flat.to(device), chunking, extra)
    return out.cpu()


def stock(flat: torch.Tensor, spans, stats: torch.Tensor, extra=()) -> torch.Tensor:
    """``stats`` (a copy) with the non-empty spans folded in by ``accumulate_spans`` (it refuses empty spans)."""
    spans = [span for span in spans if span[1] > 0]
    out = stats.clone()
    accumulate_spans(out, [flat.narrow(0, start, length) for start, length, _ in spans],
                    torch.tensor([bucket for _, _, bucket in spans], dtype=torch.int64), extra)
    return out


def assert_same_maxima_and_counts(got: torch.Tensor, want: torch.Tensor) -> None:
    """Min, max, abs-min bit for bit (NaN where NaN; +0 and -0 compare equal) and the counts exactly."""
    torch.testing.assert_close(got[:, NUM_SUMMED:], want[:, NUM_SUMMED:], rtol=0, atol=0, equal_nan=True)
    for column in (NONFINITE, ZEROS, NUMEL):
        assert torch.equal(got[:, column], want[:, column]), f"column {column}"


def assert_sums_close(got: torch.Tensor,
                      want: torch.Tensor,
                      rtol: float,
                      magnitude: torch.Tensor,
                      l1_rtol: Optional[float] = None) -> None:
    """The summed columns within ``rtol``: the squared norm and L1 (within ``l1_rtol`` if given) relative to
    themselves, the sum relative to ``magnitude`` (per row, the sum of the |x| it adds up); inf and NaN
    where ``want`` has them."""
    for column, tolerance in ((SUMSQ, rtol), (L1, l1_rtol or rtol)):
        torch.testing.assert_close(got[:, column], want[:, column], rtol=tolerance, atol=0, equal_nan=True,
                                   msg=lambda text, column=column: f"column {column}: {text}")
    finite = torch.isfinite(want[:, SUM])
    torch.testing.assert_close(got[~finite, SUM], want[~finite, SUM], rtol=0, atol=0, equal_nan=True)
    error = (got[finite, SUM] - want[finite, SUM]).abs()
    assert bool((error <= rtol * magnitude[finite]).all()), f"column SUM: {got[:, SUM]} != {want[:, SUM]}"


def check(kernel: str, device, flat: torch.Tensor, spans, stats: Optional[torch.Tensor] = None,
          extra=ALL_EXTRA, chunk=None, with_stock: bool = True) -> torch.Tensor:
    """The fused table against the reference (and the stock operators); returns the fused table."""
    if kernel == TRITON and triton_unavailable():
        pytest.fail(triton_unavailable())
    num_buckets = max(bucket for _, _, bucket in spans) + 1
    stats = empty_stats(num_buckets, "cpu") if stats is None else stats
    got = fused(kernel, device, flat, spans, stats, extra, chunk)
    want = reference_table(flat, spans, stats, extra)
    assert_same_maxima_and_counts(got, want)
    magnitude = reference_table(flat, spans, empty_stats(len(stats), "cpu"), ("l1", ))[:, L1] + stats[:, SUM].abs()
    assert_sums_close(got, want, 1e-12, magnitude)
    if with_stock:
        old = stock(flat, spans, stats, extra)
        assert_same_maxima_and_counts(got, old)
        # The stock operators take the squared norm in fp32 and L1 in the gradient's dtype (rounded to it).
        assert_sums_close(got, old, 1e-5, magnitude, l1_rtol=max(1e-5, torch.finfo(flat.dtype).eps))
    return got


def random_spans(numel: int, num_spans: int, num_buckets: int, seed: int) -> List[Tuple[int, int, int]]:
    """Back-to-back spans of random lengths covering ``numel`` elements, in random buckets (which repeat)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, numel + 1, (num_spans - 1, ), generator=generator).tolist())
    bounds = [0] + cuts + [numel]
    buckets = torch.randint(0, num_buckets, (num_spans, ), generator=generator).tolist()
    buckets[0] = num_buckets - 1  # the last row is used
    return [(start, end - start, bucket) for start, end, bucket in zip(bounds, bounds[1:], buckets)]


def gradient(numel: int, dtype: torch.dtype, seed: int, scale: float = 1e-3) -> torch.Tensor:
    """Gradient-like values: normal, a few exact zeros, a few subnormals of ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator) * scale
    values[::97] = 0.0
    values[5::211] = torch.finfo(dtype).smallest_normal / 4
    values[7::389] = -torch.finfo(dtype).smallest_normal / 8
    return values.to(dtype)


# --- the cases --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel,device", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).split(".")[-1])
@pytest.mark.parametrize("extra", [(), ALL_EXTRA, ("zeros", )], ids=["plain", "extra", "zeros"])
def test_dtypes_and_extra_statistics(kernel, device, dtype, extra):
    """Spans of random lengths in repeated buckets, several chunks per span (short chunks: every vector
    loop's tail is exercised), folded into a table that already holds another partition's statistics."""
    numel = 20_000 if INTERPRETED and kernel == TRITON else 200_000
    flat = gradient(numel, dtype, seed=1)
    spans = random_spans(numel, 9, 5, seed=2)
    before = stock(gradient(3000, torch.float32, seed=3), random_spans(3000, 4, 5, seed=4), empty_stats(5, "cpu"),
                   ALL_EXTRA)
    check(kernel, device, flat, spans, stats=before, extra=extra, chunk=1000 + 17)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN in the interpreter's numpy
@pytest.mark.parametrize("kernel,device", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).split(".")[-1])
def test_non_finite_values(kernel, device, dtype):
    """nan, +inf and -inf in some spans and chunks: NaN min/max/abs-min where a span holds a NaN, infinite
    ones where it holds only infinities, counts exact; a NaN already in the table stays."""
    flat = gradient(12_000, dtype, seed=5)
    flat[10] = math.nan  # span 0 (bucket 0): a NaN
    flat[2500] = math.inf  # span 1 (bucket 1): +inf and -inf, no NaN
    flat[2999] = -math.inf
    flat[4095:4097] = math.nan  # span 2 (bucket 2): NaN across a chunk boundary, and inf
    flat[5000] = math.inf
    flat[7000:8000] = -math.inf  # span 3 (bucket 3): a whole chunk of -inf
    spans = [(0, 2000, 0), (2000, 2000, 1), (4000, 2000, 2), (6000, 3000, 3), (9000, 3000, 4)]
    before = empty_stats(6, "cpu")
    before[4, MAX] = math.nan  # an earlier partition had a NaN in bucket 4: it stays NaN
    before[5, SUMSQ], before[5, NEG_ABS_MIN] = 3.0, math.nan
    got = check(kernel, device, flat, spans, stats=before, chunk=1024)
    assert got[:, NONFINITE].tolist() == [1, 2, 3, 1000, 0, 0]
    assert math.isnan(got[2, MAX]) and got[1, MAX] == math.inf and got[3, NEG_MIN] == math.inf
    assert math.isnan(got[4, MAX]) and not math.isnan(got[4, NEG_ABS_MIN])


@pytest.mark.parametrize("kernel,device", KERNELS)
def test_spans_cut_at_partition_boundaries(kernel, device):
    """The partitions of three ranks (uneven), each a view into the flat group buffer, with parameters cut
    by the partition boundaries and a parameter of no bucket (another rank's) left out."""
    numel = 9_000 if INTERPRETED and kernel == TRITON else 90_000
    group = gradient(numel, torch.float32, seed=6)
    sizes = [numel // 7, numel // 3, numel // 5, numel // 11]
    sizes.append(numel - sum(sizes))
    offsets = [sum(sizes[:index]) for index in range(len(sizes))]
    ranges = [(offset, size, bucket) for offset, size, bucket in zip(offsets, sizes, [0, 1, None, 1, 2])]
    partition = -(-numel // 3)
    for rank in range(3):
        start = rank * partition
        size = min(partition, numel - start)
        spans = partition_spans(ranges, start, size)
        flat = group.narrow(0, start, size)
        check(kernel, device, flat, spans, stats=empty_stats(3, "cpu"), chunk=4096)


@pytest.mark.parametrize("kernel,device", KERNELS)
def test_empty_spans_and_partitions(kernel, device):
    """Empty spans add nothing (the stock operators refuse them); an empty partition changes nothing."""
    flat = gradient(5000, torch.float32, seed=7)
    spans = [(0, 0, 0), (0, 2000, 1), (2000, 0, 2), (2000, 3000, 1), (5000, 0, 0)]
    got = check(kernel, device, flat, spans, stats=empty_stats(3, "cpu"))
    assert torch.equal(got[[0, 2]], empty_stats(2, "cpu"))
    if kernel == TRITON and triton_unavailable():
        pytest.fail(triton_unavailable())
    chunking = chunk_partition(slices_on([], device), device, kernel=kernel)
    stats = empty_stats(2, device)
    accumulate_partition(stats, torch.empty(0, device=device), chunking, ALL_EXTRA)
    assert torch.equal(stats.cpu(), empty_stats(2, "cpu"))


@pytest.mark.parametrize("kernel,device", KERNELS)
@pytest.mark.parametrize("num_buckets", [1, 12, 10_000])
def test_bucket_counts(kernel, device, num_buckets):
    """1 to 10,000 buckets (``granularity: param``), spans in shuffled bucket order. Triton's interpreter
    runs a program per chunk at about 0.1 s each: there the 10,000-row table gets 40 spans spread over it
    (10,000 spans are checked on CUDA by benchmarks/gpu_check.sh)."""
    num_spans = num_buckets
    if kernel == TRITON and INTERPRETED:
        num_spans = min(num_buckets, 40)
    numel = max(60 * num_spans, 30_000)
    flat = gradient(numel, torch.float32, seed=8)
    generator = torch.Generator().manual_seed(9)
    rows = torch.randperm(num_buckets, generator=generator)[:num_spans].tolist()
    spans = [(start, length, rows[index % num_spans])
            for index, (start, length, _) in enumerate(random_spans(numel, num_spans, 1, seed=10))]
    check(kernel, device, flat, spans, stats=empty_stats(num_buckets, "cpu"), extra=("l1", ))


@pytest.mark.parametrize("kernel,device", KERNELS)
def test_ten_elements(kernel, device):
    flat = torch.tensor([0.5, -2.0, 0.0, -0.0, 3.0, -1e-3, 7.0, -7.0, 1e-8, 2.0])
    check(kernel, device, flat, [(0, 4, 0), (4, 6, 1)], extra=ALL_EXTRA)


NO_CUDA = pytest.mark.skipif(not ON_CUDA, reason="no CUDA device (benchmarks/gpu_check.sh runs it on a GPU)")


@pytest.mark.parametrize("kernel,device", [
    pytest.param(HOST, "cpu", id="host", marks=pytest.mark.extended),  # a minute or two: CI's extended pass
    # 50M elements take minutes in Triton's interpreter: on the host only the C++ kernel takes them
    pytest.param(TRITON, "cuda", id="triton-cuda", marks=NO_CUDA),
])
def test_fifty_million_elements(kernel, device):
    """One partition of 50M fp32 elements in 12 buckets, every statistic."""
    flat = torch.randn(50_000_000, generator=torch.Generator().manual_seed(11)) * 1e-2
    spans = random_spans(flat.numel(), 12, 12, seed=12)
    check(kernel, device, flat, spans, extra=ALL_EXTRA)


def test_host_result_does_not_depend_on_threads():
    """Threads take ranges of chunks, and rows fold in chunk order: the same bits with 1 or 2 threads."""
    flat = gradient(600_000, torch.float32, seed=13)  # enough work for two threads
    spans = random_spans(flat.numel(), 30, 7, seed=14)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused(HOST, "cpu", flat, spans, empty_stats(7, "cpu"), ALL_EXTRA)
        torch.set_num_threads(2)
        two = fused(HOST, "cpu", flat, spans, empty_stats(7, "cpu"), ALL_EXTRA)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_stock_path_and_kernel_choice(monkeypatch):
    """The stock path (``accumulate_spans``' operators) against the float64 reference: min, max, abs-min and the
    counts exactly, the sums to the stock operators' fp32 rounding. A host partition gets the host kernel; a dtype
    the kernels do not take goes to the stock operators (seen calling them), with the reference's result."""
    flat = gradient(10_000, torch.float32, seed=15)
    spans = random_spans(flat.numel(), 6, 3, seed=16)
    stats = empty_stats(3, "cpu")
    calls = []
    monkeypatch.setattr(partition_stats, "accumulate_spans", lambda *args: calls.append(accumulate_spans(*args)))
    assert chunk_partition(slices_on(spans, "cpu"), "cpu").kernel == HOST
    checked = 0
    for kernel, values in ((STOCK, flat), (HOST, flat.double())):
        got = fused(kernel, "cpu", values, spans, stats, ALL_EXTRA)
        want = reference_table(values, spans, stats, ALL_EXTRA)
        assert_same_maxima_and_counts(got, want)
        magnitude = reference_table(values, spans, empty_stats(3, "cpu"), ("l1", ))[:, L1]
        assert_sums_close(got, want, 1e-5, magnitude, l1_rtol=torch.finfo(torch.float32).eps)
        checked += 1
    assert checked == 2 and len(calls) == 2  # both went to the stock operators


@NO_CUDA
def test_cuda_partition_gets_the_triton_kernel():
    spans = random_spans(10_000, 6, 3, seed=16)
    assert chunk_partition(slices_on(spans, "cuda"), "cuda").kernel == TRITON


def test_mismatched_partition_or_table_is_refused():
    chunking = chunk_partition(slices_on([(0, 100, 2)], "cpu"), "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        accumulate_partition(empty_stats(3, "cpu"), torch.zeros(99), chunking)
    with pytest.raises(ValueError, match="do not fit"):
        accumulate_partition(empty_stats(2, "cpu"), torch.zeros(100), chunking)
    with pytest.raises(ValueError, match="one device"):
        accumulate_partition(empty_stats(3, "meta"), torch.zeros(100), chunking)
    kernel = importlib.import_module("deepspeed_patch.statistics.partition_stats_cpu").host_kernel()
    with pytest.raises(RuntimeError, match="outside the partition"):
        kernel(empty_stats(3, "cpu"), torch.zeros(100), torch.tensor([[50, 51, 0]]), 0)


def test_missing_compiler_falls_back_with_one_warning(tmp_path):
    """Without a compiler the host kernel is not built: one warning, then the stock operators' results."""
    script = textwrap.dedent("""
        import torch
        from deepspeed_patch.statistics.kernels import STOCK, chunk_partition
        from deepspeed_patch.statistics.partition_stats import accumulate_partition
        from deepspeed_patch.statistics.partition_slices import slices_of_spans
        from deepspeed_patch.statistics.partition_stats import accumulate_spans
        from deepspeed_patch.statistics.statistics import empty_stats
        flat = torch.randn(1000)
        slices = slices_of_spans([(0, 600, 0), (600, 400, 1)])
        chunkings = [chunk_partition(slices, "cpu") for _ in range(2)]
        assert all(chunking.kernel == STOCK for chunking in chunkings), [chunking.kernel for chunking in chunkings]
        got, want = empty_stats(2, "cpu"), empty_stats(2, "cpu")
        accumulate_partition(got, flat, chunkings[0], ("l1",))
        accumulate_spans(want, slices.views(flat), slices.buckets, ("l1",))
        assert torch.equal(got, want)
        print("fell back")
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "fell back" in output, output
    assert output.count("could not be built") == 1, output


def test_a_stale_build_lock_falls_back_instead_of_waiting(tmp_path):
    """A build killed half-way leaves its lock file; torch would wait for it forever. Start-up goes on,
    on the stock operators, with a warning naming the file."""
    script = textwrap.dedent("""
        import os, time
        from torch.utils import cpp_extension
        from deepspeed_patch.statistics import partition_stats_cpu
        lock = os.path.join(cpp_extension._get_build_directory(partition_stats_cpu.extension_name(), False), "lock")
        open(lock, "w").close()
        os.utime(lock, (time.time() - 3600, time.time() - 3600))
        start = time.monotonic()
        assert partition_stats_cpu.host_kernel() is None
        print(f"fell back after {time.monotonic() - start:.1f} s")
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "fell back after 0." in output, output
    assert "build directory is locked" in output and "lock" in output, output


@pytest.fixture
def warnings_logged(caplog, monkeypatch):
    """The warnings of DeepSpeed's logger (which does not propagate to pytest's handler by itself)."""
    from deepspeed.utils import logger

    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING):
        yield lambda: [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_host_kernel_builds_once_per_process(warnings_logged):
    """The build is cached: a second request returns the same op without logging anything."""
    module = importlib.import_module("deepspeed_patch.statistics.partition_stats_cpu")
    first = module.host_kernel()
    assert module.host_kernel() is first is not None
    assert not warnings_logged()


def test_triton_probe(monkeypatch, warnings_logged):
    """chunk_partition tries the Triton kernel once on a device before choosing it; where it cannot run, the
    stock operators are chosen with one warning."""
    if triton_unavailable():
        pytest.fail(triton_unavailable())
    probe = kernels._triton_runs
    monkeypatch.setattr(kernels, "_triton_runs", functools.lru_cache(maxsize=None)(probe.__wrapped__))
    assert kernels._triton_runs(torch.device(TRITON_DEVICE))
    monkeypatch.setitem(sys.modules, "deepspeed_patch.statistics.partition_stats_triton", None)  # import fails
    kernels._triton_runs.cache_clear()
    assert not kernels._triton_runs(torch.device(TRITON_DEVICE))
    assert not kernels._triton_runs(torch.device(TRITON_DEVICE))
    assert len([message for message in warnings_logged() if "unavailable" in message]) == 1


def test_the_host_kernel_s_build_is_announced_at_warning_and_only_when_not_cached(tmp_path, warnings_logged):
    """DeepSpeed's logger shows WARNING and above by default: an INFO line before a build would be unseen."""
    module = importlib.import_module("deepspeed_patch.statistics.partition_stats_cpu")
    module._announce_build(str(tmp_path))
    (announced, ) = warnings_logged()
    assert "building the fused statistics kernel for the host" in announced
    (tmp_path / f"{module.extension_name()}.so").write_bytes(b"")  # newer than the source: cached
    module._announce_build(str(tmp_path))
    assert len(warnings_logged()) == 1
