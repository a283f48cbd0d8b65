"""The per-step cost ledger's counts (benchmarks/ledger.py) as CI checks: collectives, host syncs and allocations
per step.

DESIGN.md section 4: a step that is neither measured nor recorded costs no collective and no host
synchronisation, a measured step one sync and two collectives. Counts, not times, from launches of two ranks (a
collective needs another rank to combine with; rank 0's counts): in the suite, ZeRO-2 off, at a quiet step and at a
measured step (that claim); in the extended tier, ZeRO-2 through every other mode, DeepSpeed without ZeRO (fp32)
through two, and the Megatron hook after an iteration with its loss on the device.
"""

import os
import sys
from functools import lru_cache

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import ledger  # noqa: E402

from megatron_integration.cpu_launch import launch  # noqa: E402

EXPECTED = {
    # (family, mode): (collectives, host syncs, allocations); None: not checked
    ("ZeRO-2", "off"): (0, 0, 0),
    ("ZeRO-2", "quiet"): (0, 0, 0),
    ("ZeRO-2", "trigger"): (0, 1, 0),  # the trigger reads the global norm
    # the ranks' largest loss: one all-reduce of one float64, then its read (a host loss, the norm not watched)
    ("ZeRO-2", "loss trigger"): (1, 1, None),
    # statistics off, a poll that finds nothing new: rank 0's "changed" flag all-reduced without waiting, and the
    # previous poll's flag read (complete by then; on an accelerator from a pinned copy, no sync); no broadcast
    ("ZeRO-2", "control file"): (1, 1, None),
    ("ZeRO-2", "recorder"): (0, 1, 0),  # the same read; the table goes into the ring in place
    ("ZeRO-2", "measured"): (2, 1, None),  # the SUM and MAX all-reduces, the one host copy of the reduced table
    # the loss's all-reduce and the trigger's read (norm and loss in one copy), then the ring's reduction and copy
    ("ZeRO-2", "fire"): (3, 2, None),
    ("Megatron hook (ZeRO-2)", "hook, feature off"): (0, 0, 0),
    ("Megatron hook (ZeRO-2)", "hook, quiet iteration"): (0, 0, 0),
    ("Megatron hook (ZeRO-2)", "hook, logged iteration"): (0, 0, 0),
    # the loss the trigger watches stays on the device: read with the global norm, in the trigger's one copy
    ("Megatron hook (ZeRO-2)", "hook, loss_factor set"): (0, 0, 0),
    ("stage 0 fp32", "quiet"): (0, 0, 0),
    # every rank holds the whole gradient: no collective; the stock operators' one check for non-finite values
    # (partition_stats.accumulate_spans), then the host copy
    ("stage 0 fp32", "measured"): (0, 2, None),
}


CORE = (("ZeRO-2", "off"), ("ZeRO-2", "quiet"), ("ZeRO-2", "measured"))
"""DESIGN.md section 4's claim, counted in the suite; the other modes, the hook and stage 0 in the extended tier."""
LAUNCHES = {  # tier: (the modes of each family, the hook's modes)
    "suite": ({"ZeRO-2": tuple(mode for family, mode in CORE)}, ()),
    "extended": ({"ZeRO-2": tuple(mode for mode in ledger.MODES if ("ZeRO-2", mode) not in CORE),
                  "stage 0 fp32": ("quiet", "measured")}, tuple(ledger.HOOK_MODES)),
}


@lru_cache(maxsize=None)
def rows(tier: str) -> dict:
    """One 2-rank launch per tier: rank 0's row of each (family, mode)."""
    plan, hook_modes = LAUNCHES[tier]
    return {(row["family"], row["mode"]): row for row in launch(ledger.count_step_costs, 2, plan, hook_modes)[0]}


@pytest.mark.parametrize("key", [pytest.param(key, marks=[] if key in CORE else [pytest.mark.extended])
                                 for key in EXPECTED], ids=[f"{family}-{mode}" for family, mode in EXPECTED])
def test_collectives_host_syncs_and_allocations_per_step(key):
    collectives, syncs, allocations = EXPECTED[key]
    row = rows("suite" if key in CORE else "extended")[key]
    assert row["collectives"] == collectives, row
    assert row["syncs"] == syncs, row["sync_sites"]
    if allocations is not None:
        assert row["allocations"] == allocations, row
    if key[1] in ("off", "quiet", "hook, quiet iteration"):
        assert row["ops"] == 0, row  # no work on a tensor at all, per parameter or otherwise


def test_the_counter_sees_host_reads_inside_the_call_sites_only():
    counter = ledger.CallSiteCounter()
    try:
        device_tensor = torch.ones(3)

        def reads(tensor):
            host = tensor.sum().cpu()
            return float(tensor[0]) + tensor.max().item() + bool(tensor.all()) + host.item() + len(tensor.tolist())

        counter.counting = True
        reads(device_tensor)  # outside a wrapped call: nothing counted
        assert counter.take().syncs == 0
        counter.wrapped(reads)(device_tensor)
        costs = counter.take()
        # float, item, bool, tolist and the transfer; the transferred copy's own item is no sync
        assert costs.syncs == 5, costs.sync_sites
        assert costs.allocations >= 3 and costs.ops >= 4
    finally:
        counter.close()
    assert "watched" not in repr(torch.Tensor.item)
