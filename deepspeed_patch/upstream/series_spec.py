"""Which pull request of the upstream series brings what: its package modules, its call sites, its own files
(``series_tree/NN/``), and the cuts that take what it brings out of the modules of earlier pull requests.

PR 01 (the seed) is written by hand for DeepSpeed and committed as its patch; the others are generated from the
package. A cut belongs to the pull request that brings the code it names; the trees before that pull request lack it.
When a package module changes so that a cut no longer matches, ``series.py`` stops with ``StaleCut`` naming
the cut: change the cut here, not the module. A new package module must be given to a pull request here.
"""

import os
from dataclasses import dataclass
from typing import Tuple

from ..hooks import CallSite
from .source_edit import Cut

HERE = os.path.dirname(os.path.abspath(__file__))
SERIES_TREE = os.path.join(HERE, "series_tree")
HISTORY = "get_layer_grad_norms_history"
CONTROL = "set_layer_grad_norms"
REMEDY_CALLS = ("save_remedies", "load_remedies")


@dataclass(frozen=True)
class PullRequest:
    number: str
    name: str
    modules: Tuple[str, ...]
    """The package modules it adds (paths relative to the package)."""
    classes: Tuple[str, ...]
    """The DeepSpeed classes whose call sites it places (all but ``get_layer_grad_norms_history``)."""
    cuts: Tuple[Cut, ...] = ()
    history_sites: bool = False
    """It places every ``get_layer_grad_norms_history`` method."""
    control_sites: bool = False
    """It places every ``set_layer_grad_norms`` method (live control)."""
    remedy_sites: bool = False
    """It places every call of ``REMEDY_CALLS`` (the remedies' state in the optimizer's checkpoint)."""
    docs: bool = False
    """It adds the docs section (the later ones add their rows)."""
    written_by_hand: bool = False
    """Its patch is written for DeepSpeed and kept as it is in ``series/`` (PR 01, the seed), not generated: the
    next pull request's patch takes the tree it leaves to the package's modules."""

    @property
    def file_name(self) -> str:
        return f"{self.number}-{self.name}"

    def owns(self, site: CallSite) -> bool:
        if site.method == HISTORY:
            return self.history_sites
        if site.method == CONTROL:
            return self.control_sites
        if getattr(site.statement, "name", None) in REMEDY_CALLS:
            return self.remedy_sites
        return site.cls in self.classes

    def tree_files(self) -> Tuple[str, ...]:
        """Its own files (``tree:`` + path in DeepSpeed)."""
        folder = os.path.join(SERIES_TREE, self.number)
        found = []
        for root, _, names in os.walk(folder):
            found += [
                "tree:" + os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/") for name in names
                if "__pycache__" not in root
            ]
        return tuple(sorted(found))


INIT = "tree:deepspeed/runtime/layer_grad_norms/__init__.py"
DOCS = "config-json-section.md"
ZERO_TESTS = "tree:tests/unit/runtime/zero/test_layer_grad_norms.py"  # each family's PR adds its stage to them

# Package behaviour that stays in the package: none of the series' trees has it.
PACKAGE_ONLY = (
    # load_config reads every DeepSpeed config: without the block it must change nothing, not refuse keys
    # that look like a misspelling of it
    Cut("config.py",
        statements=(("load_config", r"misspelled = "), ("load_config", r"if misspelled:")),
        drop=("MISSPELLING_CUTOFF", ),
        replace=(("load_config", 'absent means disabled.\n\n    A top-level key that looks like a misspelling of the '
                  "block's name is an error: DeepSpeed ignores\n    keys it does not know, so the block would be "
                  'dropped and nothing measured, without a word.\n    """', 'absent means disabled."""'), )),
    # the block's strict types and its one-line errors naming layer_grad_norms.<key>: upstream, the block converts
    # and reports as DeepSpeed's own config models do (pydantic's ValidationError names the key and the value)
    Cut("config.py",
        drop=("StrictConfigModel", "EXPECTED_TYPES", "_describe", "_model_at", "_lookup"),
        replace=(("", "(StrictConfigModel):", "(DeepSpeedConfigModel):"),
                 ("load_config", "    try:\n        config = LayerGradNormsConfig(strict=True, **block)\n    except "
                  "ValidationError as err:\n        raise LayerGradNormsConfigError(_describe(err, block)) "
                  "from None\n", "    config = LayerGradNormsConfig(strict=True, **block)\n"))),
    # the release table: its facts are written in as constants (series.resolve_capabilities)
    Cut("adapters/base.py", drop=("Setup.capabilities", )),
    Cut("adapters/optimizer.py",
        statements=(("OptimizerAdapter.__init__", r"self\.capabilities = setup\.capabilities"), ),
        replace=(("OptimizerAdapter.unsupported", ", capabilities: Capabilities)", ")"), )),
    Cut("adapters/zero3.py", replace=(("Zero3Adapter.unsupported", ", capabilities: Capabilities)", ")"), )),
    # attach's try: an optimizer of another DeepSpeed release that keeps its layout elsewhere; upstream the adapter
    # and the optimizer are one release
    Cut("adapters/attach.py",
        replace=(("_setup", ",\n                 capabilities=capabilities.installed())", ")"), ),
        unwrap=(("attach", r"try:"), )),
    Cut("adapters/refusals.py", replace=(("check_supported", "names, capabilities.installed())", "names)"), )),
    Cut("adapters/param_grads.py",
        replace=(("", "DeepSpeed without ZeRO\nin fp32 (the engine clips them itself), plain PyTorch and "
                  "DistributedDataParallel (``plain.py``).", "DeepSpeed without ZeRO\nin fp32 (the engine clips "
                  "them itself)."), )),
)

PACKAGE_ONLY += (
    Cut("statistics/clipping.py",
        replace=(("", " Where a formula differs between DeepSpeed releases the\ncaller passes the "
                  "``capabilities.Capabilities`` fact that decides it.", ""), )),
    Cut("outputs/monitor.py", replace=(("", "named as every other writer names them (``tags``), ", ""), )),
    Cut("adapters/fused_fp16.py",
        replace=(("", "\n(``capabilities.Capabilities.fp16_skip_method``)", ""),
                 ("", "\n(``Capabilities.fp16_loss_scaled_by_optimizer``);", ";"),
                 ("", "\n(``upstream/bug_reports/stage0_unscaled_loss.md``)", ""))),
    Cut("adapters/zero.py",
        replace=(("ZeroAdapter.__init__", ", setup.capabilities)", ")"), ("ZeroAdapter.spans_to_scale",
                                                                         ", self.capabilities)", ")"),
                 ("_group_spans", ", capabilities: Capabilities)", ")")),
        docstrings=(("_group_spans", " ``capabilities``: whether the release records the offsets "
                     "(``zero_records_offsets``).", ""), )),
    Cut("statistics/clipping.py",
        docstrings=(("zero_unscale_divisor", "\n    (``Capabilities.zero_zeroes_invalid_norm``). Mirrors",
                     ".\n    Mirrors"), )),
)

# what the package's texts cite of the package itself (its bug reports, commands and docs pages)
PACKAGE_ONLY += (
    Cut("statistics/reduction.py", docstrings=(("", "\n(``upstream/bug_reports/gloo_exit_abort.md``.)", ""), )),
    Cut("outputs/jsonl_dump.py", docstrings=(("JsonlDump", "The rule for readers (``plot``, ``report``):",
                                              "The rule for readers:"), )),
    Cut("adapters/refusals.py", replace=(("check_remedies", "; docs/remedies.md says why)", ")"), )),
)

