"""Per-layer gradient statistics inside DeepSpeed's ZeRO-1/2 optimizer.

``import deepspeed_patch; deepspeed_patch.install()`` before ``deepspeed.initialize``, then enable
the ``layer_grad_norms`` block of the ds_config and read ``engine.get_layer_grad_norms()``.
"""

import importlib.util
import logging

from packaging.version import Version

from .config import LayerGradNormsConfig, LayerGradNormsConfigError

__all__ = ["install", "LayerGradNormsConfig", "LayerGradNormsConfigError", "SUPPORTED_RANGE", "TESTED_DEEPSPEED"]

logger = logging.getLogger(__name__)

# The hooks read DeepSpeed's private layout bookkeeping: releases in this range (from, up to but not
# including), whose call sites and attributes were checked one by one; the newest patch release of each
# minor line is tested.
SUPPORTED_RANGE = ("0.14", "0.20")
TESTED_DEEPSPEED = ("0.14.5", "0.15.4", "0.16.9", "0.17.6", "0.18.9", "0.19.8")
RANGE_TEXT = f">={SUPPORTED_RANGE[0]},<{SUPPORTED_RANGE[1]}"


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


def install() -> None:
    """Add ``get_layer_grad_norms()`` and the ``layer_grad_norms`` config block to DeepSpeed.

    Idempotent; does nothing on a DeepSpeed with the upstream patch applied. Raises ``RuntimeError`` on
    a DeepSpeed release outside ``SUPPORTED_RANGE``, or one that lacks a method or parameter a call site
    needs (naming it); warns on an untested release inside the range.
    """
    import deepspeed

    if importlib.util.find_spec("deepspeed.runtime.layer_grad_norms") is not None:
        logger.info("DeepSpeed carries layer_grad_norms already (the upstream patch): install() leaves it as it is")
        return
    from . import hooks

    check_release(deepspeed.__version__)
    hooks.check_call_sites(deepspeed.__version__)
    warn_if_untested(deepspeed.__version__)
    hooks.apply(deepspeed.__version__)
