# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import math
import re

import deepspeed
import pytest
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.layer_grad_norms.outputs.monitor import MonitorEvents
from deepspeed.utils import safe_get_full_grad
from pydantic import ValidationError
from unit.common import DistributedTest
from unit.simple_model import SimpleModel, random_dataloader

HIDDEN_DIM = 16
NUM_LAYERS = 5  # 1360 parameters: on 2 and 3 ranks every partition boundary cuts a weight (3 ranks: padded to 1362)
BLOCK = {"enabled": True, "layer_pattern": r"linears\.(\d+)\."}
GROUP_BY = r"linears\.(\d+)\.weight"


def get_config(zero_stage, dtype, clip, layer_grad_norms=None):
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
    if dtype == torch.float16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if layer_grad_norms is not None:
        config["layer_grad_norms"] = layer_grad_norms
    return config


def skip_unsupported(dtype):
    if dtype == torch.float16 and not get_accelerator().is_fp16_supported():
        pytest.skip("fp16 is not supported by this accelerator")
    if dtype == torch.bfloat16 and not get_accelerator().is_bf16_supported():
        pytest.skip("bf16 is not supported by this accelerator")


def loss_scales(engine, dtype):
    """The loss scale the optimizer divides the gradient by, and the one the gradient carries: in fp16 both are the
    optimizer's, but without ZeRO ``DeepSpeedEngine.backward`` does not scale the loss (only a ``ZeROOptimizer``'s),
    so those gradients carry none, and what the optimizer applies is divided by its loss scale once more."""
    divides = engine.optimizer.loss_scale if dtype == torch.float16 else 1.0
    return divides, divides if isinstance(engine.optimizer, ZeROOptimizer) else 1.0


def reference_grads(engine, loss_scale):
    """Per layer, the full unscaled gradient DeepSpeed gathers after backward, in float64."""
    grads = {}
    for name, param in engine.module.named_parameters():
        grads.setdefault(int(name.split(".")[1]), []).append(safe_get_full_grad(param).double().flatten() / loss_scale)
    return {key: torch.cat(parts) for key, parts in grads.items()}


def check_steps(zero_stage, dtype, clip):
    skip_unsupported(dtype)
    model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=get_config(zero_stage, dtype, clip, BLOCK))
    loader = random_dataloader(model=engine, total_samples=6, hidden_dim=HIDDEN_DIM, device=engine.device, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    checked = 0
    for step, batch in enumerate(loader, start=1):
        engine.backward(engine(batch[0], batch[1]))
        divides, carries = loss_scales(engine, dtype)
        reference = reference_grads(engine, carries)
        engine.step()
        stats = engine.get_layer_grad_norms()
        assert stats is not None and stats["step"] == step
        assert set(stats["pre_clip"]) == set(range(NUM_LAYERS))
        for key, grad in reference.items():
            measured = stats["pre_clip"][key]
            assert measured["norm"] == pytest.approx(grad.norm().item(), rel=tolerance)
            assert measured["max"] == pytest.approx(grad.max().item(), rel=tolerance)
            assert measured["min"] == pytest.approx(grad.min().item(), rel=tolerance)
            checked += 1
        if stats["overflow"]:
            continue
        total = math.sqrt(sum(grad.norm()**2 for grad in reference.values()))
        ratio = (total * carries / divides + 1e-6) / clip if clip > 0 else 0.0  # DeepSpeed's clip ratio
        expected_coef = carries / (divides * max(1.0, ratio))
        assert stats["clip_coef"] == pytest.approx(expected_coef, rel=tolerance)
        for key, measured in stats["pre_clip"].items():
            assert stats["post_clip"][key]["norm"] == pytest.approx(measured["norm"] * stats["clip_coef"])
    assert checked == 3 * NUM_LAYERS


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clip", [0.0, 0.05])
class TestLayerGradNorms(DistributedTest):
    world_size = 2

    def test(self, zero_stage, dtype, clip):
        check_steps(zero_stage, dtype, clip)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
class TestLayerGradNormsOneAndThreeRanks(DistributedTest):
    world_size = [1, 3]

    def test(self, zero_stage):
        check_steps(zero_stage, torch.float32, 0.05)


def bucket_key(name, granularity):
    if granularity == "param":
        return name
    match = re.search(GROUP_BY, name)
    return match.group(1) if match else None


@pytest.mark.parametrize("granularity", ["param", "group_by"])
class TestLayerGradNormsGranularity(DistributedTest):
    world_size = 2

    def test(self, granularity):
        block = {"enabled": True, "granularity": granularity}
        if granularity == "group_by":
            block["group_by"] = GROUP_BY
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=get_config(2, torch.float32, 0.0, block))
        batch = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
        engine.backward(engine(batch[0], batch[1]))
        expected = {}
        for name, param in engine.module.named_parameters():
            key = bucket_key(name, granularity)
            if key is not None:
                expected.setdefault(key, []).append(safe_get_full_grad(param).double().flatten())
        engine.step()
        stats = engine.get_layer_grad_norms()
        assert set(stats["pre_clip"]) == set(expected)
        for key, parts in expected.items():
            assert stats["pre_clip"][key]["norm"] == pytest.approx(torch.cat(parts).norm().item(), rel=1e-5)
        assert len(expected) == (2 * NUM_LAYERS if granularity == "param" else NUM_LAYERS)


