# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameter names to layer buckets, and layer selections to bucket keys.

Built once at start-up from the names DeepSpeed's engine hands its optimizer. A parameter whose
name carries a transformer-layer index goes to the bucket of that layer; any other goes to a bucket
named after the module it belongs to (``"embed"`` for ``embed.weight``).

The part of a name before the layer index is the layer's stack (``model.encoder.layers.``). A model
whose trainable layers lie in one stack keys them by ``int`` index; an encoder-decoder model, whose
encoder and decoder both have a layer 3, keys them ``"encoder.3"`` and ``"decoder.3"`` (``LayerKey``),
labelled by what tells the stacks' prefixes apart.

A ``PipelineModule`` names parameters by spec index (``5.self_attention.dense.weight``) and each
stage holds only some of them, so its buckets come from the layer specs, the same on every stage:
the specs of the repeated layer class are the transformer layers, numbered in order.

A layer with a DeepSpeed Mixture-of-Experts block (``deepspeed.moe.layer.MoE``) has two more buckets:
``"3.experts"`` for its experts' parameters and ``"3.gate"`` for its router; bucket ``3`` keeps its
dense parts. The three partition the layer, so its total norm is the root-sum-square of theirs.
"""

import logging
import re
from collections import Counter
from dataclasses import dataclass
from itertools import chain, combinations
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from ..config import CONFIG_KEY, LayerGradNormsConfig, LayerGradNormsConfigError, LayerToken, UnsupportedSetupError
from ..outputs.tags import LayerKey, is_layer

logger = logging.getLogger(__name__)

# layers.N. / h.N. / blocks.N. / block.N. / layer.N., as a whole name component; the leftmost match
# wins, so T5's encoder.block.N.layer.M. is layer N (M numbers the parts of a layer). Megatron's
# language_model.encoder.layers.N. is covered by layers.N.
DEFAULT_LAYER_PATTERN = r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\."

BucketKey = Hashable

# The router of DeepSpeed's MoE block: ``MoE.deepspeed_moe`` (``MOELayer``) holds it as ``gate`` (``TopKGate``).
MOE_GATE = ".deepspeed_moe.gate."


def locate_layer(name: str, pattern: "re.Pattern[str]") -> Optional[Tuple[str, int]]:
    """The stack (the name before the layer index, ``model.encoder.layers.``) and the layer index of a
    parameter; ``None`` for a parameter outside the transformer layers."""
    match = pattern.search(name)
    return None if match is None else (name[:match.start(1)], int(match.group(1)))


def module_of(name: str) -> str:
    """The bucket of a parameter outside the transformer layers: the name of its module."""
    module, _, _ = name.rpartition(".")
    return module or name


def moe_part(name: str, param) -> Optional[str]:
    """The part of a Mixture-of-Experts layer a parameter is in: ``"experts"`` (DeepSpeed marks expert
    parameters ``allreduce=False``: their gradients are reduced over the expert-data-parallel group),
    ``"gate"`` (the router), or ``None`` for a dense parameter."""
    from deepspeed.moe.utils import is_moe_param

    if is_moe_param(param):
        return "experts"
    return "gate" if MOE_GATE in f".{name}" else None


@dataclass(frozen=True)
class Stack:
    """One stack of transformer layers: a decoder-only model's, or an encoder's or decoder's."""

    prefix: str
    """What its parameter names hold before the layer index: ``model.encoder.layers.``."""
    label: str
    """What tells it from the model's other stacks, ``encoder``; ``""`` for the only stack of a model."""
    num_layers: int
    """Its layers, frozen ones included: what ``-1`` and ``"mid"`` refer to."""


