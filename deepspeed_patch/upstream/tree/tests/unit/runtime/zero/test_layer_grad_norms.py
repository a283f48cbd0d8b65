# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import math

import deepspeed
import pytest
import torch
from deepspeed.runtime.layer_grad_norms import LayerGradNormsConfigError
from deepspeed.utils import safe_get_full_grad
from unit.common import DistributedTest
from unit.simple_model import SimpleModel, random_dataloader

HIDDEN_DIM = 16
NUM_LAYERS = 4


def get_config(zero_stage, clip, layer_grad_norms=None):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": clip,
        "optimizer": {
            "type": "SGD",
            "params": {
                "lr": 0.1
            }
        },
        "zero_optimization": {
            "stage": zero_stage
        },
        "zero_allow_untested_optimizer": True,
    }
    if layer_grad_norms is not None:
        config["layer_grad_norms"] = layer_grad_norms
    return config


def reference_layer_stats(engine):
    """Per layer, from the full gradient DeepSpeed gathers after backward (float64)."""
    grads = {}
    for name, param in engine.module.named_parameters():
        key = int(name.split(".")[1])
        grads.setdefault(key, []).append(safe_get_full_grad(param).double().flatten())
    return {key: torch.cat(parts) for key, parts in grads.items()}


@pytest.mark.parametrize("zero_stage", [1, 2])
@pytest.mark.parametrize("clip", [0.0, 0.05])
class TestLayerGradNorms(DistributedTest):
    world_size = 2

    def test(self, zero_stage, clip):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
        block = {"enabled": True, "layer_pattern": r"linears\.(\d+)\."}
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=get_config(zero_stage, clip, block))
        data_loader = random_dataloader(model=engine,
                                        total_samples=6,
                                        hidden_dim=HIDDEN_DIM,
                                        device=engine.device,
                                        dtype=torch.float)
        for step, batch in enumerate(data_loader, start=1):
            loss = engine(batch[0], batch[1])
            engine.backward(loss)
            reference = reference_layer_stats(engine)
            engine.step()
            stats = engine.get_layer_grad_norms()
            assert stats is not None and stats["step"] == step and not stats["overflow"]
            assert set(stats["pre_clip"]) == set(range(NUM_LAYERS))
            total = math.sqrt(sum(grad.norm()**2 for grad in reference.values()))
            expected_coef = min(1.0, clip / (total + 1e-6)) if clip > 0 else 1.0
            assert stats["clip_coef"] == pytest.approx(expected_coef, rel=1e-5)
            for key, grad in reference.items():
                measured = stats["pre_clip"][key]
                assert measured["norm"] == pytest.approx(grad.norm().item(), rel=1e-5)
                assert measured["min"] == pytest.approx(grad.min().item(), rel=1e-5)
                assert measured["max"] == pytest.approx(grad.max().item(), rel=1e-5)
                assert stats["post_clip"][key]["norm"] == pytest.approx(measured["norm"] * stats["clip_coef"])


class TestLayerGradNormsOff(DistributedTest):
    world_size = 1

    def test_disabled_by_default(self):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2)
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=get_config(2, 0.0))
        batch = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
        engine.backward(engine(batch[0], batch[1]))
        engine.step()
        assert engine.get_layer_grad_norms() is None

    def test_bad_value_names_key(self):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2)
        with pytest.raises(LayerGradNormsConfigError, match="layer_grad_norms.interval=0"):
            deepspeed.initialize(model=model,
                                 model_parameters=model.parameters(),
                                 config=get_config(2, 0.0, {
                                     "enabled": True,
                                     "interval": 0
                                 }))
