"""The plain-PyTorch API: one process, and DistributedDataParallel on 2 CPU ranks."""

import math

import pytest
import torch

from deepspeed_patch import LayerGradNormsConfigError
from deepspeed_patch.plain import LayerGradNorms
from megatron_integration.cpu_launch import launch
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch
from plain_workers import ddp_measure
from reference import TOLERANCE, assert_close_stats, bucket_stats, reference_key_of


def backward_once(model: torch.nn.Module, seed: int = 0) -> None:
    model.zero_grad()
    model(synthetic_batch(model.config, 4, seed=seed)).backward()


def test_clip_grad_norm_reports_the_gradient_before_and_after_clipping():
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    norms = LayerGradNorms(model, statistics=["l1", "numel"])
    backward_once(model)
    before = bucket_stats({name: p.grad.clone() for name, p in model.named_parameters()})
    result = norms.clip_grad_norm_(0.1)
    after = bucket_stats({name: p.grad.clone() for name, p in model.named_parameters()})
    assert result["step"] == 1 and result["overflow"] is False
    assert_close_stats(result["pre_clip"], before, TOLERANCE["fp32"])
    assert_close_stats(result["post_clip"], after, TOLERANCE["fp32"])
    total = math.sqrt(sum(stats["norm"]**2 for stats in before.values()))
    assert result["clip_coef"] == pytest.approx(0.1 / (total + 1e-6), rel=1e-6)  # torch adds 1e-6
    assert result["pre_clip"][0]["numel"] == before[0]["numel"]


@pytest.mark.parametrize("options", [{"granularity": "group_by", "group_by": r"layers\.(\d+)\.(dense_4h_to_h)\."},
                                     {"granularity": "param"}], ids=["group_by", "param"])
def test_clip_factor_covers_every_parameter_whatever_the_granularity(options):
    """group_by reports some parameters only; clipping (torch's) is over all of them, and so is clip_coef."""
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    norms = LayerGradNorms(model, **options)
    backward_once(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    total = math.sqrt(sum(stats["norm"]**2 for stats in bucket_stats(grads).values()))
    result = norms.clip_grad_norm_(0.1)
    assert 0.1 / total < 0.5  # clipping is active
    assert result["clip_coef"] == pytest.approx(0.1 / (total + 1e-6), rel=1e-6)
    key_of = reference_key_of(options)
    reported = {name for name in grads if key_of(name) is not None}
    assert len(reported) == (8 if options["granularity"] == "group_by" else len(grads))  # weight, bias x 4 layers
    clipped = bucket_stats({name: p.grad for name, p in model.named_parameters() if name in reported}, key_of)
    assert set(result["post_clip"]) == set(clipped)
    assert_close_stats(result["post_clip"], clipped, TOLERANCE["fp32"])


def test_measure_follows_the_interval_and_the_selection():
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig(num_layers=6))
    norms = LayerGradNorms(model, interval=2, layers="mid")
    backward_once(model)
    assert norms.measure() is None
    backward_once(model, seed=1)
    result = norms.measure()
    assert result["step"] == 2 and result["clip_coef"] == 1.0
    assert sorted(key for key in result["pre_clip"] if isinstance(key, int)) == [3]
    assert result["post_clip"] == result["pre_clip"]


def test_bad_options_name_the_key_and_value():
    with pytest.raises(LayerGradNormsConfigError, match=r"layer_grad_norms.layers=\[0, 9\]: layer 9 is out of range"):
        LayerGradNorms(TinyGPT(TinyGPTConfig()), layers=[0, 9])
    with pytest.raises(LayerGradNormsConfigError, match=r"layer_grad_norms.trigger=\{\}: needs DeepSpeed"):
        LayerGradNorms(TinyGPT(TinyGPTConfig()), trigger={})
    with pytest.raises(LayerGradNormsConfigError, match=r"optimizer_statistics=\['update'\]: read inside DeepSpeed"):
        LayerGradNorms(TinyGPT(TinyGPTConfig()), optimizer_statistics=["update"])


def test_remedies_are_refused_each_by_name():
    """The remedies act inside DeepSpeed's optimizer step: asked for here, each is named (it was ignored before);
    switched off, they are accepted."""
    with pytest.raises(LayerGradNormsConfigError) as refused:
        LayerGradNorms(TinyGPT(TinyGPTConfig()), adaptive_clipping={"enabled": True}, skip_step={"enabled": True})
    message = str(refused.value)
    assert "layer_grad_norms.adaptive_clipping={'enabled': True}: acts inside DeepSpeed's" in message
    assert "layer_grad_norms.skip_step={'enabled': True}: skips DeepSpeed's ZeRO optimizer step" in message
    LayerGradNorms(TinyGPT(TinyGPTConfig()), adaptive_clipping={"enabled": False}, skip_step={"enabled": False})


def test_ddp_two_ranks_match_the_averaged_gradient_without_any_collective():
    first, second = launch(ddp_measure, 2, 3)
    assert repr(first["measured"]) == repr(second["measured"])
    assert first["collectives"] == second["collectives"] == 0
    assert [measured["step"] for measured in first["measured"]] == [1, 2, 3]
    assert len(first["reference"]) == 3
    for measured, reference in zip(first["measured"], first["reference"]):
        assert sorted(key for key in measured["pre_clip"] if isinstance(key, int)) == [0, 3]
        assert_close_stats(measured["pre_clip"], {k: reference[k] for k in measured["pre_clip"]}, TOLERANCE["fp32"])


@pytest.mark.extended  # a torchrun launch of its own, 10 s: CI's extended pass; tests/README.md
def test_under_torchrun_without_deepspeed_only_rank_0_writes_the_dump(tmp_path):
    import json

    import torch.multiprocessing as mp

    from megatron_integration.cpu_launch import free_port
    from plain_workers import torchrun_dump

    context = mp.get_context("spawn")
    queue, port, path = context.Queue(), free_port(), str(tmp_path / "dump.jsonl")
    procs = [context.Process(target=torchrun_dump, args=(rank, 2, port, path, 3, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    measured = dict(queue.get(timeout=300) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert measured == {0: [1, 2, 3], 1: [1, 2, 3]}
    with open(path) as dump:
        assert [json.loads(line)["step"] for line in dump] == [1, 2, 3]  # one writer, not one per rank
