"""Layer stacks in the layer map: one stack keeps ``int`` keys, an encoder's and a decoder's are kept apart,
their labels, the stacks that cannot be told apart, the layer selection per stack, and the keys' names."""

import pickle

import pytest
import torch

from deepspeed_patch.config import LayerGradNormsConfigError, parse_layer_spec
from deepspeed_patch.outputs.tags import LayerKey, bucket_label, layer_of_label
from deepspeed_patch.statistics.layer_map import Stack, build_layer_map, build_pipeline_layer_map, stack_labels


def layer_map_of(names, frozen=(), **options):
    """The layer map of parameters named ``names`` (those in ``frozen`` not trainable)."""
    params = {name: object() for name in names}
    return build_layer_map([(name, params[name]) for name in names if name not in frozen], names, **options)


BART = [
    "model.shared.weight",
    *(f"model.encoder.layers.{i}.{part}" for i in range(2) for part in ("fc1.weight", "fc1.bias")),
    "model.encoder.layernorm_embedding.weight",
    *(f"model.decoder.layers.{i}.{part}" for i in range(4) for part in ("fc1.weight", "encoder_attn.k_proj.weight")),
    "model.decoder.layernorm_embedding.weight",
]
T5 = [
    "shared.weight",
    *(f"encoder.block.{i}.layer.{m}.w" for i in range(3) for m in range(2)),
    "encoder.final_layer_norm.weight",
    *(f"decoder.block.{i}.layer.{m}.w" for i in range(2) for m in range(3)),
    "decoder.final_layer_norm.weight",
]


@pytest.mark.parametrize("names,keys,prefix", [
    (["transformer.wte.weight", "transformer.h.0.attn.w", "transformer.h.1.attn.w", "transformer.ln_f.weight"],
     (0, 1, "transformer.wte", "transformer.ln_f"), "transformer.h."),
    (["language_model.embedding.word_embeddings.weight", "language_model.encoder.layers.1.mlp.w",
      "language_model.encoder.layers.0.mlp.w", "language_model.encoder.final_layernorm.weight"],
     (0, 1, "language_model.embedding.word_embeddings", "language_model.encoder.final_layernorm"),
     "language_model.encoder.layers."),
])
def test_one_stack_keeps_int_keys(names, keys, prefix):
    layer_map = layer_map_of(names)
    assert layer_map.keys == keys
    assert [type(key) for key in layer_map.keys[:2]] == [int, int]
    assert layer_map.stacks == (Stack(prefix, "", 2), )


def test_encoder_and_decoder_layers_are_kept_apart():
    layer_map = layer_map_of(BART, frozen=("model.decoder.layers.3.fc1.weight",
                                           "model.decoder.layers.3.encoder_attn.k_proj.weight"))
    layers = ["encoder.0", "encoder.1", "decoder.0", "decoder.1", "decoder.2"]
    assert layer_map.keys == (*layers, "model.shared", "model.encoder.layernorm_embedding",
                              "model.decoder.layernorm_embedding")
    assert all(isinstance(key, LayerKey) for key in layer_map.keys[:5])
    assert layer_map.stack_of == (0, 0, 1, 1, 1, None, None, None)
    assert layer_map.layer_of == (0, 1, 0, 1, 2, None, None, None)
    # the decoder's frozen layer 3 counts in its number of layers
    assert layer_map.stacks == (Stack("model.encoder.layers.", "encoder", 2),
                                Stack("model.decoder.layers.", "decoder", 4))


def test_t5_layers_are_its_blocks_not_their_parts():
    params = [(name, object()) for name in T5]
    layer_map = build_layer_map(params, T5)
    assert layer_map.keys[:5] == ("encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1")
    buckets = {name: layer_map.keys[layer_map.bucket_of(param)] for name, param in params}
    assert buckets["encoder.block.1.layer.1.w"] == "encoder.1"
    assert buckets["decoder.block.0.layer.2.w"] == "decoder.0"
    assert buckets["shared.weight"] == "shared"


@pytest.mark.parametrize("prefixes,labels", [
    (["model.encoder.layers.", "model.decoder.layers."], ["encoder", "decoder"]),
    (["encoder.block.", "decoder.block."], ["encoder", "decoder"]),
    (["text_model.encoder.layers.", "vision_model.encoder.layers."], ["text_model", "vision_model"]),
    (["a.x.layers.", "a.y.layers.", "a.y.z.layers."], ["x", "y", "y.z"]),
    (["layers.", "encoder.layers."], ["layers", "encoder.layers"]),  # stripping stops short of an empty label
    (["transformer.h."], [""]),
])
def test_stack_labels(prefixes, labels):
    assert stack_labels(prefixes) == labels


@pytest.mark.parametrize("names,pattern,prefixes", [
    (["0.weight", "encoder.layers.0.weight"], r"(?:^|\.layers\.)(\d+)\.", "'' and under 'encoder.layers.'"),
    (["enc.layers.3.w", "enc.layers3.w"], r"enc\.layers\.?(\d+)", "'enc.layers.' and under 'enc.layers'"),
])
def test_stacks_that_cannot_be_told_apart_are_refused_naming_both(names, pattern, prefixes):
    with pytest.raises(LayerGradNormsConfigError, match=r"layer_pattern=.*cannot be told apart") as error:
        layer_map_of(names, layer_pattern=pattern)
    assert prefixes in str(error.value)


