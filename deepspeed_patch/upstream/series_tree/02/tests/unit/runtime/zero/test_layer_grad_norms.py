# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import copy
import math
import re

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.layer_grad_norms.outputs.monitor import MonitorEvents
from deepspeed.runtime.layer_grad_norms.statistics.measurement import Measurement
from deepspeed.utils import safe_get_full_grad
from unit.common import DistributedTest
from unit.simple_model import SimpleModel, random_dataloader

HIDDEN_DIM = 16
NUM_LAYERS = 5  # 1360 parameters: on 2 and 3 ranks each partition boundary cuts a weight, and on 3 ranks the
# partitions are padded to 1362, so the last one ends in padding
CLIP = 0.05  # small enough that every step is clipped: post-clip differs from pre-clip
STEPS = 3
GROUP_BY = r"linears\.(\d+)\.weight"
BLOCK = {"enabled": True, "layer_pattern": r"linears\.(\d+)\."}


def get_config(zero_stage, layer_grad_norms=None):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": CLIP,
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


def layer_stats(grads, key_of=lambda name: int(name.split(".")[1])):
    """Per layer (``key_of(name)``, ``None`` for none), the norm, min and max of ``{name: grad}`` in float64."""
    layers = {}
    for name, grad in grads.items():
        key = key_of(name)
        if key is not None:
            layers.setdefault(key, []).append(grad.double().flatten())
    return {key: torch.cat(parts) for key, parts in layers.items()}


def check_against(measured, expected, multiplier=1.0, rel=1e-5):
    assert set(measured) == set(expected)
    for key, grad in expected.items():
        for name, value in (("norm", grad.norm()), ("min", grad.min()), ("max", grad.max())):
            assert measured[key][name] == pytest.approx(value.item() * multiplier, rel=rel), (key, name, measured)


def initialize(model, config):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
class TestLayerGradNorms(DistributedTest):
    world_size = [1, 2, 3]

    def test_against_full_grad_and_torch(self, zero_stage):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
        reference = copy.deepcopy(model)
        engine = initialize(model, get_config(zero_stage, BLOCK))
        reference.load_state_dict(engine.module.state_dict())  # rank 0's weights, as the engine broadcast them
        reference_optimizer = torch.optim.SGD(reference.to(engine.device).parameters(), lr=0.1)
        loader = random_dataloader(engine, STEPS * 2, HIDDEN_DIM, engine.device, torch.float)
        for step, (x, y) in enumerate(loader, start=1):
            engine.backward(engine(x, y))
            full = layer_stats({name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()})
            # Plain PyTorch: the same step on the rank's batch, gradients averaged over the ranks, clipped.
            reference_optimizer.zero_grad()
            reference(x, y).backward()
            for param in reference.parameters():
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
            torch_grads = layer_stats({name: p.grad for name, p in reference.named_parameters()})
            total = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP).item()
            reference_optimizer.step()
            engine.step()

            stats = engine.get_layer_grad_norms()
            assert stats["step"] == step and not stats["overflow"]
            check_against(stats["pre_clip"], full)
            check_against(stats["pre_clip"], torch_grads)
            assert stats["clip_coef"] == pytest.approx(min(1.0, CLIP / (total + 1e-6)), rel=1e-5)
            assert stats["clip_coef"] < 1.0
            check_against(stats["post_clip"], torch_grads, stats["clip_coef"])


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
class TestLayerGradNormsNoObserverEffect(DistributedTest):
    world_size = 2

    def test_training_unchanged(self, zero_stage):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
        blocks = (None, {"enabled": True})
        engines = [initialize(copy.deepcopy(model), get_config(zero_stage, block)) for block in blocks]
        loader = random_dataloader(engines[0], STEPS * 2, HIDDEN_DIM, engines[0].device, torch.float)
        for x, y in loader:
            losses = []
            for engine in engines:
                losses.append(engine(x, y))
                engine.backward(losses[-1])
                engine.step()
            assert torch.equal(losses[0], losses[1])
        assert engines[0].get_layer_grad_norms() is None and engines[1].get_layer_grad_norms() is not None
        for plain, measured in zip(engines[0].module.parameters(), engines[1].module.parameters()):
            assert torch.equal(plain, measured)


class TestLayerGradNormsOverflow(DistributedTest):
    world_size = 2

    def test_overflow_step(self):
        if not get_accelerator().is_fp16_supported():
            pytest.skip("fp16 is not supported by this accelerator")
        config = get_config(2, {"enabled": True})
        config["fp16"] = {"enabled": True, "initial_scale_power": 32}  # the first step overflows
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS), config)
        x, y = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.half)))
        engine.backward(engine(x, y))
        engine.step()
        stats = engine.get_layer_grad_norms()
        assert stats["overflow"] and stats["clip_coef"] is None and stats["post_clip"] is None
        assert not any(math.isfinite(values["norm"]) for values in stats["pre_clip"].values())