# The host kernels: DeepSpeed builds them with its op builder (series_tree/10/op_builder/layer_grad_norms.py, the
# source under csrc/: TREE_PATHS); the package with cpp_extension.load, as the releases it supports lack the builder
PACKAGE_ONLY += (Cut(
    "statistics/partition_stats_cpu.py",
    drop=("_announce_build", "SOURCE", "CFLAGS", "LDFLAGS"),
    statements=(("host_kernel", r"_announce_build\("), ),
    replace=(("_load", "from torch.utils import cpp_extension\n\n    cpp_extension.load(name=extension_name(),\n"
              "                       sources=[SOURCE],\n                       extra_cflags=CFLAGS,\n"
              "                       extra_ldflags=LDFLAGS,\n                       is_python_module=False,\n"
              "                       verbose=False)", "from deepspeed.ops.op_builder.layer_grad_norms import "
              "LayerGradNormsBuilder\n\n    LayerGradNormsBuilder().load(verbose=False)"),
             ("extension_name", 'return "layer_grad_norms_partition_stats_torch" + re.sub(r"[^0-9A-Za-z]", "_", '
              'torch.__version__)', 'return "layer_grad_norms"')),
    docstrings=(("", "(``torch.utils.cpp_extension``)", "(DeepSpeed's ``LayerGradNormsBuilder``)"),
                ("", "(``csrc/partition_stats.cpp``)", "(``csrc/layer_grad_norms/``)"),
                ("extension_name", "; it carries torch's version, whose ABI the library is built against.",
                 ": the op builder's (``cpp_extension`` versions it by source and flags).")),
), )
# where a module of the package goes in DeepSpeed, if not under deepspeed/runtime/layer_grad_norms/
TREE_PATHS = {"statistics/csrc/partition_stats.cpp": "csrc/layer_grad_norms/partition_stats.cpp"}

# end_step's call of _end, which the remedies wrap to restore global clipping
_END_STEP = ('        with self.latch.failing_locally("ending the step", self.schedule.step):  '
             "# last resort: never into training\n            self._end(measurement)")

# flat_scalars' dict of bucket scalars, which the remedies join with the step's own (skip_step's)
_FLAT_SCALARS = ("    return {\n        scalar_tag(phase, name, key): values[name]\n        for phase in phases\n"
                 "        for key, values in (logged.get(phase) or {}).items()\n"
                 "        for name in statistics if name in values")

_FAMILIES = "(ZeroAdapter, Zero3Adapter, BF16Adapter, FusedFP16Adapter, UnfusedFP16Adapter)"

# PR 04: buckets other than the layer: one per parameter (granularity "param"), or per match of group_by
_KEYS_BY_LAYER = ("        in_layers = [key for key in keys if None not in key_layers[key]]\n"
                  "        layers = sorted(in_layers, key=lambda key: (next(iter(key_layers[key])), "
                  "not is_layer(key)))\n"
                  "        keys = layers + [key for key in keys if None in key_layers[key]]\n")
_GRANULARITY_CUTS = (
    Cut("config.py",
        drop=("GRANULARITIES", "LayerGradNormsConfig.granularity", "LayerGradNormsConfig.group_by",
              "LayerGradNormsConfig._validate_granularity", "LayerGradNormsConfig._validate_group_by",
              "LayerGradNormsConfig._group_by_goes_with_its_granularity")),
    Cut("statistics/layer_map.py",
        replace=(("build_layer_map", ',\n                    granularity: str = "layer",\n'
                  "                    group_by: Optional[str] = None) -> LayerMap:", ") -> LayerMap:"),
                 ("build_layer_map", '    if granularity == "layer":\n        _refuse_merged_buckets(key_layers, '
                  "layer_pattern)\n" + _KEYS_BY_LAYER, "    _refuse_merged_buckets(key_layers, layer_pattern)\n" +
                  _KEYS_BY_LAYER.replace("\n        ", "\n    ").replace("        ", "    ", 1)),
                 ("model_layer_map", "config.layer_pattern, config.granularity, config.group_by)",
                  "config.layer_pattern)"), ("stack_labels", ', or use granularity "\n                "\'group_by\'")',
                                             '")')),
        docstrings=(("build_layer_map", "``granularity``: ``layer`` (the layer, or the module for parameters outside "
                     "the layers),\n    ``param`` (the parameter's name) or ``group_by`` (the capture groups of "
                     "``group_by``, joined by\n    ``.``; unmatched parameters go to the unreported row). ", ""),
                    ("LayerMap", ", and one more, never reported, where some parameters\n    are in no bucket "
                     "(``group_by`` matches only some). They are measured all the same, because the\n    clipping "
                     "the post-clip statistics follow is over every parameter.", ".")),
        statements=(("build_layer_map", r"grouping = "), ("build_layer_map", r'if granularity == "param"'),
                    ("build_layer_map", r'if granularity == "group_by"'), ("model_layer_map",
                                                                           r'if config\.granularity == "group_by"'))),
    Cut(DOCS, rows=("granularity", "group_by")),
    Cut(ZERO_TESTS,
        drop=("GROUP_BY", "bucket_key", "one_step", "TestLayerGradNormsGranularity"),
        replace=(("layer_stats", 'layer_stats(grads, key_of=lambda name: int(name.split(".")[1]))',
                  "layer_stats(grads)"), ("layer_stats", "Per layer (``key_of(name)``, ``None`` for none), the",
                                          "Per layer, the"),
                 ("layer_stats", "        key = key_of(name)\n        if key is not None:\n"
                  "            layers.setdefault(key, [])",
                  '        layers.setdefault(int(name.split(".")[1]), [])'))),
)

# PR 04: the extra statistics (``statistics``: l1, mean, zeros, numel), computed only where asked for
_EXTRA_STATISTICS_CUTS = (
    Cut("config.py", drop=("EXTRA_STATISTICS", "LayerGradNormsConfig.statistics",
                           "LayerGradNormsConfig._validate_statistics")),
    Cut("statistics/statistics.py",
        replace=(("bucket_results", ",\n                   extra: Collection[str] = ()", ""), ),
        statements=(("bucket_results", r"optional = "), ("bucket_results", r"result\.update\("))),
    Cut("statistics/partition_stats.py",
        replace=(("accumulate_spans", "                     extra: Collection[str] = (),\n", ""),
                 ("accumulate_partition", ",\n                         extra: Collection[str] = ()", ""),
                 ("accumulate_partition", "slices.buckets, extra)", "slices.buckets)")),
        docstrings=(("", " The extra statistics (L1, sum, zeros) are computed only when\nasked for.", ""),
                    ("accumulate_spans", "\n    ``extra`` names the statistics of ``EXTRA_STATISTICS`` to compute as "
                     "well.", "")),
        statements=(("accumulate_spans", r'if "l1" in extra'), ("accumulate_spans", r'if "mean" in extra'),
                    ("accumulate_spans", r'if "zeros" in extra'))),
    Cut("statistics/measurement.py",
        replace=(("Measurement.__init__", "                 extra: Sequence[str],\n", ""),
                 ("Measurement.observe_partition", ", self.extra)", ")"),
                 ("Measurement.observe", ", self.extra)", ")"), ("Measurement.finish", ", self.extra)", ")")),
        statements=(("Measurement.__init__", r"self\.extra = "), )),
    Cut("statistics/result.py",
        replace=(("step_result", ",\n                extra: Sequence[str])", ")"), ("step_result", ", extra)", ")"))),
    Cut("adapters/base.py",
        replace=(("LayerGradNormsAdapter.begin_step", "                                       self.extra,\n", ""), ),
        statements=(("LayerGradNormsAdapter.__init__", r"self\.extra = "), )),
    Cut(DOCS, rows=("statistics", )),
)

