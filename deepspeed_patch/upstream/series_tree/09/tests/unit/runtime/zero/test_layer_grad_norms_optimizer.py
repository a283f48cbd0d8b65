# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import deepspeed
import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.common import DistributedTest
from unit.runtime.zero import test_layer_grad_norms as base
from unit.simple_model import SimpleModel, random_dataloader

KINDS = ("param", "update", "exp_avg", "exp_avg_sq")
STEPS = 3


def full_state(engine, param, kind):
    """The full fp32 master weight or Adam moment of ``param`` as DeepSpeed assembles it (without ZeRO in fp32,
    the parameter and the torch optimizer's own state)."""
    value = safe_get_full_fp32_param(param) if kind == "param" else safe_get_full_optimizer_state(param, kind)
    if value is None:
        value = param if kind == "param" else engine.optimizer.state[param][kind]
    return value.detach().double().flatten().clone()


def reference_state(engine, kinds):
    """Per kind and layer, the full fp32 tensor."""
    layers = {}
    for name, param in engine.module.named_parameters():
        for kind in kinds:
            layers.setdefault(kind, {}).setdefault(int(name.split(".")[1]), []).append(full_state(engine, param, kind))
    return {kind: {key: torch.cat(parts) for key, parts in by_layer.items()} for kind, by_layer in layers.items()}


def check_optimizer_statistics(zero_stage, dtype):
    """Each layer's fp32 weights, the update the Adam step applied to them (after minus before) and Adam's
    moments, against the full tensors DeepSpeed's ``safe_get_full_*`` assemble."""
    base.skip_unsupported(dtype)
    model = SimpleModel(hidden_dim=base.HIDDEN_DIM, nlayers=base.NUM_LAYERS)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = base.get_config(zero_stage, dtype, 1.0, {**base.BLOCK, "optimizer_statistics": list(KINDS)})
    del config["optimizer"]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loader = random_dataloader(model=engine,
                               total_samples=2 * STEPS,
                               hidden_dim=base.HIDDEN_DIM,
                               device=engine.device,
                               dtype=dtype)
    before = reference_state(engine, ("param", ))["param"]
    checked = 0
    for step, batch in enumerate(loader, start=1):
        engine.backward(engine(batch[0], batch[1]))
        engine.step()
        after = reference_state(engine, ("param", "exp_avg", "exp_avg_sq"))
        after["update"] = {key: after["param"][key] - before[key] for key in before}
        stats = engine.get_layer_grad_norms()
        assert stats["step"] == step
        for kind in KINDS:
            for key, value in after[kind].items():
                tolerance = 1e-3 if kind == "update" else 1e-5  # the reference's update carries fp32 rounding
                assert stats[kind][key]["norm"] == pytest.approx(value.norm().item(), rel=tolerance)
                assert stats[kind][key]["max"] == pytest.approx(value.max().item(), rel=tolerance, abs=1e-8)
                checked += 1
        before = after["param"]
    assert checked == STEPS * len(KINDS) * base.NUM_LAYERS


STAGES_AND_DTYPES = [(0, torch.float32), (1, torch.float32), (2, torch.float32), (3, torch.float32),
                     (1, torch.bfloat16), (2, torch.bfloat16), (3, torch.bfloat16)]


@pytest.mark.parametrize("zero_stage, dtype", STAGES_AND_DTYPES)
class TestLayerGradNormsOptimizerStatistics(DistributedTest):
    world_size = 2

    def test(self, zero_stage, dtype):
        check_optimizer_statistics(zero_stage, dtype)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
class TestLayerGradNormsOptimizerStatisticsOneRank(DistributedTest):
    world_size = 1

    def test(self, zero_stage):
        check_optimizer_statistics(zero_stage, torch.float32)
