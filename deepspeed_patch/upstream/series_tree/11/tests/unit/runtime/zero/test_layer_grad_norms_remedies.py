# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import math

import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param
from unit.common import DistributedTest
from unit.runtime.zero import test_layer_grad_norms as base
from unit.runtime.zero.test_layer_grad_norms_recorder import SPIKE, SPIKE_STEP, STEPS, engine_and_batch

LR = 0.1  # get_config's SGD: a step changes each layer's weights by LR x its (clipped) gradient
ADAPTIVE = {"enabled": True, "beta": 0.5, "factor": 1.05, "warmup_steps": 2}
SKIP = {"enabled": True, "sigma": 6.0, "window": 4}


def weights(engine):
    """Per layer, the full fp32 master weights."""
    layers = {}
    for name, param in engine.module.named_parameters():
        layers.setdefault(int(name.split(".")[1]), []).append(safe_get_full_fp32_param(param).double().flatten())
    return {key: torch.cat(parts) for key, parts in layers.items()}


class AdaGC:
    """AdaGC's per-layer factors (arXiv 2502.11034), written out here from the paper's rule: the smallest norm of
    the warm-up steps, then ``min(1, factor * ema / norm)`` and ``ema <- beta * ema + (1 - beta) * clipped``."""

    def __init__(self):
        self.ema, self.steps = {}, 0

    def step(self, norms):
        factors = None
        if self.steps >= ADAPTIVE["warmup_steps"]:
            factors = {key: min(1.0, ADAPTIVE["factor"] * self.ema[key] / norm) for key, norm in norms.items()}
        for key, norm in norms.items():
            clipped = norm * (1.0 if factors is None else factors[key])
            beta = ADAPTIVE["beta"]
            self.ema[key] = min(self.ema.get(key, math.inf), clipped) if factors is None else (beta * self.ema[key] +
                                                                                               (1 - beta) * clipped)
        self.steps += 1
        return factors


def check_remedy(zero_stage, dtype, remedy):
    """A gradient spike at ``SPIKE_STEP``: ``skip_step`` leaves the weights of a step it skips untouched and
    steps the others; ``adaptive_clipping`` scales each layer's applied update by the factor AdaGC's rule gives
    on the full gradients' norms."""
    base.skip_unsupported(dtype)
    engine, batch = engine_and_batch(zero_stage, dtype,
                                       {**base.BLOCK, remedy: ADAPTIVE if remedy == "adaptive_clipping" else SKIP})
    adagc, skipped, checked = AdaGC(), [], 0
    for step in range(1, STEPS + 1):
        loss = engine(batch[0], batch[1])
        engine.backward(loss * SPIKE if step == SPIKE_STEP else loss)
        norms = {key: grad.norm().item() for key, grad in base.reference_grads(engine, 1.0).items()}
        before = weights(engine)
        engine.step()
        applied = {key: ((weights(engine)[key] - value) / LR).norm().item() for key, value in before.items()}
        stats = engine.get_layer_grad_norms()
        if remedy == "skip_step":
            if stats["skipped"]:
                skipped.append(step)
            assert all(norm == 0.0 for norm in applied.values()) == stats["skipped"]
            continue
        factors = adagc.step(norms)
        if step == SPIKE_STEP:  # the spike is clipped to about factor x the layer's average
            assert max(factors.values()) < 0.1
        assert (stats["adaptive_clip"] is None) == (factors is None)
        for key, norm in norms.items():
            factor = 1.0 if factors is None else factors[key]
            assert applied[key] == pytest.approx(norm * factor, rel=1e-3)
            if factors is not None:
                assert stats["adaptive_clip"][key] == pytest.approx(factor, rel=1e-3)
            checked += 1
    if remedy == "skip_step":
        assert skipped == [SPIKE_STEP]
    else:
        assert checked == STEPS * base.NUM_LAYERS


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("remedy", ["adaptive_clipping", "skip_step"])
class TestLayerGradNormsRemedies(DistributedTest):
    world_size = 2

    def test(self, zero_stage, dtype, remedy):
        check_remedy(zero_stage, dtype, remedy)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
@pytest.mark.parametrize("remedy", ["adaptive_clipping", "skip_step"])
class TestLayerGradNormsRemediesOneRank(DistributedTest):
    world_size = 1

    def test(self, zero_stage, remedy):
        check_remedy(zero_stage, torch.float32, remedy)