# PR 04: the layers of several stacks; PR 02's build_layer_map keys a layer by its index and refuses several stacks
_REFUSE_STACKS = """\
    stacks = {where[0] for where in (locate_layer(name, pattern) for name, _ in named_params) if where is not None}
    if len(stacks) > 1:
        raise UnsupportedSetupError(f"{CONFIG_KEY}: the transformer layers lie in several stacks ({sorted(stacks)}); "
                                    f"not supported yet; remove the '{CONFIG_KEY}' block or set enabled=false")
"""
_KEY_OF_STACK = ("        where = layer_of_name(name)\n        if where is None:\n            return module_of(name)\n"
                 "        layer = where[1] if len(stacks) == 1 else LayerKey(stacks[where[0]].label, where[1])\n"
                 "        return layer\n")
_KEYS_IN_ORDER = ("    keys = list(dict.fromkeys(param_key.values()))\n    keys = sorted(key for key in keys if "
                  "is_layer(key)) + [key for key in keys if not is_layer(key)]\n")
_STACKS_DOC = """

The part of a name before the layer index is the layer's stack (``model.encoder.layers.``). A model
whose trainable layers lie in one stack keys them by ``int`` index; an encoder-decoder model, whose
encoder and decoder both have a layer 3, keys them ``"encoder.3"`` and ``"decoder.3"`` (``LayerKey``),
labelled by what tells the stacks' prefixes apart."""
_ALL_NAMES_DOC = """

    ``all_names`` are the names of all the model's
    parameters, frozen ones included; they fix the number of layers that ``-1`` and ``"mid"`` count from.
    """
_BUCKET_LABEL_BODY = """    if not is_layer(key):
        return str(key)
    stack, index = layer_position(key)
    return f"layer{index:02d}" if stack is None else f"{stack}.layer{index:02d}"
"""
_SELECTION_AND_STACKS_CUTS = (
    # PR 04 also brings the selection of layers to report (the "layers" key) and the layers of several stacks
    # (an encoder's and a decoder's, keyed "encoder.3"); PR 02 reports every bucket and refuses several stacks
    Cut("config.py",
        drop=("LayerToken", "LAYER_SPEC_FORMS", "parse_layer_spec", "_parse_layer_token",
              "LayerGradNormsConfig.layers", "LayerGradNormsConfig._validate_layers")),
    Cut("statistics/layer_map.py",
        drop=("LayerKey", "Stack", "LayerMap.stack_of", "LayerMap.layer_of", "LayerMap.stacks", "LayerMap.select",
              "resolve_layers", "_shared_length", "stack_labels", "find_stacks", "_refuse_merged_buckets"),
        replace=(("is_layer", "isinstance(key, (int, LayerKey))", "isinstance(key, int)"),
                 ("build_layer_map", "    stacks = find_stacks([name for name, _ in named_params], all_names, "
                  "pattern, layer_pattern)\n", _REFUSE_STACKS),
                 ("build_layer_map", _KEY_OF_STACK, "        where = locate_layer(name, pattern)\n"
                  "        return module_of(name) if where is None else where[1]\n"),
                 ("build_layer_map", "    keys = list(key_layers)\n", _KEYS_IN_ORDER),
                 ("build_layer_map", "                    stack_of=tuple(None if layer is None else layer[0] for "
                  "layer in layer_of),\n                    layer_of=tuple(None if layer is None else layer[1] for "
                  "layer in layer_of),\n", ""),
                 ("build_layer_map", "def key_of(name: str, param) -> Optional[BucketKey]:",
                  "def key_of(name: str) -> BucketKey:"),
                 ("build_layer_map", "key_of(name, param) for name, param", "key_of(name) for name, param"),
                 ("build_layer_map", "                    stacks=stacks,\n", ""),
                 ("build_layer_map", "num_rows=len(keys) + (None in param_key.values()))", "num_rows=len(keys))"),
                 ("build_layer_map", "                    all_names: Iterable[str],\n", ""),
                 ("model_layer_map", "trainable: Sequence[Tuple[str, object]],\n                    all_names: "
                  "Iterable[str]) -> LayerMap:", "trainable: List[Tuple[str, object]]) -> LayerMap:"),
                 ("model_layer_map", "build_layer_map(trainable, all_names, config.layer_pattern)",
                  "build_layer_map(trainable, config.layer_pattern)"),
                 ("model_layer_map", "    if not layer_map.stacks:\n",
                  "    if not any(is_layer(key) for key in layer_map.keys):\n")),
        statements=(("model_layer_map", r"if len\(layer_map\.stacks\) > 1:"),
                    ("build_layer_map", r"stack_position = |def layer_of_name|key_layers: Dict"),
                    ("build_layer_map", r"_refuse_merged_buckets\("),
                    ("build_layer_map", r"^    for name, param in named_params:|in_layers = |layers = sorted\("),
                    ("build_layer_map", r"keys = layers \+|position\[None\] = |layer_of = \[")),
        docstrings=(("", ", and layer selections to bucket keys", ""),
                    ("", _STACKS_DOC, ""),
                    ("is_layer", " (``3`` or ``\"encoder.3\"``)", " (``3``)"),
                    ("LayerMap", ", and which transformer layer each bucket is in", ""),
                    ("LayerMap", ", or the\n    unreported row", ""),
                    ("build_layer_map", _ALL_NAMES_DOC, ""))),
    Cut("adapters/attach.py",
        replace=(("_setup", " for param in params], names.values())", " for param in params])"), )),
    Cut("statistics/steps.py",
        replace=(("StepSchedule.__init__", "layer_map.select(config.layers)", "layer_map.keys"), )),
    Cut("outputs/monitor.py",
        drop=("LayerId", "layer_position"),
        replace=(("bucket_label", _BUCKET_LABEL_BODY,
                  '    return f"layer{key:02d}" if is_layer(key) else str(key)\n'), ),
        docstrings=(("bucket_label", ", ``encoder.layer03`` for layer 3\n    of the encoder's stack,", ","), )),
    Cut(DOCS,
        rows=("layers", ),
        replace=(("", "; the layers of several stacks (an encoder's and a decoder's) are keyed "
                  '`"encoder.3"`, `"decoder.3"`', ""), )),
    Cut(ZERO_TESTS, drop=("Stack", "EncoderDecoder", "TestLayerGradNormsSelection", "TestLayerGradNormsStacks")),
)

# PR 05: Mixture-of-Experts buckets, PipelineModule specs, tensor parallelism; PR 02 refuses them by name
_PIPELINE_BRANCH = (
    '        if config.granularity != "layer":\n'
    '            raise UnsupportedSetupError(f"{CONFIG_KEY}.granularity={config.granularity!r}: a PipelineModule '
    'is "\n'
    '                                        "measured per layer only (its stages do not know each other\'s '
    'parameters)")\n'
    "        if config.layer_pattern:\n"
    '            logger.warning("%s.layer_pattern=%r is ignored for a PipelineModule: its layers come from its '
    'specs",\n'
    "                           CONFIG_KEY, config.layer_pattern)\n"
    "        return build_pipeline_layer_map(module._layer_specs, trainable)\n")
