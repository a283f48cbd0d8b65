# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import deepspeed
import pytest
import torch
from unit.common import DistributedTest
from unit.runtime.zero import test_layer_grad_norms as base
from unit.simple_model import SimpleModel, random_dataloader

SPIKE = 64.0  # a power of two: the spiked step's gradient is the ordinary one scaled exactly
SPIKE_STEP, STEPS, HISTORY = 7, 8, 4
TRIGGER = {"grad_norm_factor": 3.0, "window": 5, "capture_steps": 1, "history": HISTORY}


def assert_matches(stats, reference, tolerance):
    """Each layer's norm, min and max against the full gradient; returns how many layers it checked."""
    assert set(stats) == set(reference)
    for key, grad in reference.items():
        assert stats[key]["norm"] == pytest.approx(grad.norm().item(), rel=tolerance)
        assert stats[key]["max"] == pytest.approx(grad.max().item(), rel=tolerance)
        assert stats[key]["min"] == pytest.approx(grad.min().item(), rel=tolerance)
    return len(reference)


def engine_and_batch(zero_stage, dtype, block):
    """An engine of ``base``'s model and config with ``block``, without clipping, and one batch: trained on it
    again and again, the gradient norm changes little from step to step, and only the spike stands out. Seeded: a
    test on one rank runs in a process that earlier tests drew random numbers in."""
    torch.manual_seed(0)
    model = SimpleModel(hidden_dim=base.HIDDEN_DIM, nlayers=base.NUM_LAYERS)
    config = base.get_config(zero_stage, dtype, 0.0, block)
    if zero_stage == 3:
        # ZeRO-3's coalesced all-gather of the persistent parameters after each step waits on its last collective
        # only; on gloo the others may still run, so a rank can train a step on uninitialized memory
        # (deepspeedai/DeepSpeed#8539). The trigger judges the training's own norms, which that step would wreck:
        # gather one parameter at a time, each waited for.
        config["zero_optimization"]["stage3_allgather_sequential"] = True
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loader = random_dataloader(model=engine,
                               total_samples=engine.train_micro_batch_size_per_gpu(),
                               hidden_dim=base.HIDDEN_DIM,
                               device=engine.device,
                               dtype=dtype)
    return engine, next(iter(loader))


def check_recorder(zero_stage, dtype):
    """With ``enabled: false`` and a recorder, a gradient spike fires the trigger, the flight recorder's replay of
    the last ``HISTORY`` steps equals those steps' full gradients, and the step after the fire is captured whole."""
    base.skip_unsupported(dtype)
    engine, batch = engine_and_batch(zero_stage, dtype, {**base.BLOCK, "enabled": False, "trigger": TRIGGER})
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    references, checked = {}, 0
    for step in range(1, STEPS + 1):
        loss = engine(batch[0], batch[1])
        engine.backward(loss * SPIKE if step == SPIKE_STEP else loss)
        references[step] = base.reference_grads(engine, base.loss_scales(engine, dtype)[1])
        engine.step()
        history = engine.get_layer_grad_norms_history()
        if step < SPIKE_STEP:
            assert history is None and engine.get_layer_grad_norms() is None, step  # enabled: false
            continue
        assert [entry["step"] for entry in history] == list(range(SPIKE_STEP - HISTORY + 1, SPIKE_STEP + 1))
        if step == SPIKE_STEP:
            for entry in history:
                assert entry["trigger"]["fired_at"] == SPIKE_STEP
                checked += assert_matches(entry["pre_clip"], references[entry["step"]], tolerance)
        else:
            captured = engine.get_layer_grad_norms()
            assert captured["step"] == step and captured["trigger"]["fired_at"] == SPIKE_STEP
            checked += assert_matches(captured["pre_clip"], references[step], tolerance)
    assert checked == (HISTORY + 1) * base.NUM_LAYERS


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
class TestLayerGradNormsRecorder(DistributedTest):
    world_size = 2

    def test(self, zero_stage, dtype):
        check_recorder(zero_stage, dtype)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
class TestLayerGradNormsRecorderOneRank(DistributedTest):
    world_size = 1

    def test(self, zero_stage):
        check_recorder(zero_stage, torch.float32)
