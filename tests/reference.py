"""Independent reference: per-bucket statistics from full gradients computed in plain PyTorch.

Nothing here imports the code under test. Buckets follow the documented rule (``layers.N.`` gives
layer N; any other parameter goes to the bucket named after its module; in Hugging Face's T5 and
BART, ``encoder.block.N.`` / ``model.encoder.layers.N.`` give ``"encoder.N"``, the decoder's ``"decoder.N"``).
"""

import math
import re
from collections import defaultdict
from typing import Callable, Dict, Hashable, Iterable, Optional

import pytest
import torch

from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig

STATS = ("norm", "min", "max", "abs_min", "abs_max")
# Worst relative error allowed against the reference (see assert_close_stats).
# Low-precision runs reduce across ranks in their own dtype, the reference in float64.
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-3}

LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")
ENCODER_DECODER_LAYER = re.compile(r"^(?:model\.)?(encoder|decoder)\.(?:block|layers)\.(\d+)\.")


def reference_bucket(name: str) -> Hashable:
    match = LAYER_NAME.search(name)
    return int(match.group(1)) if match else name.rpartition(".")[0] or name


def encoder_decoder_bucket(name: str) -> str:
    """The documented bucket of a T5 or BART parameter: ``"encoder.3"``, ``"decoder.0"`` or its module."""
    match = ENCODER_DECODER_LAYER.match(name)
    return ".".join(match.groups()) if match else name.rpartition(".")[0]


def reference_key_of(block: Dict) -> Callable[[str], Optional[Hashable]]:
    """The documented bucket of a parameter name for a ``layer_grad_norms`` block's granularity."""
    if block.get("granularity") == "param":
        return lambda name: name
    if block.get("granularity") == "group_by":
        grouping = re.compile(block["group_by"])

        def group_key(name: str) -> Optional[str]:
            match = grouping.search(name)
            return ".".join(match.groups()) if match else None

        return group_key
    return reference_bucket


def bucket_stats(named_grads: Dict[str, torch.Tensor],
                 key_of: Callable[[str], Optional[Hashable]] = reference_bucket) -> Dict[Hashable, Dict[str, float]]:
    """Every statistic of each bucket's concatenated gradient; ``key_of(name)`` None leaves a parameter out."""
    pieces = defaultdict(list)
    for name, grad in named_grads.items():
        if key_of(name) is not None:
            pieces[key_of(name)].append(grad.double().reshape(-1))
    stats = {}
    for key, tensors in pieces.items():
        flat = torch.cat(tensors)
        stats[key] = {
            "norm": flat.square().sum().sqrt().item(),
            "min": flat.min().item(),
            "max": flat.max().item(),
            "abs_min": flat.abs().min().item(),
            "abs_max": flat.abs().max().item(),
            "nonfinite": int((~torch.isfinite(flat)).sum()),
            "l1": flat.abs().sum().item(),
            "mean": flat.mean().item(),
            "zeros": int((flat == 0).sum()),
            "numel": flat.numel(),
        }
    return stats


def averaged_gradients(weights: Dict[str, torch.Tensor], config: TinyGPTConfig, dtype: torch.dtype,
                       batches: Iterable[torch.Tensor], frozen: Iterable[str] = (),
                       loss_scale: float = 1.0, blow_up: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """Mean gradient (float64) over ``batches`` of a TinyGPT holding ``weights``, run in ``dtype``.

    ``loss_scale`` multiplies the loss before backward and divides the gradient after, as fp16
    training does, so that small fp16 gradients do not flush to zero in the reference either.
    ``blow_up`` multiplies the loss first and stays in the gradient, as a test's forced overflow does
    (``loss * blow_up``, then the engine's ``backward`` multiplies by its loss scale).
    """
    model = TinyGPT(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    model.to(dtype)
    frozen = set(frozen)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    total = {}
    count = 0
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss = model(batch) if blow_up is None else model(batch) * blow_up
        (loss * loss_scale).backward()
        for name, param in model.named_parameters():
            if param.grad is not None:
                grad = param.grad.double() / loss_scale
                total[name] = total[name] + grad if name in total else grad
        count += 1
    return {name: grad / count for name, grad in total.items()}


def mean_gradients(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module, Dict], torch.Tensor],
                   batches: Iterable[Dict]) -> Dict[str, torch.Tensor]:
    """Mean gradient (float64) of ``loss_of(model, batch)`` over ``batches``, by parameter name (a tied
    weight once, under its first name)."""
    total: Dict[str, torch.Tensor] = {}
    count = 0
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        for name, param in model.named_parameters():
            if param.grad is not None:
                total[name] = total.get(name, 0) + param.grad.double()
        count += 1
    return {name: grad / count for name, grad in total.items()}


