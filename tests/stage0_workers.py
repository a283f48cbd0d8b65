"""What each rank runs in the stage-0 (no ZeRO) parallel tests: the pipeline, tensor-parallel and 3D
workers, with ``zero_optimization.stage`` 0, in one launch per world size."""

from typing import Any, Dict

from parallel3d_workers import run_3d_cases

from pipeline_workers import run_pipeline_cases
from tp_workers import run_tensor_parallel

TP_CASE = "tp2_fp32_clip"


def run_two_ranks(pipeline_cases: Dict[str, Dict[str, Any]], parallel_cases: Dict[str, Dict[str, Any]],
                  tp_clip: float, tp_steps: int) -> Dict[str, Any]:
    """The pipeline cases (tiny GPT), the 3D workers' cases, then the TP 2 model without ZeRO (``TP_CASE``)."""
    results = {**run_pipeline_cases(pipeline_cases), **run_3d_cases(parallel_cases)}
    results[TP_CASE] = run_tensor_parallel(tp_clip, tp_steps, stage=0)
    return results