class TestLayerGradNormsSelection(DistributedTest):
    world_size = 2

    def test(self):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
        block = {**BLOCK, "layers": [0, "mid", -1]}
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=get_config(2, torch.float32, 0.0, block))
        batch = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
        engine.backward(engine(batch[0], batch[1]))
        reference = reference_grads(engine, 1.0)
        engine.step()
        stats = engine.get_layer_grad_norms()
        selected = [0, NUM_LAYERS // 2, NUM_LAYERS - 1]
        assert sorted(stats["pre_clip"]) == selected
        for key in selected:
            assert stats["pre_clip"][key]["norm"] == pytest.approx(reference[key].norm().item(), rel=1e-5)


class Stack(torch.nn.Module):

    def __init__(self, hidden_dim, nlayers):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderDecoder(torch.nn.Module):
    """Two stacks of ``layers.N``: the encoder's layer 1 and the decoder's are buckets of their own."""

    def __init__(self, hidden_dim, nlayers):
        super().__init__()
        self.encoder = Stack(hidden_dim, nlayers)
        self.decoder = Stack(hidden_dim, nlayers)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.loss(self.decoder(self.encoder(x)), y)


class TestLayerGradNormsStacks(DistributedTest):
    world_size = 2

    def test(self):
        model = EncoderDecoder(HIDDEN_DIM, 2)
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=get_config(2, torch.float32, 0.0, {"enabled": True}))
        batch = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
        engine.backward(engine(batch[0], batch[1]))
        expected = {}
        for name, param in engine.module.named_parameters():
            stack, _, index = name.split(".")[:3]
            expected.setdefault(f"{stack}.{index}", []).append(safe_get_full_grad(param).double().flatten())
        engine.step()
        stats = engine.get_layer_grad_norms()
        assert set(stats["pre_clip"]) == set(expected) == {"encoder.0", "encoder.1", "decoder.0", "decoder.1"}
        for key, parts in expected.items():
            assert stats["pre_clip"][key]["norm"] == pytest.approx(torch.cat(parts).norm().item(), rel=1e-5)


class TestLayerGradNormsOff(DistributedTest):
    world_size = 1

    def test_absent_block_changes_nothing(self):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2)
        config = get_config(2, torch.float32, 0.0)
        config["layer_grad_norm"] = {"enabled": True}  # an unknown key, as DeepSpeed treats any other
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert engine.layer_grad_norms is None and engine.optimizer.layer_grad_norms is None
        batch = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
        engine.backward(engine(batch[0], batch[1]))
        engine.step()
        assert engine.get_layer_grad_norms() is None

    def test_a_failing_monitor_stops_alone(self, tmpdir):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2)
        config = get_config(2, torch.float32, 0.0, BLOCK)
        config["csv_monitor"] = {"enabled": True, "output_path": str(tmpdir), "job_name": "layer_grad_norms"}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        calls = []

        def failing(self, result):
            calls.append(result["step"])
            raise OSError("disk full")

        write, MonitorEvents.write = MonitorEvents.write, failing
        try:
            for batch in random_dataloader(engine, 4, HIDDEN_DIM, engine.device, torch.float):
                engine.backward(engine(batch[0], batch[1]))
                engine.step()
        finally:
            MonitorEvents.write = write
        assert engine.get_layer_grad_norms()["step"] == 2 and calls == [1]

    def test_bad_value_names_key(self):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2)
        with pytest.raises(ValidationError, match=r"(?s)interval.*input_value=0"):
            deepspeed.initialize(model=model,
                                 model_parameters=model.parameters(),
                                 config=get_config(2, torch.float32, 0.0, {
                                     "enabled": True,
                                     "interval": 0
                                 }))