_NOT_YET = ' yet; remove the "\n                                    f"\'{CONFIG_KEY}\' block or set enabled=false")\n'
_MUON = '        "the Muon optimizer": "muon" in type(optimizer.optimizer).__name__.lower(),\n'
_PARALLEL_CUTS = (
    Cut("statistics/layer_map.py",
        drop=("MOE_GATE", "moe_part", "build_pipeline_layer_map"),
        replace=(("build_layer_map", '        part = moe_part(name, param)\n        return layer if part is None else '
                  'f"{layer}.{part}"', "        return layer"), ("build_layer_map", "  # a layer and its MoE parts",
                                                                 ""),
                 ("model_layer_map", _PIPELINE_BRANCH,
                  '        raise UnsupportedSetupError(f"{CONFIG_KEY} does not support a PipelineModule' + _NOT_YET)),
        docstrings=(
            ("", "\n\nA ``PipelineModule`` names parameters by spec index (``5.self_attention.dense.weight``) and "
             "each\nstage holds only some of them, so its buckets come from the layer specs, the same on every "
             "stage:\nthe specs of the repeated layer class are the transformer layers, numbered in order.\n\nA "
             "layer with a DeepSpeed Mixture-of-Experts block (``deepspeed.moe.layer.MoE``) has two more buckets:\n"
             '``"3.experts"`` for its experts\' parameters and ``"3.gate"`` for its router; bucket ``3`` keeps its\n'
             "dense parts. The three partition the layer, so its total norm is the root-sum-square of theirs.", ""),
            ("model_layer_map", "from the specs of a\n    ``PipelineModule``, else from the parameter names",
             "from the parameter names (a\n    ``PipelineModule`` is refused)"),
        )),
    # with check_moe, the second check at initialize, PR 05 brings the refusals gathered into one error (Refusals)
    Cut("adapters/refusals.py",
        drop=("Refusals", "check_moe", "check_no_sequence_parallel", "whole_model_on_each_rank"),
        replace=(("check_supported", _MUON,
                  _MUON + '        "Mixture-of-Experts": bool(getattr(optimizer, "has_moe_layers", False)),\n'), ),
        docstrings=(("", ", every one\nthat applies named in one error (``Refusals``) rather than",
                     " rather\nthan"), )),
    Cut("adapters/attach.py",
        statements=(("attach", r"check_moe\b"), ("attach", r"refusals = Refusals\(\)"),
                    ("attach", r"refusals\.raise_all\(\)"), ("_setup", r"check_no_sequence_parallel\("),
                    ("_setup", r"tensor_rank = "), ("_setup", r"def bucket_of")),
        replace=(("attach", "refusals.check(check_supported, optimizer,", "check_supported(optimizer,"),
                 ("_setup", "                 bucket_of,\n", "                 layer_map.bucket_of,\n"),
                 ("_stats_group", "    covered = dist.get_world_size(group=optimizer.dp_process_group) * "
                  "engine.mpu.get_model_parallel_world_size()\n    if covered != dist.get_world_size():\n        "
                  'raise UnsupportedSetupError(f"{CONFIG_KEY}: data x model parallel ranks ({covered}) are not all "\n'
                  '                                    f"{dist.get_world_size()} ranks (sequence or expert '
                  'parallelism?); not supported")\n    return None\n',
                  '    raise UnsupportedSetupError(f"{CONFIG_KEY} does not support pipeline or tensor parallelism' +
                  _NOT_YET.replace("                                    ", "                                "))),
        docstrings=(("_stats_group", ", or all ranks\n    when pipeline or tensor parallelism splits the model "
                     "further.", " (pipeline and\n    tensor parallelism are refused)."), )),
)

# PR 08: readers of the results behind one interface (Reader), each guarded on its own (Consumer), as the JSONL dump
# joins DeepSpeed's monitors; before it, the publisher calls the monitors itself, guarded the same way
_GUARDED_MONITOR = """\
        if self.monitor is None:
            return
        try:
            self.monitor.write(result)
        except Exception:  # a diagnostic never stops training
            logger.exception("layer_grad_norms: writing to DeepSpeed's monitors failed at step %d; they are not "
                             "written again, training and the statistics go on", result["step"])
            self.monitor = None
"""
_READERS_DOC = """\
Hands each reduced result to its readers: the last result (``engine.get_layer_grad_norms()``) and DeepSpeed's
monitors; and the guarded door every reader inside training goes through.

Each reader is one class of one small interface (``Reader``), as DeepSpeed's ``monitor/`` has one class per
backend: DeepSpeed's monitors (``monitor.MonitorEvents``) here; outside
DeepSpeed, the Megatron hook's TensorBoard runs and the Hugging Face Trainer callback's logs. Each is called through
a ``Consumer``: a reader that fails (a full disk, a writer's error) logs one traceback and stops itself on its
rank; it never changes what the ranks do next: training, the statistics and the other readers go on.
"""
_MONITOR_DOC = """\
Hands each reduced result on: the last result (``engine.get_layer_grad_norms()``) and DeepSpeed's monitors.
Monitors that fail (a full disk, a writer's error) log one traceback and are not written again on that rank;
training and the statistics go on.
"""
_READERS_CUTS = (
    Cut("outputs/publish.py",
        drop=("Reader", "Consumer"),
        replace=(("", "from .process_rank import rank_of_process", "from .monitor import MonitorEvents"),
                 ("Publisher.__init__", "Optional[Reader]", "Optional[MonitorEvents]"),
                 ("Publisher.__init__", 'Consumer("DeepSpeed\'s monitors", monitor) if monitor is not None else None',
                  "monitor"),
                 ("Publisher.publish", "        for consumer in (self.monitor, ):\n            if consumer is not None"
                  ':\n                consumer(result, result["step"])\n', _GUARDED_MONITOR)),
        docstrings=(("", _READERS_DOC, _MONITOR_DOC), ("Publisher", "the readers of every result",
                                                      "DeepSpeed's monitors"))),
    Cut("outputs/monitor.py",
        replace=(("", "class MonitorEvents(Reader):", "class MonitorEvents:"), ),
        docstrings=(("MonitorEvents", " (through ``publish.Consumer``)", ""), )),
    Cut("adapters/base.py",
        replace=(("", "from ..outputs.publish import Publisher, Reader",
                  "from ..outputs.monitor import MonitorEvents\nfrom ..outputs.publish import Publisher"),
                 ("Setup", "Optional[Reader]", "Optional[MonitorEvents]"))),
    Cut("outputs/__init__.py", docstrings=(("", "; ``process_rank`` says which rank writes", ""), )),
)


# PR 03: a failure never reaches training: the failure latch, the read points' guards, a monitor that fails left alone
_LATCH_STEPS_DOC = (", and when the statistics switch off (``FailureLatch``).\n\nBoth decide collectives, so both "
                    "change only with state that is the same on every rank: the engine's step\ncount, the interval, "
                    "and a failure announced through a reduction.")
_STEPS_DOC = (".\n\nIt decides collectives, so it changes only with state that is the same on every rank: the "
              "engine's step\ncount and the interval.")
_LATCH_MEASUREMENT_DOC = ("\n\nAn error while measuring is logged and flagged in the step's table, and every "
                          "rank switches the statistics off\ntogether (``steps.FailureLatch``): no rank waits in a "
                          "collective the others skip, none keeps a result the others lack.")
_SWITCH_OFF = ("if finished and result is None:\n                self.latch.switch_off(step)\n"
               "            elif result is not None:")
_MONITOR_FAILS_DOC = ("\nMonitors that fail (a full disk, a writer's error) log one traceback and are not written "
                      "again on that rank;\ntraining and the statistics go on.")
