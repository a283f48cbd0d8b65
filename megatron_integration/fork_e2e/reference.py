"""A plain-PyTorch reference for the gradient norm, for the set-ups where the fork logs none.

In fp32 without ZeRO, DeepSpeed's engine steps a torch optimizer, which keeps no global norm:
``get_global_grad_norm()`` stays ``None`` (only ZeRO and the fp16/bf16 optimizers set one), so the fork's
log line and TensorBoard carry no grad norm to check the buckets against. Nor is the norm the engine clips
by there (``clip_fp32_gradients``, ``runtime.utils.clip_grad_norm_``) the whole model's: under a pipeline
it counts a parameter that is not tensor-sliced on model-parallel rank 0 only, that is, on the first
stage. So each rank wraps its engine's ``clip_fp32_gradients``: right before the clip, every rank's
``{parameter name: sum of squares of its .grad}`` is gathered, and rank 0 prints the norm of the
gradient made of every name once. A name held by more than one rank (a data-parallel replica, a
pipeline-tied copy) must hold the same gradient there, except a copy whose gradient is all zeros: a copy
no forward pass uses, such as the position embeddings inside the last stage's tied embedding module
(DeepSpeed fills a missing gradient with zeros before its data-parallel all-reduce, and its pipeline
reduces only the tied weight between the stages). How far the other copies differ, and which names
have such a zero copy, are printed too. This reads the gradients only, with no code of the package and
no DeepSpeed rule about which copy counts.
"""

import math
import os
import re
from typing import Dict, List, Sequence, Tuple

import torch

REFERENCE_LINE = "[fork_e2e] reference grad norm:"
REFERENCE_PATTERN = re.compile(re.escape(REFERENCE_LINE) + r" iteration (\d+): (\S+) \(copies differ by (\S+);")


def square_sums(module: torch.nn.Module) -> Dict[str, float]:
    """Each named parameter's sum of squared gradient elements, in float64, where it has a gradient."""
    return {name: param.grad.detach().double().pow(2).sum().item() for name, param in module.named_parameters()
            if param.grad is not None}


def combined_norm(tables: Sequence[Dict[str, float]]) -> Tuple[float, float, List[str]]:
    """The norm of the gradient made of every name of ``tables`` once; the largest relative difference
    between two copies of one name, all-zero copies left out (0 where no name has two such copies); and
    the names that have an all-zero copy beside a non-zero one."""
    copies: Dict[str, List[float]] = {}
    for table in tables:
        for name, value in table.items():
            copies.setdefault(name, []).append(value)
    used = {name: [value for value in values if value > 0] for name, values in copies.items()}
    spread = max(((max(values) - min(values)) / max(values) for values in used.values() if values), default=0.0)
    zero_copies = sorted(name for name, values in used.items() if values and len(values) < len(copies[name]))
    return math.sqrt(sum(max(values, default=0.0) for values in used.values())), spread, zero_copies


def report_reference_norm(engine) -> None:
    """Make ``engine`` print, on rank 0, the reference norm of the gradient it is about to clip, each time it
    calls ``clip_fp32_gradients`` (fp32 without ZeRO, with gradient clipping). Every rank of the run calls it
    once per step, so the gather below is matched on every rank. The line carries the fork's iteration:
    the engine's step count before this step, plus one."""
    clip = engine.clip_fp32_gradients

    def clip_after_reference() -> None:
        tables: List[Dict[str, float]] = [{} for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(tables, square_sums(engine.module))
        if os.environ.get("RANK", "0") == "0":
            norm, spread, zero_copies = combined_norm(tables)
            print(f"{REFERENCE_LINE} iteration {engine.global_steps + 1}: {norm!r} (copies differ by {spread:.1e}; "
                  f"all-zero copies of: {', '.join(zero_copies) or 'none'})", flush=True)
        clip()

    engine.clip_fp32_gradients = clip_after_reference


def parse_reference_norms(stdout: str) -> Tuple[Dict[int, float], float]:
    """The reference norm at each iteration printed in ``stdout``, and the largest difference of copies."""
    found = REFERENCE_PATTERN.findall(stdout)
    norms = {int(iteration): float(norm) for iteration, norm, _ in found}
    return norms, max((float(spread) for _, _, spread in found), default=0.0)