@dataclass(frozen=True)
class LayerMap:
    """Which bucket each parameter belongs to, and which transformer layer each bucket is in."""

    keys: Tuple[BucketKey, ...]
    """The buckets, in reporting order."""
    stack_of: Tuple[Optional[int], ...]
    """The stack (a position in ``stacks``) of each bucket; ``None`` for buckets outside the layers."""
    layer_of: Tuple[Optional[int], ...]
    """The layer of each bucket, its index in its stack; ``None`` for buckets outside the layers."""
    param_bucket: Dict[int, int]
    """``id(param)`` to its row in the statistics table: its bucket's position in ``keys``, or the
    unreported row."""
    stacks: Tuple[Stack, ...]
    """The stacks holding trainable layers, in the order of the keys."""
    num_rows: int
    """Rows of the statistics table: one per bucket, and one more, never reported, where some parameters
    are in no bucket (``group_by`` matches only some). They are measured all the same, because the
    clipping the post-clip statistics follow is over every parameter."""

    def bucket_of(self, param) -> int:
        return self.param_bucket[id(param)]

    def select(self, layers: Optional[Sequence[LayerToken]]) -> Tuple[BucketKey, ...]:
        """The bucket keys to report: those in the selected layers of every stack (all for ``None``) and
        those outside the layers."""
        if layers is None:
            return self.keys
        if not self.stacks:
            resolve_layers(layers, 0)  # raises: there is no layer to select
        chosen = {(position, index)
                  for position, stack in enumerate(self.stacks)
                  for index in resolve_layers(layers, stack.num_layers, stack)}
        return tuple(key for key, stack, layer in zip(self.keys, self.stack_of, self.layer_of)
                     if layer is None or (stack, layer) in chosen)


def resolve_layers(layers: Sequence[LayerToken], num_layers: int, stack: Optional[Stack] = None) -> List[int]:
    """Turn ``[0, 1, "mid", -2, -1]`` into layer indices for a model, or a ``stack`` of a model of
    several, of ``num_layers`` layers."""
    owner = f"the stack {stack.label!r} ({stack.prefix}N) of" if stack and stack.label else "a model with"
    resolved = []
    for token in layers:
        index = num_layers // 2 if token == "mid" else token
        if index < 0:
            index += num_layers
        if not 0 <= index < num_layers:
            raise LayerGradNormsConfigError(
                f"{CONFIG_KEY}.layers={list(layers)!r}: layer {token!r} is out of range for {owner} "
                f"{num_layers} transformer layers (valid: {-num_layers}..{num_layers - 1} and 'mid')")
        resolved.append(index)
    return resolved


def _shared_length(parts: Sequence[Sequence[str]]) -> int:
    """How many leading components all of ``parts`` have in common."""
    return next((length for length, column in enumerate(zip(*parts)) if len(set(column)) > 1), min(map(len, parts)))


def stack_labels(prefixes: Sequence[str], layer_pattern: Optional[str] = None) -> List[str]:
    """What tells each stack from the others: its prefix without the dotted components all prefixes
    share at the front and at the back (``model.encoder.layers.`` and ``model.decoder.layers.`` give
    ``encoder`` and ``decoder``), each keeping at least one (``layers.`` and ``encoder.layers.`` give
    ``layers`` and ``encoder.layers``); ``""`` for the only stack of a model.

    Raises ``LayerGradNormsConfigError``, naming both prefixes, where two stacks cannot be told apart.
    """
    if len(prefixes) < 2:
        return [""] * len(prefixes)
    parts = [prefix.rstrip(".").split(".") for prefix in prefixes]
    shortest = min(map(len, parts))
    front = min(_shared_length(parts), shortest - 1)
    back = min(_shared_length([part[::-1] for part in parts]), shortest - 1 - front)
    labels = [".".join(part[front:len(part) - back]) for part in parts]
    for first, second in combinations(range(len(prefixes)), 2):
        if labels[first] == labels[second] or not labels[first] or not labels[second]:
            raise LayerGradNormsConfigError(
                f"{CONFIG_KEY}.layer_pattern={layer_pattern!r}: the transformer layers under {prefixes[first]!r} "
                f"and under {prefixes[second]!r} cannot be told apart (labels {labels[first]!r} and "
                f"{labels[second]!r}); give a layer_pattern that matches only one of them, or use granularity "
                "'group_by'")
    return labels


