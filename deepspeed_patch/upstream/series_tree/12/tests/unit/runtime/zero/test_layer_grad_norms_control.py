# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import json
import os

import deepspeed
import deepspeed.comm as dist
import torch
from unit.common import DistributedTest
from unit.runtime.zero import test_layer_grad_norms as base
from unit.simple_model import SimpleModel, random_dataloader

STEPS = 8
POLL = 2  # control_interval


def train(block, before_step):
    """``STEPS`` ZeRO-2 steps with ``block``, ``before_step(engine, step)`` called before each; the step of the last
    measured result after each step (``None`` before the first), and the layers of each measured result."""
    model = SimpleModel(hidden_dim=base.HIDDEN_DIM, nlayers=base.NUM_LAYERS)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=base.get_config(2, torch.float32, 0.0, block))
    batch = next(iter(random_dataloader(engine, 2, base.HIDDEN_DIM, engine.device, torch.float)))
    seen, layers = [], {}
    for step in range(1, STEPS + 1):
        before_step(engine, step)
        engine.backward(engine(batch[0], batch[1]))
        engine.step()
        stats = engine.get_layer_grad_norms()
        seen.append(None if stats is None else stats["step"])
        if stats is not None:
            layers[stats["step"]] = set(stats["pre_clip"])
    return seen, layers


class TestLayerGradNormsLiveControl(DistributedTest):
    world_size = 2

    def test_engine_method(self):
        """Measuring every 100 steps (none here), then every step from step 3 on layers 0 and 1 only, then off from
        step 6: every rank calls ``set_layer_grad_norms`` before the same step."""

        def control(engine, step):
            if step == 3:
                engine.set_layer_grad_norms(interval=1, layers=[0, 1])
            if step == 6:
                engine.set_layer_grad_norms(enabled=False)

        seen, layers = train({**base.BLOCK, "interval": 100}, control)
        assert seen == [None, None, 3, 4, 5, 5, 5, 5]
        assert layers == {step: {0, 1} for step in (3, 4, 5)}

    def test_control_file(self, tmpdir):
        """``enabled: false`` with a control file that rank 0 alone writes before step 3: every rank switches on at
        the same step, ``POLL`` to ``2 * POLL - 1`` steps later (the first poll after the write issues the flag,
        the next applies it), and stays on."""
        path = os.path.join(str(tmpdir), "control.json")

        def write_on_rank0(engine, step):
            if step == 3 and dist.get_rank() == 0:
                with open(path, "w") as handle:
                    json.dump({"enabled": True, "interval": 1}, handle)

        block = {**base.BLOCK, "enabled": False, "control_file": path, "control_interval": POLL}
        seen, _ = train(block, write_on_rank0)
        first = next(position for position, step in enumerate(seen, start=1) if step is not None)
        assert 3 + POLL <= first <= 3 + 2 * POLL - 1, seen
        assert seen == [None] * (first - 1) + list(range(first, STEPS + 1))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, seen)
        assert all(other == seen for other in everyone)
