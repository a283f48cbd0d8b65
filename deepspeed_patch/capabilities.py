# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What differs between the DeepSpeed releases this package supports: all of it, in one record.

The hooks read DeepSpeed's private bookkeeping, which changes between releases. Every such difference is
worked out here, once per release, into a ``Capabilities`` record: the adapters, the call sites
(``hooks``), the upstream patch generator and the CPU work-arounds read it and probe nothing themselves.

Facts are read from the release's own source files (the file that defines the class in question), so
that the same record comes out for the installed package, for a subclass of its optimizers defined
elsewhere, and for a DeepSpeed checkout the upstream patch is generated against without importing it.
Behaviour that no source line names is keyed on the release number.
"""

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from deepspeed.runtime.config_utils import DeepSpeedConfigModel as _DeepSpeedConfigModel
from packaging.version import Version
from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

# The releases whose call sites and attributes were checked one by one (from, up to but not including);
# the newest patch release of each minor line is tested.
SUPPORTED_RANGE = ("0.14", "0.20")
TESTED_DEEPSPEED = ("0.14.5", "0.15.4", "0.16.9", "0.17.6", "0.18.9", "0.19.8")
RANGE_TEXT = f">={SUPPORTED_RANGE[0]},<{SUPPORTED_RANGE[1]}"

_ZERO = "runtime/zero/stage_1_and_2.py"
_BF16 = "runtime/bf16_optimizer.py"
_FUSED_FP16 = "runtime/fp16/fused_optimizer.py"
_MICS = "runtime/zero/mics.py"


@dataclass(frozen=True)
class Capabilities:
    """How one DeepSpeed release behaves where the statistics depend on it."""

    release: str
    zero_records_offsets: bool
    """ZeRO-1/2 keeps ``round_robin_bit16_offsets`` (0.19.7 on): it may pad between parameters and says
    where; before, parameters lie back to back in the flat buffer, the padding at the end."""
    zero_zeroes_invalid_norm: bool
    """ZeRO-1/2's ``unscale_and_clip_grads`` clips everything away on an invalid global norm
    (``is_invalid_grad_norm``, 0.19.8); before, the ``-1`` sentinel went into the formula like any norm."""
    zero_compute_grad_norm_option: bool
    """ZeRO-1/2 takes ``zero_optimization.compute_grad_norm: false`` (0.19.8): no global norm is computed
    (``unscale_and_clip_grads`` gets ``None``, ``get_global_grad_norm()`` is ``None``), clipping must be off."""
    bf16_skips_steps: bool
    """``BF16_Optimizer`` keeps an ``overflow`` flag and skips a step on it (0.19.8); before, it never skips."""
    fp16_skip_method: bool
    """``FP16_Optimizer`` drops a skipped step's gradients in ``_skip_invalid_grad_norm`` (0.19.8); before,
    after ``_update_scale``."""
    fp16_loss_scaled_by_optimizer: bool
    """Before 0.18 the engine hands a ZeRO-less fp16 loss to the optimizer's ``backward``, which multiplies
    it by the loss scale; from 0.18 those gradients carry no loss scale."""
    zero3_mics: bool
    """ZeRO-3 has MiCS (``runtime/zero/mics.py``, ``MiCS_Optimizer``, a subclass of the stage-3 optimizer
    with its own shard groups), refused by the ZeRO-3 adapter; 0.19.8 no longer has it."""
    cpu_all_gather_needs_no_grad: bool
    """0.18's ZeRO-1/2 parameter all-gather fails on CPU with torch 2.13 unless run under ``no_grad``
    (``megatron_integration.cpu_compat``; never applied by ``install()``)."""

    def has(self, name: str) -> bool:
        """The capability ``name`` (a field of this record); the call sites gate on it by name."""
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name!r} is not a capability of {type(self).__name__}")
        return value


def of_source_tree(package_dir: str, release: str) -> Capabilities:
    """The record of the DeepSpeed package in ``package_dir`` (the ``deepspeed/`` directory of an installed
    package or a checkout), release ``release``."""

    def defines(path: str, text: str) -> bool:
        if not os.path.exists(os.path.join(package_dir, path)):
            return False
        with open(os.path.join(package_dir, path), encoding="utf-8") as handle:
            return text in handle.read()

    number = Version(Version(release).base_version)
    return Capabilities(release=release,
                        zero_records_offsets=defines(_ZERO, "round_robin_bit16_offsets"),
                        zero_zeroes_invalid_norm=defines(_ZERO, "is_invalid_grad_norm"),
                        zero_compute_grad_norm_option=defines(_ZERO, "self.compute_grad_norm"),
                        bf16_skips_steps=defines(_BF16, "self.overflow"),
                        fp16_skip_method=defines(_FUSED_FP16, "def _skip_invalid_grad_norm"),
                        fp16_loss_scaled_by_optimizer=number < Version("0.18"),
                        zero3_mics=defines(_MICS, "class MiCS_Optimizer"),
                        cpu_all_gather_needs_no_grad=Version("0.18") <= number < Version("0.19"))


def installed() -> Capabilities:
    """The record of the installed DeepSpeed, worked out once."""
    import deepspeed

    return _of_package(os.path.dirname(deepspeed.__file__), deepspeed.__version__)


@functools.lru_cache(maxsize=None)
def _of_package(package_dir: str, release: str) -> Capabilities:
    return of_source_tree(package_dir, release)


def check_release(version: str) -> None:
    """Refuse a DeepSpeed release outside ``SUPPORTED_RANGE``."""
    if not Version(SUPPORTED_RANGE[0]) <= Version(Version(version).base_version) < Version(SUPPORTED_RANGE[1]):
        raise RuntimeError(f"layer-grad-norms supports DeepSpeed {RANGE_TEXT} (tested: "
                           f"{', '.join(TESTED_DEEPSPEED)}); found {version}. Install a release in that range, "
                           f"e.g. pip install deepspeed=={TESTED_DEEPSPEED[-1]}")


def warn_if_untested(version: str) -> None:
    """Warn, naming the last tested release of its line, about a release inside the range never tested."""
    release = Version(version)
    if release.base_version in TESTED_DEEPSPEED:
        return
    same_line = [tested for tested in TESTED_DEEPSPEED if Version(tested).release[:2] == release.release[:2]]
    logger.warning(
        "layer-grad-norms was not tested on DeepSpeed %s; the last tested release of its line is %s. Every "
        "call site it needs is present, so it goes on; check its numbers against get_global_grad_norm() "
        "before relying on them", version, same_line[-1] if same_line else TESTED_DEEPSPEED[-1])


if hasattr(_DeepSpeedConfigModel, "model_fields"):
    DeepSpeedConfigModel = _DeepSpeedConfigModel
else:  # DeepSpeed before 0.15 builds its config models on pydantic v1: the same settings, on pydantic v2

    class DeepSpeedConfigModel(BaseModel):
        """The base of DeepSpeed's config models, for releases whose own is a pydantic v1 model."""

        model_config = ConfigDict(validate_default=True, validate_assignment=True, extra="forbid")

        def __init__(self, strict: bool = False, **data: Any) -> None:
            super().__init__(**data)