def find_stacks(trainable: Sequence[str],
                all_names: Iterable[str],
                pattern: "re.Pattern[str]",
                layer_pattern: Optional[str] = None) -> Tuple[Stack, ...]:
    """The stacks the ``trainable`` parameters' layers lie in, in order of first appearance, labelled,
    each with its number of layers counted over ``all_names`` (frozen layers included)."""
    found = [where for where in (locate_layer(name, pattern) for name in trainable) if where is not None]
    prefixes = list(dict.fromkeys(prefix for prefix, _ in found))
    sizes: Dict[str, int] = {}
    for name in chain(trainable, all_names):
        where = locate_layer(name, pattern)
        if where is not None:
            sizes[where[0]] = max(sizes.get(where[0], 0), where[1] + 1)
    labels = stack_labels(prefixes, layer_pattern)
    return tuple(Stack(prefix, label, sizes[prefix]) for prefix, label in zip(prefixes, labels))


def build_layer_map(named_params: Iterable[Tuple[str, object]],
                    all_names: Iterable[str],
                    layer_pattern: Optional[str] = None,
                    granularity: str = "layer",
                    group_by: Optional[str] = None) -> LayerMap:
    """Assign every trainable (name, parameter) pair to a bucket.

    ``granularity``: ``layer`` (the layer, or the module for parameters outside the layers),
    ``param`` (the parameter's name) or ``group_by`` (the capture groups of ``group_by``, joined by
    ``.``; unmatched parameters go to the unreported row). ``all_names`` are the names of all the model's
    parameters, frozen ones included; they fix the number of layers that ``-1`` and ``"mid"`` count from.
    """
    named_params = list(named_params)
    pattern = re.compile(layer_pattern or DEFAULT_LAYER_PATTERN)
    stacks = find_stacks([name for name, _ in named_params], all_names, pattern, layer_pattern)
    stack_position = {stack.prefix: position for position, stack in enumerate(stacks)}

    def layer_of_name(name: str) -> Optional[Tuple[int, int]]:
        """(stack position, layer index) of a trainable parameter; ``None`` outside the layers."""
        where = locate_layer(name, pattern)
        return None if where is None else (stack_position[where[0]], where[1])

    grouping = re.compile(group_by) if group_by else None

    def key_of(name: str, param) -> Optional[BucketKey]:
        if granularity == "param":
            return name
        if granularity == "group_by":
            match = grouping.search(name)
            return ".".join(match.groups()) if match else None
        where = layer_of_name(name)
        if where is None:
            return module_of(name)
        layer = where[1] if len(stacks) == 1 else LayerKey(stacks[where[0]].label, where[1])
        part = moe_part(name, param)
        return layer if part is None else f"{layer}.{part}"

    param_key = {id(param): key_of(name, param) for name, param in named_params}
    key_layers: Dict[BucketKey, set] = {}
    for name, param in named_params:
        if param_key[id(param)] is not None:
            key_layers.setdefault(param_key[id(param)], set()).add(layer_of_name(name))
    keys = list(key_layers)
    if granularity == "layer":
        _refuse_merged_buckets(key_layers, layer_pattern)
        in_layers = [key for key in keys if None not in key_layers[key]]  # a layer and its MoE parts
        layers = sorted(in_layers, key=lambda key: (next(iter(key_layers[key])), not is_layer(key)))
        keys = layers + [key for key in keys if None in key_layers[key]]
    position = {key: index for index, key in enumerate(keys)}
    position[None] = len(keys)  # the unreported row
    layer_of = [next(iter(key_layers[key])) if len(key_layers[key]) == 1 else None for key in keys]
    return LayerMap(keys=tuple(keys),
                    stack_of=tuple(None if layer is None else layer[0] for layer in layer_of),
                    layer_of=tuple(None if layer is None else layer[1] for layer in layer_of),
                    param_bucket={
                        pid: position[key]
                        for pid, key in param_key.items()
                    },
                    stacks=stacks,
                    num_rows=len(keys) + (None in param_key.values()))


def _refuse_merged_buckets(key_layers: Dict[BucketKey, set], layer_pattern: Optional[str]) -> None:
    """A module outside the layers named as a layer's key (``encoder.3``) would merge into that layer's bucket."""
    for key, layers in key_layers.items():
        if None in layers and len(layers) > 1:
            raise LayerGradNormsConfigError(
                f"{CONFIG_KEY}.layer_pattern={layer_pattern!r}: the module {str(key)!r} outside the transformer "
                "layers has the name of a layer's bucket; give a layer_pattern that tells them apart")


