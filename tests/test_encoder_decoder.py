"""Encoder-decoder models: Hugging Face T5 and BART under ZeRO-2 on 2 CPU ranks, against the reference.

Their encoder and decoder both have a layer 0; each must have its own bucket (``"encoder.0"``,
``"decoder.0"``), exact before and after clipping, the tied embedding counted once. One launch runs
both models; see encdec_workers.py.
"""

import math
from functools import lru_cache

import pytest

from deepspeed_patch.outputs.tags import LayerKey
from encdec_workers import CLIP, run_encoder_decoder
from megatron_integration.cpu_launch import launch
from reference import TOLERANCE, assert_clipped_like_torch, assert_close_stats

pytestmark = pytest.mark.extended  # 12 s: CI's extended pass; the suite keeps the layer map's keys (tests/README.md)
pytest.importorskip("transformers", reason="the encoder-decoder models come from Hugging Face transformers, "
                    "not installed (pip install -e '.[test]')")

STEPS = 2
MODELS = ["t5", "bart"]
LAYERS = [("encoder", 0), ("encoder", 1), ("decoder", 0), ("decoder", 1), ("decoder", 2)]
STATS = ("norm", "min", "max", "abs_min", "abs_max")


@lru_cache(maxsize=None)
def results():
    return launch(run_encoder_decoder, 2, STEPS)


def steps_of(kind: str):
    """(index, measured, reference) of every step on rank 0; each must have been measured."""
    record = results()[0][kind]
    assert len(record["measured"]) == len(record["reference"]) == STEPS
    for index, (measured, reference) in enumerate(zip(record["measured"], record["reference"])):
        assert measured is not None and measured["step"] == index + 1, measured
        yield index, measured, reference


@pytest.mark.parametrize("kind", MODELS)
def test_encoder_and_decoder_layers_have_buckets_of_their_own(kind):
    record = results()[0][kind]
    measured = record["measured"][-1]["pre_clip"]
    layers = [key for key in measured if isinstance(key, LayerKey)]
    assert layers == [f"{stack}.{index}" for stack, index in LAYERS]
    assert [(key.stack, key.index) for key in layers] == LAYERS
    assert not any(isinstance(key, int) for key in measured)


@pytest.mark.parametrize("kind", MODELS)
def test_every_bucket_matches_the_reference_before_and_after_clipping(kind):
    checked = 0
    for _, measured, reference in steps_of(kind):
        assert_clipped_like_torch(measured, reference, CLIP, TOLERANCE["fp32"], stats=STATS)
        checked += 1
    assert checked == STEPS


@pytest.mark.parametrize("kind", MODELS)
def test_post_clip_is_the_update_sgd_applied(kind):
    record = results()[0][kind]
    checked = 0
    for index, measured, _ in steps_of(kind):
        assert_close_stats(measured["post_clip"], record["applied"][index], 1e-3, stats=("norm", "min", "max"))
        checked += 1
    assert checked == STEPS


@pytest.mark.parametrize("kind", MODELS)
def test_buckets_add_up_to_the_global_norm_with_the_tied_embedding_once(kind):
    record = results()[0][kind]
    tied = [name for name in record["names"] if "embed_tokens" in name or name.startswith("lm_head")]
    assert tied == []  # the embedding, the encoder's and decoder's token embeddings and the head: one parameter
    checked = 0
    for index, measured, _ in steps_of(kind):
        combined = math.sqrt(sum(stats["norm"]**2 for stats in measured["pre_clip"].values()))
        assert combined == pytest.approx(record["global_norm"][index], rel=1e-5)
        checked += 1
    assert checked == STEPS


def test_identical_on_every_rank():
    for kind in MODELS:
        assert repr(results()[1][kind]["measured"]) == repr(results()[0][kind]["measured"])


def test_stacks_that_cannot_be_told_apart_are_refused_at_initialize():
    error = results()[0]["refusal"]
    assert error.startswith("LayerGradNormsConfigError"), error
    assert "layer_grad_norms.layer_pattern=" in error and "'' and under 'encoder.layers.'" in error
