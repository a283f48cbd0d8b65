"""The reduction across ranks (``reduction.reduce_stats``) in a simulated world, in one process.

Each simulated rank is a thread holding one contiguous piece of every bucket's gradient (some pieces
empty), as ZeRO partitions it; a stand-in for ``deepspeed.comm`` reduces what the threads hand to its
collectives in rank order, in float64, and counts the calls (the bytes are counted in real launches,
``test_setup.py``). The reference is each bucket's whole gradient, in plain PyTorch (``reference.bucket_stats``).
"""

import threading
from typing import Dict, List

import pytest
import torch

from deepspeed_patch.statistics import reduction
from deepspeed_patch.statistics.partition_stats import accumulate_spans
from deepspeed_patch.statistics.statistics import NUMEL, bucket_results, empty_stats
from reference import TOLERANCE, bucket_stats

EXTRA = ("l1", "mean", "zeros", "numel")
REDUCE = {"sum": lambda tensors: torch.stack(tensors).sum(0), "max": lambda tensors: torch.stack(tensors).amax(0)}


class SimulatedComm:
    """The slice of ``deepspeed.comm`` that ``reduce_stats`` uses, for ``world_size`` threads."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.local = threading.local()
        self.inputs: List[torch.Tensor] = [None] * world_size
        self.result = None
        self.barrier = threading.Barrier(world_size)
        self.calls = [0] * world_size

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group=None) -> int:
        return self.world_size

    def all_reduce(self, tensor: torch.Tensor, op, group=None) -> None:
        rank = self.local.rank
        self.calls[rank] += 1
        self.inputs[rank] = tensor.clone()
        if self.barrier.wait() == 0:  # one thread combines, as a ring or a tree computes each sum once
            self.result = REDUCE[op](self.inputs)
        self.barrier.wait()
        tensor.copy_(self.result)
        self.barrier.wait()  # nobody starts the next collective before every rank has its copy

    def run(self, tables: List[torch.Tensor]) -> List[torch.Tensor]:
        """``reduce_stats`` on every simulated rank at once; each rank's result."""
        results = [None] * self.world_size
        errors = []

        def rank_main(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = reduction.reduce_stats(tables[rank], process_group=None)
            except BaseException as error:  # reported below, not lost in the thread
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(rank, )) for rank in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def simulated_world(world_size: int, num_buckets: int, seed: int):
    """Every bucket's full gradient, and each rank's table with one status row (a failure flag)."""
    generator = torch.Generator().manual_seed(seed)
    gradients: Dict[int, torch.Tensor] = {}
    for bucket in range(num_buckets):
        numel = int(torch.randint(world_size // 2, 3 * world_size, (1, ), generator=generator))
        scale = 10.0**float(torch.randint(-8, 4, (1, ), generator=generator))
        grad = torch.randn(numel, generator=generator, dtype=torch.float64).float() * scale
        grad[torch.rand(numel, generator=generator) < 0.05] = 0.0
        gradients[bucket] = grad
    tables = [empty_stats(num_buckets + 1, "cpu") for _ in range(world_size)]
    for bucket, grad in gradients.items():
        cuts = torch.sort(torch.randint(0, grad.numel() + 1, (world_size - 1, ), generator=generator)).values.tolist()
        for rank, piece in enumerate(torch.tensor_split(grad, cuts)):
            if piece.numel():  # an empty piece leaves the rank's row at the identity
                accumulate_spans(tables[rank], [piece], torch.tensor([bucket]), EXTRA)
    return gradients, tables


def reduced(tables: List[torch.Tensor]):
    """Each rank's result of ``reduce_stats``, and the stand-in communication with its counts."""
    comm = SimulatedComm(len(tables))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reduction, "dist", comm)
        return comm.run(tables), comm


def test_a_1024_rank_world_reduces_to_the_statistics_of_the_whole_gradient():
    gradients, tables = simulated_world(1024, 8, seed=0)
    results, comm = reduced(tables)
    reference = bucket_stats({f"bucket{key}": grad for key, grad in gradients.items()}, key_of=lambda name: name)
    keys = [f"bucket{key}" for key in gradients]
    measured = bucket_results(results[0][:-1], keys, keys, 1.0, EXTRA)
    checked = 0
    for key in keys:
        for stat, expected in reference[key].items():
            # The squared norm of each piece is accumulated in float32 (statistics._piece_statistics).
            tolerance = TOLERANCE["fp32"] if stat == "norm" else 1e-12
            assert measured[key][stat] == pytest.approx(expected, rel=tolerance, abs=0.0), (key, stat)
            checked += 1
    assert checked == 8 * 10
    assert results[0][-1, NUMEL] == 0  # no rank flagged a failure
    # Every rank's result is this stand-in's one copy, so equal bits prove nothing here: a real gloo run checks
    # them (test_zero_stats.py::test_identical_on_every_rank, at 2 and 3 ranks).
    assert len(results) == 1024
    assert comm.calls == [reduction.COLLECTIVES_PER_STEP] * 1024


def test_a_failure_on_one_rank_reaches_every_rank():
    _, tables = simulated_world(64, 4, seed=1)
    tables[37][-1, NUMEL] = 1.0  # what Measurement.finish sets on a rank that could not measure
    results, _ = reduced(tables)
    assert [float(result[-1, NUMEL]) for result in results] == [1.0] * 64