def assert_close_stats(measured, reference, tolerance, stats=STATS, summed: bool = True, floor: float = 0.0):
    """Relative error: of the norm to the norm; of abs_min to itself where the gradient is one backward's
    (``summed`` False: every element is off by at most its own rounding, so their smallest |value| is too, give
    or take ``floor``, the absolute rounding step of the smallest values: an fp16 gradient's subnormal step over
    the loss scale it carried);
    of the other elementwise statistics, and of abs_min of a gradient summed over ranks or micro-batches, to
    the largest |element|: the smallest element of a sum is where its terms cancel, and its rounding is that
    of the terms, not of the result. A zero scale asks for an exact 0."""
    assert reference and stats, "nothing to compare"
    for key, ref in reference.items():
        for stat in stats:
            own = stat == "norm" or (stat == "abs_min" and not summed)
            scale = max(ref[stat if own else "abs_max"], 1e-30)
            allowed = tolerance * scale + (floor if stat == "abs_min" and own else 0.0)
            error = abs(measured[key][stat] - ref[stat])
            assert error <= allowed, f"bucket {key!r} {stat}: {measured[key][stat]} vs reference {ref[stat]}"


def assert_matches_applied(post_clip: Dict, applied: Dict, weights: Dict, tolerance: float,
                           elementwise: Optional[float] = None) -> None:
    """``post_clip`` against ``applied``, the per-bucket statistics of the step SGD with lr 1 took (the weights
    before it minus after it; ``weights``: the statistics of the weights before it), over the buckets of
    ``applied``: the norm to ``tolerance``; min, max and abs_max to ``elementwise`` (default ``tolerance``) of the
    bucket's largest change, plus the weights' fp32 rounding: an element's change is off by up to an ulp of its
    weight, at most fp32 epsilon times the bucket's largest weight (weights near 1 taking steps of 1e-5)."""
    assert applied and set(applied) <= set(post_clip), (sorted(map(str, applied)), sorted(map(str, post_clip)))
    assert_close_stats(post_clip, applied, tolerance, stats=("norm", ))
    for key, change in applied.items():
        rounding = torch.finfo(torch.float32).eps * weights[key]["abs_max"] / max(change["abs_max"], 1e-30)
        assert_close_stats({key: post_clip[key]}, {key: change}, (elementwise or tolerance) + rounding,
                           stats=("min", "max", "abs_max"))


def assert_clipped_like_torch(measured: dict, reference: Dict, max_norm: float, tolerance: float,
                              stats=STATS) -> None:
    """``pre_clip`` equal to ``reference`` bucket for bucket, clipping active, and ``clip_coef`` and ``post_clip``
    as ``torch.nn.utils.clip_grad_norm_`` to ``max_norm`` makes them from the reference (which covers every
    parameter)."""
    assert set(measured["pre_clip"]) == set(reference)
    assert_close_stats(measured["pre_clip"], reference, tolerance, stats=stats)
    coef = min(1.0, max_norm / (math.sqrt(sum(ref["norm"]**2 for ref in reference.values())) + 1e-6))
    assert coef < 0.5  # clipping is active
    assert measured["clip_coef"] == pytest.approx(coef, rel=1e-5)
    clipped = {key: {stat: ref[stat] * coef for stat in stats} for key, ref in reference.items()}
    assert_close_stats(measured["post_clip"], clipped, tolerance, stats=stats)
