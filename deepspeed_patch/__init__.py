"""Per-layer gradient statistics inside DeepSpeed's ZeRO-1/2 optimizer.

``import deepspeed_patch; deepspeed_patch.install()`` before ``deepspeed.initialize``, then enable
the ``layer_grad_norms`` block of the ds_config and read ``engine.get_layer_grad_norms()``.
"""

import importlib.util
import logging

from .capabilities import SUPPORTED_RANGE, TESTED_DEEPSPEED
from .config import LayerGradNormsConfig, LayerGradNormsConfigError

__all__ = ["install", "LayerGradNormsConfig", "LayerGradNormsConfigError", "SUPPORTED_RANGE", "TESTED_DEEPSPEED"]

logger = logging.getLogger(__name__)

UPSTREAM_MODULES = ("deepspeed.runtime.layer_grad_norms", "deepspeed.runtime.zero.layer_grad_norms")
"""Where a DeepSpeed that carries the feature itself has it: the upstream series' sub-package, and PR 01's
module (the seed). Patching such a DeepSpeed as well would measure every step twice."""


def install() -> None:
    """Add ``get_layer_grad_norms()`` and the ``layer_grad_norms`` config block to DeepSpeed.

    Idempotent; does nothing on a DeepSpeed that carries the feature itself (``UPSTREAM_MODULES``). Raises
    ``RuntimeError`` on a DeepSpeed release outside ``SUPPORTED_RANGE``, or one that lacks a method or parameter
    a call site needs (naming it); warns on an untested release inside the range.
    """
    import deepspeed

    carried = next((name for name in UPSTREAM_MODULES if importlib.util.find_spec(name) is not None), None)
    if carried is not None:
        logger.info("DeepSpeed carries layer_grad_norms already (%s): install() leaves it as it is", carried)
        return
    from . import capabilities, patching

    capabilities.check_release(deepspeed.__version__)
    release = capabilities.installed()
    patching.check_call_sites(release)
    capabilities.warn_if_untested(deepspeed.__version__)
    patching.apply(release)