class TestLayerGradNormsConfig(DistributedTest):
    world_size = 1

    def test_interval(self):
        model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2)
        engine = initialize(model, get_config(2, {"enabled": True, "interval": 2}))
        for step, (x, y) in enumerate(random_dataloader(engine, 6, HIDDEN_DIM, engine.device, torch.float), 1):
            engine.backward(engine(x, y))
            engine.step()
            stats = engine.get_layer_grad_norms()
            assert (stats is None) if step == 1 else stats["step"] == 2 * (step // 2)
        assert set(stats["pre_clip"]) == {"linears.0", "linears.1"}  # outside the default layer pattern

    def test_bad_interval(self):
        with pytest.raises(ValueError, match="interval"):
            initialize(SimpleModel(hidden_dim=HIDDEN_DIM), get_config(2, {"enabled": True, "interval": 0}))


class TestLayerGradNormsOff(DistributedTest):
    world_size = 1

    def test_absent_block_changes_nothing(self):
        config = get_config(2)
        config["layer_grad_norm"] = {"enabled": True}  # an unknown key, as DeepSpeed treats any other
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2), config)
        assert engine.layer_grad_norms is None and engine.optimizer.layer_grad_norms is None
        x, y = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
        engine.backward(engine(x, y))
        engine.step()
        assert engine.get_layer_grad_norms() is None

    def test_a_failing_monitor_stops_alone(self, tmpdir):
        config = get_config(2, BLOCK)
        config["csv_monitor"] = {"enabled": True, "output_path": str(tmpdir), "job_name": "layer_grad_norms"}
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2), config)
        calls = []

        def failing(self, result):
            calls.append(result["step"])
            raise OSError("disk full")

        write, MonitorEvents.write = MonitorEvents.write, failing
        try:
            for x, y in random_dataloader(engine, 4, HIDDEN_DIM, engine.device, torch.float):
                engine.backward(engine(x, y))
                engine.step()
        finally:
            MonitorEvents.write = write
        assert engine.get_layer_grad_norms()["step"] == 2 and calls == [1]


class TestLayerGradNormsFailure(DistributedTest):
    world_size = 2

    def test_a_failure_on_one_rank_switches_every_rank_off(self):
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=2), get_config(2, BLOCK))
        observe = Measurement.observe_partition

        def failing_on_rank_0_at_step_2(self, *args):
            if dist.get_rank() == 0 and self.step == 2:
                raise RuntimeError("injected")
            observe(self, *args)

        Measurement.observe_partition = failing_on_rank_0_at_step_2
        results = []
        try:
            for x, y in random_dataloader(engine, STEPS * 2, HIDDEN_DIM, engine.device, torch.float):
                engine.backward(engine(x, y))
                engine.step()
                results.append(engine.get_layer_grad_norms())
        finally:
            Measurement.observe_partition = observe
        assert results[0]["step"] == 1 and results[1:] == [None] * (STEPS - 1)
        assert engine.global_steps == STEPS


def bucket_key(name, granularity):
    if granularity == "param":
        return name
    match = re.search(GROUP_BY, name)
    return match.group(1) if match else None


def one_step(engine):
    """One training step; the full gradient of each parameter after backward."""
    x, y = next(iter(random_dataloader(engine, 2, HIDDEN_DIM, engine.device, torch.float)))
    engine.backward(engine(x, y))
    grads = {name: safe_get_full_grad(param) for name, param in engine.module.named_parameters()}
    engine.step()
    return grads


@pytest.mark.parametrize("granularity", ["param", "group_by"])
class TestLayerGradNormsGranularity(DistributedTest):
    world_size = 2

    def test(self, granularity):
        block = {"enabled": True, "granularity": granularity}
        if granularity == "group_by":
            block["group_by"] = GROUP_BY
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS), get_config(2, block))
        expected = layer_stats(one_step(engine), lambda name: bucket_key(name, granularity))
        check_against(engine.get_layer_grad_norms()["pre_clip"], expected)
        assert len(expected) == (2 * NUM_LAYERS if granularity == "param" else NUM_LAYERS)


class TestLayerGradNormsSelection(DistributedTest):
    world_size = 2

    def test(self):
        block = {**BLOCK, "layers": [0, "mid", -1]}
        engine = initialize(SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS), get_config(2, block))
        full = layer_stats(one_step(engine))
        selected = [0, NUM_LAYERS // 2, NUM_LAYERS - 1]
        check_against(engine.get_layer_grad_norms()["pre_clip"], {key: full[key] for key in selected})


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
        engine = initialize(EncoderDecoder(HIDDEN_DIM, 2), get_config(2, {"enabled": True}))
        expected = layer_stats(one_step(engine), lambda name: ".".join(name.split(".")[0:3:2]))  # encoder.1
        assert set(expected) == {"encoder.0", "encoder.1", "decoder.0", "decoder.1"}
        check_against(engine.get_layer_grad_norms()["pre_clip"], expected)


def precision_config(zero_stage, dtype, clip):
    config = get_config(zero_stage, BLOCK)
    config["gradient_clipping"] = clip
    if dtype == torch.float16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
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


def check_steps(zero_stage, dtype, clip):
    """Every step's pre-clip statistics against the full unscaled gradient after backward, and its clip factor."""
    skip_unsupported(dtype)
    model = SimpleModel(hidden_dim=HIDDEN_DIM, nlayers=NUM_LAYERS)
    engine = initialize(model, precision_config(zero_stage, dtype, clip))
    loader = random_dataloader(model=engine, total_samples=6, hidden_dim=HIDDEN_DIM, device=engine.device, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    checked = 0
    for step, (x, y) in enumerate(loader, start=1):
        engine.backward(engine(x, y))
        divides, carries = loss_scales(engine, dtype)
        full = {name: safe_get_full_grad(p).double() / carries for name, p in engine.module.named_parameters()}
        reference = layer_stats(full)
        engine.step()
        stats = engine.get_layer_grad_norms()
        assert stats is not None and stats["step"] == step
        assert set(stats["pre_clip"]) == set(range(NUM_LAYERS))
        check_against(stats["pre_clip"], reference, rel=tolerance)
        checked += len(reference)
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
@pytest.mark.parametrize("clip", [0.0, CLIP])
class TestLayerGradNormsPrecisions(DistributedTest):
    world_size = 2

    def test(self, zero_stage, dtype, clip):
        check_steps(zero_stage, dtype, clip)


class TestLayerGradNormsZero3OneAndThreeRanks(DistributedTest):
    world_size = [1, 3]

    def test(self):
        check_steps(3, torch.float32, CLIP)
