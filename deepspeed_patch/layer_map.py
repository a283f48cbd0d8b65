# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Parameter names to layer buckets, and layer selections to bucket keys.

Built once at start-up from the names DeepSpeed's engine hands its optimizer. A parameter whose
name carries a transformer-layer index goes to the bucket of that ``int`` index; any other goes to a
bucket named after the module it belongs to (``"embed"`` for ``embed.weight``).

A ``PipelineModule`` names parameters by spec index (``5.self_attention.dense.weight``) and each
stage holds only some of them, so its buckets come from the layer specs, the same on every stage:
the specs of the repeated layer class are the transformer layers, numbered in order.
"""

import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from .config import CONFIG_KEY, LayerGradNormsConfig, LayerGradNormsConfigError, LayerToken, UnsupportedSetupError

logger = logging.getLogger(__name__)

# layers.N. / h.N. / blocks.N. / layer.N., as a whole name component; Megatron's
# language_model.encoder.layers.N. is covered by layers.N.
DEFAULT_LAYER_PATTERN = r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\."

BucketKey = Hashable


def bucket_key(name: str, pattern: "re.Pattern[str]") -> BucketKey:
    """The bucket of one parameter: its layer index, or the name of its module."""
    match = pattern.search(name)
    if match is not None:
        return int(match.group(1))
    module, _, _ = name.rpartition(".")
    return module or name


@dataclass(frozen=True)
class LayerMap:
    """Which bucket each parameter belongs to, and which transformer layer each bucket is in."""

    keys: Tuple[BucketKey, ...]
    """The buckets, in reporting order."""
    layer_of: Tuple[Optional[int], ...]
    """The transformer layer of each bucket; ``None`` for buckets outside the layers."""
    param_bucket: Dict[int, int]
    """``id(param)`` to its row in the statistics table: its bucket's position in ``keys``, or the
    unreported row."""
    num_layers: int
    """Transformer layers in the model, frozen ones included: what ``-1`` and ``"mid"`` refer to."""
    num_rows: int
    """Rows of the statistics table: one per bucket, and one more, never reported, where some parameters
    are in no bucket (``group_by`` matches only some). They are measured all the same, because the
    clipping the post-clip statistics follow is over every parameter."""

    def bucket_of(self, param) -> int:
        return self.param_bucket[id(param)]

    def select(self, layers: Optional[Sequence[LayerToken]]) -> Tuple[BucketKey, ...]:
        """The bucket keys to report: those in the selected layers (all for ``None``) and those outside."""
        if layers is None:
            return self.keys
        chosen = set(resolve_layers(layers, self.num_layers))
        return tuple(key for key, layer in zip(self.keys, self.layer_of) if layer is None or layer in chosen)


def resolve_layers(layers: Sequence[LayerToken], num_layers: int) -> List[int]:
    """Turn ``[0, 1, "mid", -2, -1]`` into layer indices for a model of ``num_layers`` layers."""
    resolved = []
    for token in layers:
        index = num_layers // 2 if token == "mid" else token
        if index < 0:
            index += num_layers
        if not 0 <= index < num_layers:
            raise LayerGradNormsConfigError(
                f"{CONFIG_KEY}.layers={list(layers)!r}: layer {token!r} is out of range for a model with "
                f"{num_layers} transformer layers (valid: {-num_layers}..{num_layers - 1} and 'mid')")
        resolved.append(index)
    return resolved


def build_layer_map(named_params: Iterable[Tuple[str, object]],
                    all_names: Iterable[str],
                    layer_pattern: Optional[str] = None,
                    granularity: str = "layer",
                    group_by: Optional[str] = None) -> LayerMap:
    """Assign every trainable (name, parameter) pair to a bucket.

    ``granularity``: ``layer`` (the layer index, or the module for parameters outside the layers),
    ``param`` (the parameter's name) or ``group_by`` (the capture groups of ``group_by``, joined by
    ``.``; unmatched parameters go to the unreported row). ``all_names`` are the names of all the model's
    parameters, frozen ones included; they fix the number of layers that ``-1`` and ``"mid"`` count from.
    """
    named_params = list(named_params)
    pattern = re.compile(layer_pattern or DEFAULT_LAYER_PATTERN)

    def layer_of_name(name: str) -> Optional[int]:
        key = bucket_key(name, pattern)
        return key if isinstance(key, int) else None

    grouping = re.compile(group_by) if group_by else None

    def key_of(name: str) -> Optional[BucketKey]:
        if granularity == "param":
            return name
        if granularity == "group_by":
            match = grouping.search(name)
            return ".".join(match.groups()) if match else None
        return bucket_key(name, pattern)

    param_key = {id(param): key_of(name) for name, param in named_params}
    key_layers: Dict[BucketKey, set] = {}
    for name, param in named_params:
        if param_key[id(param)] is not None:
            key_layers.setdefault(param_key[id(param)], set()).add(layer_of_name(name))
    keys = list(key_layers)
    if granularity == "layer":
        keys = sorted(key for key in keys if isinstance(key, int)) + [key for key in keys if not isinstance(key, int)]
    position = {key: index for index, key in enumerate(keys)}
    position[None] = len(keys)  # the unreported row
    model_layers = [layer for layer in map(layer_of_name, all_names) if layer is not None]
    return LayerMap(keys=tuple(keys),
                    layer_of=tuple(next(iter(key_layers[key])) if len(key_layers[key]) == 1 else None for key in keys),
                    param_bucket={
                        pid: position[key]
                        for pid, key in param_key.items()
                    },
                    num_layers=max(model_layers) + 1 if model_layers else 0,
                    num_rows=len(keys) + (None in param_key.values()))


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
                    layer_of=tuple(key if isinstance(key, int) else None for key in keys),
                    param_bucket={
                        id(param): position[key_of(name)]
                        for name, param in named_params
                    },
                    num_layers=len(layer_of_spec),
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
    if layer_map.num_layers == 0:
        logger.warning(
            "%s: no parameter name matches the layer pattern %r (examples: %s); every parameter is "
            "reported in a bucket named after its module", CONFIG_KEY, config.layer_pattern or "default", examples)
    return layer_map