def build_pipeline_layer_map(specs: Sequence[object], named_params: Iterable[Tuple[str, object]]) -> LayerMap:
    """Buckets of a DeepSpeed ``PipelineModule`` from its layer ``specs``; identical on every stage.

    Transformer layers are the specs of the layer class that repeats most; other specs become named
    buckets: a ``TiedLayerSpec`` by its tie key, any other by its class name.
    """
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    def spec_class(spec) -> Optional[type]:
        """The module class a spec builds; ``None`` for tied specs and plain functions."""
        if isinstance(spec, TiedLayerSpec):
            return None
        if isinstance(spec, LayerSpec):
            return spec.typename
        return type(spec) if isinstance(spec, nn.Module) else None

    classes = Counter(spec_class(spec) for spec in specs if spec_class(spec) is not None)
    repeated = [cls for cls, count in classes.most_common(1) if count > 1]
    layer_of_spec = {
        index: layer
        for layer, index in enumerate(
            index for index, spec in enumerate(specs) if repeated and spec_class(spec) is repeated[0])
    }
    named_of_spec = {}
    for index, spec in enumerate(specs):
        cls = spec_class(spec)
        if cls is not None and index not in layer_of_spec:
            named_of_spec[index] = cls.__name__ if classes[cls] == 1 else f"{cls.__name__}.{index}"
    tied_keys = [spec.key for spec in specs if isinstance(spec, TiedLayerSpec)]
    keys = tuple(range(len(layer_of_spec))) + tuple(dict.fromkeys(list(named_of_spec.values()) + tied_keys))
    position = {key: index for index, key in enumerate(keys)}

    def key_of(name: str) -> BucketKey:
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            return rest.partition(".")[0]
        return layer_of_spec.get(int(head), named_of_spec.get(int(head)))

    return LayerMap(keys=keys,
                    stack_of=tuple(0 if isinstance(key, int) else None for key in keys),
                    layer_of=tuple(key if isinstance(key, int) else None for key in keys),
                    param_bucket={
                        id(param): position[key_of(name)]
                        for name, param in named_params
                    },
                    stacks=(Stack("", "", len(layer_of_spec)), ) if layer_of_spec else (),
                    num_rows=len(keys))


def model_layer_map(module: nn.Module, config: LayerGradNormsConfig, trainable: Sequence[Tuple[str, object]],
                    all_names: Iterable[str]) -> LayerMap:
    """The buckets of a DeepSpeed engine's model as the config asks for them: from the specs of a
    ``PipelineModule``, else from the parameter names; warns when no name shows a layer index."""
    from deepspeed.runtime.pipe.module import PipelineModule

    if isinstance(module, PipelineModule):
        if config.granularity != "layer":
            raise UnsupportedSetupError(f"{CONFIG_KEY}.granularity={config.granularity!r}: a PipelineModule is "
                                        "measured per layer only (its stages do not know each other's parameters)")
        if config.layer_pattern:
            logger.warning("%s.layer_pattern=%r is ignored for a PipelineModule: its layers come from its specs",
                           CONFIG_KEY, config.layer_pattern)
        return build_pipeline_layer_map(module._layer_specs, trainable)
    layer_map = build_layer_map(trainable, all_names, config.layer_pattern, config.granularity, config.group_by)
    examples = ", ".join(name for name, _ in trainable[:5])
    if config.granularity == "group_by" and not layer_map.keys:
        raise LayerGradNormsConfigError(f"{CONFIG_KEY}.group_by={config.group_by!r} matches no trainable parameter "
                                        f"(examples: {examples})")
    if len(layer_map.stacks) > 1:
        logger.info(
            "%s: layers of %d stacks, keyed by their labels: %s", CONFIG_KEY, len(layer_map.stacks),
            ", ".join(f"{stack.label!r} ({stack.prefix}N, {stack.num_layers} layers)" for stack in layer_map.stacks))
    if not layer_map.stacks:
        logger.warning(
            "%s: no parameter name matches the layer pattern %r (examples: %s); every parameter is "
            "reported in a bucket named after its module", CONFIG_KEY, config.layer_pattern or "default", examples)
    return layer_map