_FAILURE_LATCH_CUTS = (
    Cut("statistics/steps.py", drop=("FailureLatch", "logger"), docstrings=(("", _LATCH_STEPS_DOC, _STEPS_DOC), )),
    Cut("statistics/measurement.py",
        drop=("Measurement.guarded", "logger"),
        replace=(("Measurement.__init__", "                 failed: bool = False,\n", ""),
                 ("Measurement._wanted", "not self.failed and ", ""),
                 ("Measurement.local_table", "not self.failed and ", "")),
        statements=(("Measurement.__init__", r"self\.failed = "), ),
        docstrings=(("", _LATCH_MEASUREMENT_DOC, ""),
                    ("Measurement.__init__", "\n        ``failed``: a failure already known on this rank, to be "
                     "announced through ``finish``.", ""),
                    ("Measurement.local_table", "this rank\n        failed to measure or left incomplete",
                     "this rank\n        left incomplete"),
                    ("Measurement.finish", "``None`` when any rank failed to measure.",
                     "``None`` when a rank left it incomplete."))),
    Cut("adapters/base.py",
        statements=(("LayerGradNormsAdapter.__init__", r"self\.latch = "),
                    ("LayerGradNormsAdapter._close", r"step = measurement\.step"),
                    ("LayerGradNormsAdapter._close", r"result = finished = None"),
                    ("LayerGradNormsAdapter._close", r"finished = True"),
                    ("LayerGradNormsAdapter._close", r"if measurement\.failed:")),
        unwrap=(("LayerGradNormsAdapter.end_step", r"with self\.latch\.failing_locally"),
                ("LayerGradNormsAdapter._close", r"with self\.latch\.failing_locally")),
        replace=(("LayerGradNormsAdapter.begin_step", " and not self.latch.broken", ""),
                 ("LayerGradNormsAdapter.begin_step", "failed=self.latch.failed_locally,\n", ""),
                 ("LayerGradNormsAdapter._close", _SWITCH_OFF, "if result is not None:")),
        docstrings=(("", " What\nleads to a collective is the same on every rank, whatever failed on one "
                     "(``steps.FailureLatch``).", ""),
                    ("LayerGradNormsAdapter.end_step", " What leads to a\n        collective here (``reporting``) "
                     "is the same on every rank, whatever failed on one.", ""))),
    Cut("adapters/optimizer.py", unwrap=(("ZeroPartitionsAdapter.update_scale", r"with measurement\.guarded"), )),
    Cut("adapters/zero.py", unwrap=(("ZeroAdapter.unscale_and_clip_grads", r"with measurement\.guarded"), )),
    Cut("outputs/publish.py",
        drop=("logger", ),
        replace=(("Publisher.publish", _GUARDED_MONITOR,
                  "        if self.monitor is not None:\n            self.monitor.write(result)\n"), ),
        docstrings=(("", _MONITOR_FAILS_DOC, ""), )),
    Cut(ZERO_TESTS, drop=("TestLayerGradNormsOff.test_a_failing_monitor_stops_alone", "TestLayerGradNormsFailure")),
)