def test_a_module_named_like_a_layer_is_refused():
    """``encoder.0.weight`` is outside the layers, yet its bucket would be the key of the encoder's layer 0."""
    with pytest.raises(LayerGradNormsConfigError, match=r"the module 'encoder.0' outside the transformer layers"):
        layer_map_of(["encoder.layers.0.w", "decoder.layers.0.w", "encoder.0.weight"])


def test_layer_selection_applies_to_each_stack():
    layer_map = layer_map_of([f"encoder.layers.{i}.w" for i in range(4)] + [f"decoder.layers.{i}.w" for i in range(6)]
                             + ["embed.weight"])
    assert layer_map.select(parse_layer_spec("0,1,mid,-2,-1")) == (
        "encoder.0", "encoder.1", "encoder.2", "encoder.3", "decoder.0", "decoder.1", "decoder.3", "decoder.4",
        "decoder.5", "embed")
    assert layer_map.select(parse_layer_spec("-1")) == ("encoder.3", "decoder.5", "embed")
    with pytest.raises(LayerGradNormsConfigError, match=r"layers=\[0, 5\]: layer 5 is out of range for the stack "
                       r"'encoder' \(encoder.layers.N\) of 4 transformer layers"):
        layer_map.select(parse_layer_spec("0,5"))


def test_finer_granularities_keep_their_keys_and_select_per_stack():
    names = [f"{stack}.layers.{i}.{part}" for stack in ("encoder", "decoder") for i in range(3) for part in "ab"]
    by_param = layer_map_of(names + ["head.weight"], granularity="param")
    assert by_param.keys == (*names, "head.weight")
    assert by_param.select(parse_layer_spec("-1")) == ("encoder.layers.2.a", "encoder.layers.2.b",
                                                       "decoder.layers.2.a", "decoder.layers.2.b", "head.weight")
    grouped = layer_map_of(names, granularity="group_by", group_by=r"^(\w+)\.layers\.(\d+)\.a")
    assert grouped.keys == ("encoder.0", "encoder.1", "encoder.2", "decoder.0", "decoder.1", "decoder.2")
    assert not any(isinstance(key, LayerKey) for key in grouped.keys)
    assert grouped.select(parse_layer_spec("0")) == ("encoder.0", "decoder.0")


def test_pipeline_layer_map_is_one_stack():
    from deepspeed.runtime.pipe.module import LayerSpec

    specs = [LayerSpec(torch.nn.Linear, 2, 2) for _ in range(3)] + [LayerSpec(torch.nn.LayerNorm, 2)]
    names = [f"{index}.{part}" for index in range(4) for part in ("weight", "bias")]
    layer_map = build_pipeline_layer_map(specs, [(name, object()) for name in names])
    assert layer_map.keys == (0, 1, 2, "LayerNorm")
    assert layer_map.stacks == (Stack("", "", 3), )
    assert layer_map.select(parse_layer_spec("mid,-1")) == (1, 2, "LayerNorm")


@pytest.mark.parametrize("key,label,layer", [
    (3, "layer03", 3),
    (LayerKey("encoder", 3), "encoder.layer03", LayerKey("encoder", 3)),
    (LayerKey("text_model", 12), "text_model.layer12", LayerKey("text_model", 12)),
    ("embed", "embed", None),
    ("head.0", "head.0", None),  # a module, not a layer
])
def test_layer_keys_are_named_and_read_back(key, label, layer):
    assert bucket_label(key) == label
    read = layer_of_label(label)
    assert (read, type(read)) == (layer, type(layer))


def test_a_layer_key_is_its_string_and_survives_pickling():
    key = LayerKey("decoder", 2)
    assert key == "decoder.2" and hash(key) == hash("decoder.2") and {"decoder.2": 1}[key] == 1
    copy = pickle.loads(pickle.dumps(key))
    assert (type(copy), copy, copy.stack, copy.index) == (LayerKey, "decoder.2", "decoder", 2)


def test_moe_experts_and_router_get_buckets_inside_their_layer():
    """DeepSpeed marks expert parameters ``allreduce=False``; its router is ``deepspeed_moe.gate``."""
    names = ["embed.weight", "layers.1.moe.deepspeed_moe.gate.wg.weight",
             "layers.1.moe.deepspeed_moe.experts.deepspeed_experts.0.weight", "layers.1.attn.weight",
             "layers.0.mlp.weight", "head.weight"]
    params = {name: torch.nn.Parameter(torch.zeros(1)) for name in names}
    params[names[2]].allreduce = False
    layer_map = build_layer_map(list(params.items()), names)
    assert layer_map.keys == (0, 1, "1.gate", "1.experts", "embed", "head")
    assert [layer_map.keys[layer_map.bucket_of(params[name])] for name in names[1:4]] == ["1.gate", "1.experts", 1]
    assert layer_map.layer_of == (0, 1, 1, 1, None, None)
    assert layer_map.select([1]) == (1, "1.gate", "1.experts", "embed", "head")
