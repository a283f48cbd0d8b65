"""The runs that compare the whole upstream series with the package (tests/test_upstream_series.py): the same
small runs, once with ``deepspeed_patch`` on the installed DeepSpeed and once on a copy of it with the whole series
applied (``zero_workers.UPSTREAM_ENV`` set, ``deepspeed_patch`` unimportable), in one 2-rank launch each.

    python tests/series_workers.py OUTPUT   # OUTPUT: a pickle of {run: what it recorded} (rank 0's)
"""

import pickle
import sys
from typing import Any, Dict

from megatron_integration.cpu_launch import launch
from recorder_workers import recorder_case
from recorder_workers import train as train_recorder
from zero_workers import DEFAULT_CASE, run_each, train

WORLD_SIZE = 2
RUNS: Dict[str, Dict[str, Any]] = {
    "z1": {"stage": 1, "gas": 2},
    "z2_clip_fp16_overflow": {"stage": 2, "dtype": "fp16", "clip": 0.5, "overflow_step": 2},
    "z3_clip": {"stage": 3, "clip": 0.5},
    "bf16_optimizer_clip": {"stage": 1, "dtype": "bf16", "grad_accum_dtype": "fp32", "clip": 0.5},
    "z2_optimizer_statistics": {"stage": 2, "block": {"optimizer_statistics": ["param"]}},
}
TRIGGER_RUNS = {"z2_trigger_recorder": recorder_case(stage=2)}
COMPARED = ("measured", "global_norm", "history", "fires", "final")
"""What each run's record holds that the comparison reads: every step's result dict, DeepSpeed's global norm,
the recorder's history and fires (trigger runs), and the final weights."""


def run_all() -> Dict[str, Any]:
    """Every run on this rank; a failing run is recorded (``error``), not raised."""
    results = run_each(RUNS, DEFAULT_CASE, lambda case: train(case, enabled=True))
    results.update(run_each(TRIGGER_RUNS, {}, lambda case: train_recorder(case, enabled=True, count=True)))
    return {name: {key: value for key, value in record.items() if key in COMPARED + ("error", )}
            for name, record in results.items()}


if __name__ == "__main__":
    with open(sys.argv[1], "wb") as handle:
        pickle.dump(launch(run_all, WORLD_SIZE, timeout=1500)[0], handle)
