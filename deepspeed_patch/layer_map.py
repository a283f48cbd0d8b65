"""Parameter names to layer buckets, and layer selections to bucket keys.

Built once at start-up from the names DeepSpeed's engine hands its optimizer. A parameter whose
name carries a transformer-layer index goes to the bucket of that ``int`` index; any other goes to a
bucket named after the module it belongs to (``"embed"`` for ``embed.weight``).

A ``PipelineModule`` names parameters by spec index (``5.self_attention.dense.weight``) and each
stage holds only some of them, so its buckets come from the layer specs, the same on every stage:
the specs of the repeated layer class are the transformer layers, numbered in order.
"""

import re
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from torch import nn

from .config import CONFIG_KEY, LayerGradNormsConfigError, LayerToken

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
    """Which bucket each parameter belongs to.

    ``keys`` lists the buckets (layers first, in order, then named buckets in order of first
    appearance); ``index_of`` gives a bucket's position in ``keys``.
    """

    keys: Tuple[BucketKey, ...]
    index_of: Dict[BucketKey, int]
    param_bucket: Dict[int, int]
    """``id(param)`` to bucket position."""
    num_layers: int
    """Transformer layers in the model, frozen ones included: what ``-1`` and ``"mid"`` refer to."""

    def bucket_of(self, param) -> int:
        return self.param_bucket[id(param)]

    def select(self, layers: Optional[Sequence[LayerToken]]) -> Tuple[BucketKey, ...]:
        """The bucket keys to report: the selected layers (all for ``None``) and every named bucket."""
        named = tuple(key for key in self.keys if not isinstance(key, int))
        if layers is None:
            return tuple(key for key in self.keys if isinstance(key, int)) + named
        chosen = []
        for index in resolve_layers(layers, self.num_layers):
            if index in self.index_of and index not in chosen:
                chosen.append(index)
        return tuple(chosen) + named


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
                    layer_pattern: Optional[str] = None) -> LayerMap:
    """Assign every trainable (name, parameter) pair to a bucket.

    ``all_names`` are the names of all the model's parameters, frozen ones included; they fix the
    number of layers that negative indices and ``"mid"`` count from.
    """
    pattern = re.compile(layer_pattern or DEFAULT_LAYER_PATTERN)
    param_key = {id(param): bucket_key(name, pattern) for name, param in named_params}
    model_layers = [key for key in map(lambda name: bucket_key(name, pattern), all_names) if isinstance(key, int)]
    layers = sorted({key for key in param_key.values() if isinstance(key, int)})
    named = list(dict.fromkeys(key for key in param_key.values() if not isinstance(key, int)))
    keys = tuple(layers) + tuple(named)
    index_of = {key: position for position, key in enumerate(keys)}
    return LayerMap(keys=keys,
                    index_of=index_of,
                    param_bucket={pid: index_of[key]
                                  for pid, key in param_key.items()},
                    num_layers=max(model_layers) + 1 if model_layers else 0)


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
    layer_of_spec = {index: layer for layer, index in enumerate(
        index for index, spec in enumerate(specs) if repeated and spec_class(spec) is repeated[0])}
    named_of_spec = {}
    for index, spec in enumerate(specs):
        cls = spec_class(spec)
        if cls is not None and index not in layer_of_spec:
            named_of_spec[index] = cls.__name__ if classes[cls] == 1 else f"{cls.__name__}.{index}"
    tied_keys = [spec.key for spec in specs if isinstance(spec, TiedLayerSpec)]
    keys = tuple(range(len(layer_of_spec))) + tuple(dict.fromkeys(list(named_of_spec.values()) + tied_keys))
    index_of = {key: position for position, key in enumerate(keys)}

    def key_of(name: str) -> BucketKey:
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            return rest.partition(".")[0]
        return layer_of_spec.get(int(head), named_of_spec.get(int(head)))

    return LayerMap(keys=keys,
                    index_of=index_of,
                    param_bucket={id(param): index_of[key_of(name)]
                                  for name, param in named_params},
                    num_layers=len(layer_of_spec))
