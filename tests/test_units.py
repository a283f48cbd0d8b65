"""The pure pieces: layer specs, bucket keys, partition spans, the clip factor."""

import math
import re

import pytest

from deepspeed_patch.config import LayerGradNormsConfig, LayerGradNormsConfigError, load_config, parse_layer_spec
from deepspeed_patch.statistics.clipping import bf16_clip_divisor, zero_unscale_divisor
from deepspeed_patch.statistics.layer_map import (
    DEFAULT_LAYER_PATTERN,
    build_layer_map,
    locate_layer,
    module_of,
    resolve_layers,
)
from deepspeed_patch.statistics.partition_slices import partition_spans


@pytest.mark.parametrize("spec,expected", [
    ("all", None),
    ("ALL", None),
    (None, None),
    ("0,1,mid,-2,-1", (0, 1, "mid", -2, -1)),
    ([0, 1, "mid", -2, -1], (0, 1, "mid", -2, -1)),
    (" 3 , mid ", (3, "mid")),
])
def test_layer_spec_forms(spec, expected):
    assert parse_layer_spec(spec) == expected


@pytest.mark.parametrize("spec", ["", "0,,1", "first", [1.5], [True], 3])
def test_bad_layer_specs(spec):
    with pytest.raises(ValueError):
        parse_layer_spec(spec)


def test_default_selection_of_the_normformer_paper():
    assert resolve_layers(parse_layer_spec("0,1,mid,-2,-1"), 24) == [0, 1, 12, 22, 23]


@pytest.mark.parametrize("name,where", [
    ("layers.3.mlp.weight", ("layers.", 3)),
    ("language_model.encoder.layers.11.self_attention.query_key_value.weight", ("language_model.encoder.layers.", 11)),
    ("transformer.h.7.attn.c_attn.weight", ("transformer.h.", 7)),
    ("blocks.0.norm1.bias", ("blocks.", 0)),
    ("encoder.layer.5.output.dense.weight", ("encoder.layer.", 5)),
    ("encoder.block.1.layer.0.SelfAttention.q.weight", ("encoder.block.", 1)),  # T5: the block, not its part
    ("decoder.block.2.layer.2.DenseReluDense.wi.weight", ("decoder.block.", 2)),
    ("language_model.embedding.word_embeddings.weight", "language_model.embedding.word_embeddings"),
    ("transformer.ln_f.weight", "transformer.ln_f"),
    ("scale", "scale"),
    ("sublayers.2.weight", "sublayers.2"),  # "layers" must be a whole name component
])
def test_default_pattern(name, where):
    """A layer's stack and index; for a parameter outside the layers, the module its bucket is named after."""
    found = locate_layer(name, re.compile(DEFAULT_LAYER_PATTERN))
    assert found == where if isinstance(where, tuple) else (found is None and module_of(name) == where)


def test_layer_count_includes_frozen_layers():
    trainable = [("layers.0.w", object()), ("head.w", object())]
    layer_map = build_layer_map(trainable, ["layers.0.w", "layers.1.w", "layers.2.w", "head.w"])
    assert [stack.num_layers for stack in layer_map.stacks] == [3]
    assert layer_map.keys == (0, "head")
    assert layer_map.select(parse_layer_spec("0,-1")) == (0, "head")  # layer 2 is frozen: nothing to report


def test_spans_cut_parameters_at_partition_boundaries_and_skip_padding():
    # three parameters: [0, 10) bucket 0, [12, 20) bucket 0 after 2 padding, [20, 30) bucket 1
    ranges = [(0, 10, 0), (12, 8, 0), (20, 10, 1)]
    assert partition_spans(ranges, 0, 15) == [(0, 10, 0), (12, 3, 0)]
    assert partition_spans(ranges, 15, 15) == [(0, 5, 0), (5, 10, 1)]
    assert partition_spans(ranges, 30, 15) == []


def test_spans_merge_neighbours_of_one_bucket():
    assert partition_spans([(0, 4, 2), (4, 4, 2), (8, 4, 3)], 0, 12) == [(0, 8, 2), (8, 4, 3)]