SERIES = (
    PullRequest("01", "zero12-layer-grad-norms", (), (), written_by_hand=True),
    PullRequest(
        "02",
        "layer-grad-norms-core",
        ("config.py", "statistics/__init__.py", "outputs/__init__.py", "statistics/layer_map.py",
         "statistics/measurement.py", "statistics/result.py", "statistics/statistics.py",
         "statistics/partition_slices.py", "statistics/partition_stats.py", "statistics/reduction.py",
         "statistics/clipping.py", "statistics/steps.py", "outputs/publish.py", "outputs/monitor.py",
         "adapters/__init__.py", "adapters/attach.py", "adapters/base.py",
         "adapters/optimizer.py", "adapters/zero.py", "adapters/refusals.py"),
        ("DeepSpeedConfig", "DeepSpeedEngine", "DeepSpeedZeroOptimizer"),
        docs=True,
    ),
    PullRequest("03", "failure-latch", (), (), cuts=_FAILURE_LATCH_CUTS),
    PullRequest("04",
                "bucket-granularity",
                (), (),
                cuts=_GRANULARITY_CUTS + _SELECTION_AND_STACKS_CUTS + _EXTRA_STATISTICS_CUTS),
    PullRequest("05", "zero12-moe-and-model-parallelism", (), (), cuts=_PARALLEL_CUTS),
    PullRequest(
        "06",
        "bf16-fp16-stage0",
        ("adapters/bf16.py", "adapters/fused_fp16.py", "adapters/unfused_fp16.py", "adapters/param_grads.py"),
        ("BF16_Optimizer", "FP16_Optimizer", "FP16_UnfusedOptimizer"),
        cuts=(
            # the families without ZeRO, and an engine without an optimizer (bf16's DummyOptim, ZeRO-3's
            # DeepSpeedZeRoOffload) warned; before PR 06 it is refused with every optimizer no adapter reads (PR 01)
            Cut("adapters/attach.py",
                statements=(("attach", r"if not _steps_an_optimizer\(engine\):"), ),
                drop=("REPLICATED_FAMILIES", "_steps_an_optimizer"),
                replace=(
                    ("", "(ZeroAdapter, BF16Adapter, FusedFP16Adapter, UnfusedFP16Adapter)", "(ZeroAdapter, )"),
                    ("", "the last two holds its complete gradient", "ZeRO-1/2's"),
                    ("attach", """    if family in REPLICATED_FAMILIES:
        process_group = _stage0_group(engine)
    else:
        process_group = _stats_group(engine, optimizer)""", "    process_group = _stats_group(engine, optimizer)"),
                    ("attach", "        return _param_grad_adapter(engine, config)",
                     "        raise UnsupportedSetupError(f\"{CONFIG_KEY} needs a ZeRO stage 1 or 2 optimizer; this "
                     "engine uses {type(optimizer).__name__}\")"),
                )),
            Cut("adapters/refusals.py", drop=("check_param_grads", )),
            Cut("statistics/clipping.py", drop=("bf16_clip_divisor", "engine_fp32_clip_square")),
            Cut("adapters/base.py", drop=("LayerGradNormsAdapter.applied_divisor", )),
            Cut("statistics/partition_slices.py", drop=("back_to_back_ranges", )),
            Cut(DOCS,
                replace=(("", "ZeRO stages 1 and 2, `BF16_Optimizer` and the fp16/bf16 optimizers without ZeRO.",
                          "ZeRO stages 1 and 2."), )),
            Cut("statistics/measurement.py",
                statements=(("Measurement.__init__", r"self\.clip_norm: "),
                            ("Measurement.__init__", r"self\.clip_square: "), ("Measurement.local_table",
                                                                               r"if self\.clip_square is not None:")),
                drop=("Measurement.set_clip_norm", ),
                replace=(("Measurement.scales", "                          self.clip_norm,\n", ""),
                         ("Measurement.scales", "                          clip_by_status=self.clip_square is not "
                          "None,\n", "")),
                docstrings=(("Measurement.local_table", ", whose squared\n        norm carries this rank's share of "
                             "the norm the caller clips by (``set_clip_norm``), if any, and whose\n        max",
                             ", and whose\n        max"), )),
            Cut("statistics/result.py",
                statements=(("step_result", r"if scales\.clip_norm:"), ),
                drop=("StepScales.clip_norm", "StepScales.clip_by_status")),
            Cut("statistics/clipping.py", drop=("torch_clip_divisor", )),
            Cut("statistics/reduction.py",
                drop=("REPLICATED", ),
                replace=(("reduce_stats", "process_group is REPLICATED or ", ""), )),
            Cut("adapters/base.py",
                drop=("LayerGradNormsAdapter.read_at_begin", "LayerGradNormsAdapter.read_at_end"),
                statements=(("LayerGradNormsAdapter.begin_step", r"with self\.measurement\.guarded"),
                            ("LayerGradNormsAdapter._close", r"with measurement\.guarded")),
                docstrings=(("Setup", "; ``REPLICATED`` where each holds it all", ""), )),
            Cut(ZERO_TESTS,
                replace=(("", "[0, 1, 2]", "[1, 2]"), ("check_against", ", rel=1e-5):", "):"),
                         ("check_against", "rel=rel)", "rel=1e-5)")),
                drop=("precision_config", "skip_unsupported", "loss_scales", "check_steps",
                      "TestLayerGradNormsPrecisions")),
        ),
    ),
    PullRequest(
        "07",
        "zero3",
        ("adapters/zero3.py", ),
        ("DeepSpeedZeroOptimizer_Stage3", ),
        cuts=(Cut("adapters/attach.py", replace=(("", _FAMILIES, _FAMILIES.replace(" Zero3Adapter,", "")), )),
              Cut(DOCS, replace=(("", "ZeRO stages 1, 2 and 3,", "ZeRO stages 1 and 2,"), )),
              Cut(ZERO_TESTS,
                  replace=(("", "[0, 1, 2, 3]", "[0, 1, 2]"), ),
                  drop=("TestLayerGradNormsZero3OneAndThreeRanks", ))),
    ),
    PullRequest(
        "08",
        "trigger-flight-recorder",
        ("spikes/__init__.py", "spikes/trigger.py", "spikes/recorder.py",
         "spikes/spike_rule.py", "outputs/jsonl_dump.py", "outputs/process_rank.py"),
        (),
        history_sites=True,
        cuts=(
            # the loss the training loop reports, agreed over the ranks (the trigger's loss_factor, skip_step)
            Cut("statistics/reduction.py",
                drop=("LossAgreement", "ReportedLoss", "agreed_losses", "_coded", "reported_loss"),
                docstrings=(("", "\nThe loss the training loop reports is combined here too (``LossAgreement``).",
                             ""), )),
            Cut("config.py", drop=("TriggerConfig", "DumpConfig", "LayerGradNormsConfig.trigger",
                                   "LayerGradNormsConfig.dump")),
            Cut("statistics/steps.py",
                statements=(("StepSchedule.__init__", r"self\.capture: "), ),
                replace=(("StepSchedule.next_step", "(self.enabled and self.step % self.interval == 0) or "
                          "self.capturing()", "self.enabled and self.step % self.interval == 0"),
                         ("StepSchedule.reported_keys", "self.layer_map.keys if self.capturing() else self.selected",
                          "self.selected")),
                docstrings=(("", "the trigger's capture (from the global norm), and a failure "
                             "announced through a\nreduction.", "and a failure announced through a reduction."),
                            ("FailureLatch", "next reduction, a measured step's or the recorder's at a fire, and",
                             "next reduction, and"),
                            ("FailureLatch.failing_locally", "(after a collective, or recording)",
                             "(after a collective)"),
                            ("FailureLatch.failing_locally", "next measured step or fire,", "next measured step,")),
                drop=("StepSchedule.capturing", "StepSchedule.open_capture")),
            # what a measured step's texts say of the recorder and its fires
            Cut("statistics/measurement.py",
                replace=(("Measurement.guarded", "step's \"\n                    \"or fire's), training",
                          "step's), \"\n                    \"training"), )),
            Cut("statistics/result.py", docstrings=(("host_copy", " (or of a fire)", ""), )),
            Cut("outputs/publish.py",
                statements=(("Publisher.__init__", r"self\.dump = None"), ("Publisher.__init__", r"if dump and "),
                            ("Publisher.publish", r"if capture is not None:")),
                replace=(("Publisher.__init__", "dump: Optional[DumpConfig], ",
                          ""), ("Publisher.__init__", "``dump``: the block's ``dump`` key (written by rank 0); ",
                                ""), ("Publisher.publish", ", capture: Optional[dict])",
                                      ")"), ("Publisher.publish", "; ``capture``: the fire capturing it", ""),
                         ("Publisher.publish", "(self.dump, self.monitor)", "(self.monitor, )")),
                docstrings=(("", ", the JSONL\ndump (rank 0) and DeepSpeed's monitors;",
                             " and DeepSpeed's\nmonitors;"),
                            ("", "the JSONL dump (``jsonl_dump.JsonlDump``) and ", "")),
                drop=("Publisher.publish_history", )),
            Cut("adapters/base.py",
                statements=(("LayerGradNormsAdapter.__init__", r"self\.losses = "),
                            ("LayerGradNormsAdapter.__init__", r"trigger = setup\.config\.trigger"),
                            ("LayerGradNormsAdapter.__init__", r"self\.spikes = "),
                            ("LayerGradNormsAdapter.__init__", r"self\.wants_loss = "),
                            ("LayerGradNormsAdapter._end", r"if self\.spikes is None"),
                            ("LayerGradNormsAdapter._end", r"step = |norm = |fired = |if fired is not None:"),
                            ("LayerGradNormsAdapter._close", r"if self\.spikes is not None:")),
                replace=(("LayerGradNormsAdapter.__init__", "Publisher(setup.config.dump, setup.monitor)",
                          "Publisher(setup.monitor)"),
                         ("LayerGradNormsAdapter.begin_step",
                          "if not (self.reporting or (self.recording() and not self.latch.broken)):",
                          "if not self.reporting:"),
                         ("LayerGradNormsAdapter._close",
                          "self.publisher.publish(result, self.schedule.capture if self.schedule.capturing() else "
                          "None)", "self.publisher.publish(result)")),
                docstrings=(("LayerGradNormsAdapter.__init__", "Every measured or recorded step's", "Every measured "
                             "step's"), ("LayerGradNormsAdapter.__init__", ", not only recorded.", "."),
                            ("LayerGradNormsAdapter.begin_step", " is measured or recorded.", " is measured."),
                            ("LayerGradNormsAdapter.end_step", "record it, reduce and publish a measured step, feed "
                             "the\n        trigger, and when it fires reduce the recorded steps. What leads to a "
                             "collective here (``reporting``,\n        the fire)", "reduce and publish a measured "
                             "step. What leads to a\n        collective here (``reporting``)"), ),
                drop=("LayerGradNormsAdapter.recording", "LayerGradNormsAdapter.history",
                      "LayerGradNormsAdapter.report_loss", "LayerGradNormsAdapter.global_norm")),
            Cut("adapters/optimizer.py", drop=("OptimizerAdapter.global_norm", )),
            Cut("adapters/param_grads.py",
                statements=(("ParamGradAdapter.__init__", r"self\.norm: "), ),
                docstrings=(("", " The engine keeps\nno global norm here; with a flight recorder "
                             "(``trigger.history``) every step is read, and the trigger gets\nthe global norm from "
                             "that table (the whole model on every rank), with the one host sync it needs "
                             "anyway.", ""), ),
                drop=("ParamGradAdapter.read_at_end", "ParamGradAdapter.global_norm")),
            Cut("adapters/__init__.py", drop=(HISTORY, ), replace=(("", f'"{HISTORY}", ', ""), )),
            Cut("adapters/attach.py",
                replace=(("attach", "if not (config.enabled or config.trigger is not None):",
                          "if not config.enabled:"),
                         ("attach", "return None  # a trigger can switch measuring on later: they need the adapter",
                          "return None")),
                statements=(("_param_grad_adapter", r"check_param_grad_trigger\("), )),
            Cut("adapters/refusals.py",
                statements=(("check_param_grads", r"if config\.trigger is not None"), ),
                docstrings=(("check_param_grads", "; and there, the trigger needs the recorder,\n    which reads "
                             "every step's norm (the engine keeps none).", "."), ),
                drop=("check_param_grad_trigger", )),
            Cut(INIT, replace=(("", f", {HISTORY}\n", "\n"), ("", f'"{HISTORY}", ', ""))),
            Cut(DOCS, rows=("trigger", "dump")),
        ) + _READERS_CUTS,
    ),
    PullRequest(
        "09",
        "optimizer-statistics",
        ("optimizer_state/__init__.py", "optimizer_state/adam_rule.py", "optimizer_state/optimizer_stats.py"),
        (),
        cuts=(
            Cut("config.py",
                drop=("OPTIMIZER_STATISTICS", "OPTIMIZER_KINDS", "LayerGradNormsConfig.optimizer_statistics",
                      "LayerGradNormsConfig._validate_optimizer_statistics")),
            Cut("outputs/monitor.py",
                replace=(("flat_scalars", "= ALL_PHASES,", "= LOGGED_PHASES,"),
                         ("flat_scalars", "(logged.get(phase)", "(result.get(phase)")),
                statements=(("flat_scalars", r"logged = logged_result"), ),
                docstrings=(("flat_scalars", " result as logs see it\n    (``logged_result``), by flat tag",
                             " result,\n    by flat tag"),
                            ("flat_scalars", ", ``layer-grad-norms/update/layer00``", ""),
                            ("flat_scalars", ", a kind not requested", ""),
                            ("flat_scalars", ", and so is a\n    statistic a phase lacks (the ``update_to_weight`` "
                             "ratio has only its norm)", "")),
                drop=("UPDATE_TO_WEIGHT", "update_to_weight", "norm_ratio", "logged_result", "ALL_PHASES")),
            Cut("adapters/base.py",
                statements=(("LayerGradNormsAdapter.__init__", r"self\.kinds = "), ("LayerGradNormsAdapter.__init__",
                                                                                    r"self\.optimizer_statistics: "),
                            ("LayerGradNormsAdapter.begin_step", r"if self\.optimizer_statistics is not None"),
                            ("LayerGradNormsAdapter._close", r"if measurement\.kinds:")),
                replace=(("LayerGradNormsAdapter.__init__", "table_rows(self.layer_map.num_rows, self.kinds)",
                          "table_rows(self.layer_map.num_rows)"),
                         ("LayerGradNormsAdapter.__init__", "self.latch,\n" + " " * 33 + "self.kinds)",
                          "self.latch)"),
                         ("LayerGradNormsAdapter.begin_step", ",\n                                       "
                          "kinds=self.kinds)", ")")),
                drop=("LayerGradNormsAdapter.read_optimizer_state", )),
            Cut("adapters/zero.py", statements=(("ZeroAdapter.__init__", r"self\.optimizer_statistics = "), )),
            Cut("adapters/zero3.py",
                statements=(("Zero3Adapter.__init__", r"self\.optimizer_statistics = "), ),
                drop=("Zero3Adapter.state_elsewhere", )),
            Cut("adapters/bf16.py", statements=(("BF16Adapter.__init__", r"self\.optimizer_statistics = "), )),
            Cut("adapters/fused_fp16.py",
                statements=(("FusedFP16Adapter.__init__", r"self\.optimizer_statistics = "), )),
            Cut("adapters/unfused_fp16.py",
                statements=(("UnfusedFP16Adapter.__init__", r"self\.optimizer_statistics = "), )),
            Cut("adapters/param_grads.py", statements=(("ParamGradAdapter.__init__", r"if optimizer is not None:"), )),
            Cut("adapters/refusals.py",
                drop=("OPTIMIZER_STATISTICS_FAMILIES", "check_optimizer_statistics", "low_precision_state")),
            Cut("adapters/attach.py", statements=(("attach", r"check_optimizer_statistics\b"), )),
            Cut(DOCS, rows=("optimizer_statistics", )),
        ),
    ),
    PullRequest(
        "10",
        "fused-statistics-kernels",
        ("statistics/kernels.py", "statistics/partition_stats_cpu.py", "statistics/partition_stats_triton.py",
         "statistics/csrc/partition_stats.cpp"),
        (),
        cuts=(
            Cut("statistics/partition_stats.py",
                docstrings=(("", "(``accumulate_spans``), or by a fused kernel where the partition's slices carry one"
                             "\n(``kernels.Chunking``), with the same results.", "(``accumulate_spans``)."),
                            ("prepare_partition", " With the fused kernels, a ``kernels.Chunking``: its chunk list "
                             "built and its kernel picked now, at\n    start-up, rather than in the first measured "
                             "step.", ""),
                            ("accumulate_partition", "\n\n    A ``kernels.Chunking`` reads them with its fused kernel "
                             "where it can; the stock operators read the rest.", "")),
                replace=(("prepare_partition", "return chunk_partition(slices_of_spans(list(spans), device), device)",
                          "return slices_of_spans(list(spans), device)"),
                         ("accumulate_partition",
                          "    if not (isinstance(slices, Chunking) and slices.accumulate_fused(stats, flat, "
                          "extra)):\n"
                          "        accumulate_spans(stats, slices.views(flat), slices.buckets, extra)\n",
                          "    accumulate_spans(stats, slices.views(flat), slices.buckets, extra)\n"))),
            Cut("optimizer_state/optimizer_stats.py",
                replace=(("OptimizerStatistics.accumulate",
                          "            if not state.accumulate_fused(kind_stats, skipped):\n"
                          "                for kind in self.kinds:\n"
                          "                    state.accumulate(kind, kind_stats[kind], self.scratch, skipped)",
                          "            for kind in self.kinds:\n"
                          "                state.accumulate(kind, kind_stats[kind], self.scratch, skipped)"), ),
                docstrings=(("", ": on the host by the C++ kernel, which reads each chunk of the weights\nand moments "
                             "once and folds all requested kinds from it (``accumulate_fused``); elsewhere piece by "
                             "piece", ": piece by piece"), ),
                drop=("PartitionState.accumulate_fused", )),
        ),
    ),
    PullRequest(
        "11",
        "remedies",
        ("remedies/__init__.py", "remedies/remedies.py", "remedies/remedy_step.py", "remedies/adaptive_clipping.py",
         "remedies/skip_step.py"),
        (),
        remedy_sites=True,
        cuts=(
            Cut("spikes/spike_rule.py",
                docstrings=(("judge_outlier", "the rule of the spike trigger and of ``skip_step``, which differ in\n"
                             "    ``bound(recent)`` alone (the limit and how to say it)", "the spike trigger's rule, "
                             "``bound(recent)``\n    its limit and how to say it"), )),
            Cut("config.py",
                drop=("AdaptiveClippingConfig", "SkipStepConfig", "LayerGradNormsConfig.adaptive_clipping",
                      "LayerGradNormsConfig.skip_step", "LayerGradNormsConfig.acts", "REMEDIES", "master_switch"),
                replace=(("load_config", "return master_switch(config)", "return config"), ),
                docstrings=(("LayerGradNormsConfig", ": the remedies are off\n    whatever their sub-blocks "
                             "say (``master_switch``).", "."), )),
            Cut("statistics/statistics.py",
                replace=(("bucket_results", ",\n                   factors: Optional[Sequence[float]] = None)", ")"),
                         ("bucket_results", "* row_multiplier", "* multiplier")),
                statements=(("bucket_results", r"row_multiplier = "), ),
                docstrings=(("bucket_results", " (and by the\n    bucket's own entry of ``factors``, the rows' "
                             "multipliers, where given)", ""), ("bucket_results", "; adaptive\n    clipping "
                                                                "multiplies each bucket by its own.", "."))),
            Cut("statistics/measurement.py",
                replace=(("Measurement.scales", ",\n                          action=self.action)", ")"),
                         ("Measurement.finish", "        if self.reduced is not None:\n            stats, scales = "
                          "self.reduced, resolve_scales([self.scales(overflow)])\n        else:\n            stats, "
                          "scales = host_copy(", "        stats, scales = host_copy(")),
                statements=(("Measurement.__init__", r"self\.action: "), ("Measurement.__init__", r"self\.reduced: ")),
                drop=("Measurement.reduce_now", )),
            Cut("statistics/result.py",
                replace=(("step_result", "if not (scales.overflow or action.skipped):", "if not scales.overflow:"),
                         ("step_result", ", extra, action.factors)", ", extra)")),
                statements=(("step_result", r"action = scales\.action"), ("step_result",
                                                                          r"result\.update\(remedy_fields")),
                drop=("StepScales.action", "remedy_fields", "ADAPTIVE_CLIP", "SKIPPED", "resolve_scales")),
            Cut("adapters/base.py",
                replace=(
                    ("LayerGradNormsAdapter.__init__", "(trigger is not None and trigger.loss_factor is not None) or "
                     "setup.config.skip_step.enabled", "trigger is not None and trigger.loss_factor is not None"),
                    ("LayerGradNormsAdapter.begin_step", "(self.schedule.next_step() or self.remedy_step is not None)",
                     "self.schedule.next_step()"),
                    ("LayerGradNormsAdapter.end_step", "        try:\n    " + _END_STEP.replace("\n", "\n    ") +
                     "\n        finally:\n            if self.remedy_step is not None:\n"
                     "                self.remedy_step.restore_clipping()\n", _END_STEP + "\n"),
                    ("LayerGradNormsAdapter._end", "self.overflow() and not skipped  # a step skip_step skipped goes "
                     "the overflow's way in DeepSpeed", "self.overflow()"),
                    ("LayerGradNormsAdapter._end", "action.global_norm if skipped else self.global_norm()  # "
                     "DeepSpeed's is inf on a skipped step", "self.global_norm()"),
                    ("LayerGradNormsAdapter.report_loss", ", before_step: bool = True)", ")"),
                ),
                docstrings=(
                    ("LayerGradNormsAdapter.__init__", ", or\n        ``skip_step`` does.", "."),
                    ("LayerGradNormsAdapter.report_loss", " and ``skip_step``", ""),
                    ("LayerGradNormsAdapter.report_loss", "\n        ``skip_step`` decides the skip of the step whose "
                     "``engine.step()`` comes after the loss (``before_step``); a\n        loss reported after its "
                     "step (``before_step=False``, as Megatron's training-log hook does) is the trigger's\n"
                     "        alone.", ""),
                    ("LayerGradNormsAdapter.report_loss", " or ``skip_step``", ""),
                ),
                statements=(("LayerGradNormsAdapter.__init__",
                             r"self\.remedy_step: "),
                            ("LayerGradNormsAdapter.begin_step", r"if self\.remedy_step is not None:"),
                            ("LayerGradNormsAdapter._end", r"if self\.remedy_step is not None:"),
                            ("LayerGradNormsAdapter.begin_step",
                             r"self\.act_at_begin\("), ("LayerGradNormsAdapter._end", r"action = measurement\.action"),
                            ("LayerGradNormsAdapter._end", r"skipped = action is not None"),
                            ("LayerGradNormsAdapter._end",
                             r"if fired is None and skipped:"), ("LayerGradNormsAdapter.report_loss",
                                                                 r"if self\.remedy_step is not None and before_step")),
                drop=("LayerGradNormsAdapter.save_remedies",
                      "LayerGradNormsAdapter.load_remedies", "LayerGradNormsAdapter.act_at_begin")),
            Cut("spikes/trigger.py", statements=(("SpikeWatch.__init__", r"self\.capture_steps = "), ),
                drop=("SpikeWatch.skip_fire", )),
            Cut("adapters/optimizer.py",
                replace=(("ZeroPartitionsAdapter.update_scale", "if has_overflow or acting:", "if has_overflow:"), ),
                docstrings=(("ZeroPartitionsAdapter.update_scale", " With a remedy on, a step the loss scaler does "
                             "not skip is read here\n        too, and reduced, for the remedies to act before the "
                             "optimizer steps (``act``).", ""), ),
                statements=(("ZeroPartitionsAdapter.update_scale",
                             r"acting = "), ("ZeroPartitionsAdapter.update_scale",
                                             r"if acting:"), ("OptimizerAdapter.__init__", r"self\.saved_clip_grad: "),
                            ("OptimizerAdapter.__init__", r"remedies = Remedies"), ("OptimizerAdapter.__init__",
                                                                                    r"if remedies is not None:")),
                drop=("OptimizerAdapter.suspend_global_clipping", "OptimizerAdapter.resume_global_clipping",
                      "OptimizerAdapter.scale_buckets", "OptimizerAdapter.clip_divisor",
                      "OptimizerAdapter.applied_multiplier", "OptimizerAdapter.spans_to_scale",
                      "OptimizerAdapter.skip_optimizer_step", "OptimizerAdapter.end_skip",
                      "ZeroPartitionsAdapter.clip_divisor", "ZeroPartitionsAdapter.skip_optimizer_step",
                      "ZeroPartitionsAdapter.end_skip", "ZeroPartitionsAdapter.skipping",
                      "ZeroPartitionsAdapter.applied_multiplier")),
            Cut("outputs/monitor.py",
                replace=(("flat_scalars", "= WRITTEN_PHASES,", "= ALL_PHASES,"),
                         ("flat_scalars", _FLAT_SCALARS.replace("\n", "\n    ").replace("{", "{\n        **{", 1) +
                          "\n        },\n        **step_scalars(result)\n    }", _FLAT_SCALARS + "\n    }")),
                docstrings=(("logged_result", " derived, and\n    the ``adaptive_clip`` factors shaped as a phase "
                             "(``{bucket: {\"norm\": factor}}``).", " derived."), ),
                statements=(("logged_result", r"factors = result\.get"), ("logged_result", r"if factors:")),
                drop=("SKIPPED_TAG", "step_scalars", "WRITTEN_PHASES")),
            Cut("adapters/zero.py",
                docstrings=(("ZeroAdapter.unscale_and_clip_grads", " (and, with adaptive clipping, multiplied by each "
                             "bucket's factor\n        first)", ""), ),
                statements=(("ZeroAdapter.unscale_and_clip_grads", r"self\.scale_buckets\("), ),
                drop=("ZeroAdapter.spans_to_scale", )),
            Cut("adapters/zero3.py",
                docstrings=(("Zero3Adapter.unscale_and_clip_grads", " (and, with adaptive clipping, multiplied by "
                             "each bucket's factor\n        first)", ""), ),
                statements=(("Zero3Adapter.unscale_and_clip_grads", r"self\.scale_buckets\("), ),
                drop=("Zero3Adapter.spans_to_scale", )),
            Cut("adapters/bf16.py",
                docstrings=(("", ": adaptive clipping scales all of it, on every rank.", "."), ),
                drop=("BF16Adapter.act_at_begin", "BF16Adapter.clip_divisor", "BF16Adapter.spans_to_scale")),
            Cut("adapters/refusals.py", drop=("BOTH_REMEDIES", "REMEDY_FAMILIES", "check_remedies")),
            Cut("adapters/attach.py",
                replace=(("attach", " or config.acts()):", "):"), ("attach", ", a remedy acts: they need the adapter",
                                                                   ": they need the adapter")),
                statements=(("attach", r"check_remedies\b"), )),
        ),
    ),
    PullRequest(
        "12",
        "live-control",
        ("spikes/control_file.py", ),
        (),
        control_sites=True,
        cuts=(
            Cut("spikes/__init__.py", docstrings=(("", ", the control file.", "."), )),
            Cut("adapters/__init__.py", drop=(CONTROL, ), replace=(("", f'"{CONTROL}", ', ""), )),
            Cut("adapters/base.py", drop=("LayerGradNormsAdapter.set_options", )),
            Cut("config.py", drop=("LayerGradNormsConfig.control_file", "LayerGradNormsConfig.control_interval")),
            Cut("statistics/steps.py",
                statements=(("StepSchedule.__init__", r"self\.control = "), ("StepSchedule.next_step", r"settings = "),
                            ("StepSchedule.next_step", r"if settings:")),
                docstrings=(("", "a runtime switch every rank makes at the same step, the control file (read by "
                             "rank 0\nand broadcast), ", ""), ),
                drop=("StepSchedule.set_options", "StepSchedule._apply_control")),
            Cut("adapters/attach.py",
                replace=(("attach", " or config.control_file is not None", ""),
                         ("attach", "a trigger or a control file can switch", "a trigger can switch"))),
            Cut(INIT, replace=(("", f", {CONTROL}\n", "\n"), ("", f'"{CONTROL}", ', ""))),
            Cut(DOCS, rows=("control_file", "control_interval")),
        ),
    ),
)


def series_tree_file(name: str) -> str:
    """Where the series' own file ``name`` (``tree:`` + its path in DeepSpeed) is kept: in the folder of the pull
    request that adds it."""
    for request in SERIES:
        if name in request.tree_files():
            return os.path.join(SERIES_TREE, request.number, name[len("tree:"):])
    raise ValueError(f"no pull request of the series adds {name}")
