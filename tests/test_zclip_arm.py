"""The ZClip arm of benchmarks/remedies_natural.py acts on a ZeRO-2 engine's gradient as the ``zclip`` package acts
on a plain-PyTorch model's.

Reference: ``zclip.ZClip.step(model)`` itself, in plain PyTorch, on the same weights and batches (SGD, lr 1: a
step's update is the clipped gradient). Under test: ``EngineZClip`` on a ZeRO-2 engine of one CPU rank, where
``param.grad`` is empty and ZClip alone could not act. Gradient outliers (the loss x50 at a few steps after ZClip's
warm-up) make it clip; the test checks it did, and that the weights agree step by step.
"""

import os
import sys

import pytest
import torch

pytest.importorskip("zclip")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from megatron_integration.cpu_launch import launch  # noqa: E402

STEPS = 40
OUTLIERS = {30: 50.0, 36: 50.0}
"""Steps whose loss (hence gradient) is multiplied: after ZClip's 25 warm-up steps, outliers by its z-score."""
ZCLIP_ARGS = {"max_grad_norm": None}
"""ZClip's defaults, its fixed cap off (the model's norms stay far below it anyway)."""


def model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator))
               for _ in range(STEPS)]
    return model, batches


def loss_of(model, batch, step):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y) * OUTLIERS.get(step, 1.0)


def reference_weights():
    """The plain-PyTorch run: ``ZClip.step(model)`` between backward and ``optimizer.step()``."""
    from zclip import ZClip

    model, batches = model_and_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    zclip = ZClip(**ZCLIP_ARGS)
    weights = []
    for step, batch in enumerate(batches, 1):
        optimizer.zero_grad()
        loss_of(model, batch, step).backward()
        zclip.step(model)
        optimizer.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    return weights


def engine_run():
    """On the launched rank: the ZeRO-2 engine with ``EngineZClip``; its weights after every step, and the limits."""
    import deepspeed
    from remedies_natural import EngineZClip

    import deepspeed_patch

    deepspeed_patch.install()
    model, batches = model_and_batches()
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config)
    zclip = EngineZClip(engine.optimizer, **ZCLIP_ARGS)
    weights = []
    for step, batch in enumerate(batches, 1):
        engine.backward(loss_of(engine, batch, step))
        engine.step()
        weights.append(torch.cat([p.detach().flatten() for p in engine.module.parameters()]).clone())
    engine.destroy()
    return weights, zclip.limits


@pytest.mark.extended
def test_engine_zclip_matches_zclip_on_plain_pytorch():
    (weights, limits), = launch(engine_run, 1)
    expected = reference_weights()
    clipped = [step for step, limit in enumerate(limits, 1) if limit > 0]
    assert clipped and set(clipped) >= set(OUTLIERS), clipped
    assert len(weights) == len(expected) == STEPS
    for step, (got, want) in enumerate(zip(weights, expected), 1):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