def test_zero_unscale_divisor_mirrors_deepspeed_clipping():
    assert zero_unscale_divisor(None, 1.0, 8.0) == 8.0
    assert zero_unscale_divisor(16.0, 0.0, 8.0) == 8.0
    assert zero_unscale_divisor(8.0, 2.0, 8.0) == 8.0  # norm 1 under the clip value 2: no clipping
    assert zero_unscale_divisor(32.0, 2.0, 8.0) == pytest.approx(16.0)  # norm 4 clipped to 2
    assert zero_unscale_divisor(-1.0, 2.0, 8.0) == math.inf  # DeepSpeed's invalid-norm sentinel


def test_bf16_clip_divisor_mirrors_bf16_optimizer():
    assert bf16_clip_divisor(4.0, 0.0) == 1.0
    assert bf16_clip_divisor(1.0, 2.0) == 1.0
    assert bf16_clip_divisor(4.0, 2.0) == pytest.approx(2.0)


def test_config_defaults():
    config = LayerGradNormsConfig()
    assert (config.enabled, config.layers, config.interval, config.layer_pattern) == (False, None, 1, None)


MISSPELLED_BLOCK_NAMES = ("layer_grad_norm", "layerGradNorms", "layer-grad-norms", "LAYER_GRAD_NORMS",
                          "layergradnorms", "layers_grad_norms", "lyer_grad_norms", "layer_grad_norms_")


@pytest.mark.parametrize("key", MISSPELLED_BLOCK_NAMES)
def test_misspelled_block_name_is_an_error_naming_it_at_deepspeed_config(key):
    from deepspeed.runtime.config import DeepSpeedConfig

    import deepspeed_patch

    deepspeed_patch.install()
    expected = re.escape(f"ds_config key {key!r}: unknown; did you mean 'layer_grad_norms'?")
    with pytest.raises(LayerGradNormsConfigError, match=expected):
        DeepSpeedConfig({"train_batch_size": 4, key: {"enabled": True}})


@pytest.mark.parametrize("key", ["gradient_clipping", "layer_norms", "grad_norms", "zero_optimization", "tensorboard"])
def test_keys_not_close_to_the_block_name_pass(key):
    assert load_config({key: {}, "layer_grad_norms": {"enabled": True}}).enabled


def test_install_is_idempotent_and_checks_the_deepspeed_release(monkeypatch, caplog):
    import logging

    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    import deepspeed_patch

    deepspeed_patch.install()
    step = DeepSpeedZeroOptimizer.step
    deepspeed_patch.install()
    assert DeepSpeedZeroOptimizer.step is step  # not wrapped twice
    for outside in ("0.13.2", "0.20.0", "1.0.0"):
        monkeypatch.setattr(deepspeed, "__version__", outside)
        with pytest.raises(RuntimeError, match=rf"supports DeepSpeed >=0.14,<0.20 .*; found {outside}"):
            deepspeed_patch.install()
    monkeypatch.setattr(deepspeed, "__version__", "0.18.3")
    with caplog.at_level(logging.WARNING, logger="deepspeed_patch"):
        deepspeed_patch.install()
    assert "not tested on DeepSpeed 0.18.3; the last tested release of its line is 0.18.9" in caplog.text
    monkeypatch.delattr(DeepSpeedZeroOptimizer, "_update_scale")
    with pytest.raises(RuntimeError, match=r"cannot hook into DeepSpeed 0.18.3: no method "
                       r"deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer._update_scale"):
        deepspeed_patch.install()


def test_every_adapter_call_passes_what_its_adapter_method_takes():
    import importlib
    import inspect

    from deepspeed_patch.hooks import CALL_SITES, RETURNED, AdapterCall
    from deepspeed_patch.patching import _undecorated

    sites = [site for site in CALL_SITES if isinstance(site.statement, AdapterCall)]
    assert len(sites) >= 9
    for site in sites:
        parameters = list(inspect.signature(site.statement.method).parameters)[1:]
        assert len(parameters) == len(site.statement.arguments), (site, parameters)
        deepspeed_method = _undecorated(getattr(getattr(importlib.import_module(site.module), site.cls), site.method))
        named = set(site.statement.arguments) - {RETURNED}
        assert named <= set(inspect.signature(deepspeed_method).parameters), site
