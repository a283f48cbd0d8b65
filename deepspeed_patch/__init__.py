"""Per-layer gradient statistics inside DeepSpeed's ZeRO-1/2 optimizer.

``import deepspeed_patch; deepspeed_patch.install()`` before ``deepspeed.initialize``, then enable
the ``layer_grad_norms`` block of the ds_config and read ``engine.get_layer_grad_norms()``.
"""

import importlib.util
import logging

from .config import LayerGradNormsConfig, LayerGradNormsConfigError

__all__ = ["install", "LayerGradNormsConfig", "LayerGradNormsConfigError", "SUPPORTED_DEEPSPEED"]

# The hooks read ZeRO's private layout bookkeeping, so only the release they are tested on is allowed.
SUPPORTED_DEEPSPEED = ("0.19.8", )


def install() -> None:
    """Add ``get_layer_grad_norms()`` and the ``layer_grad_norms`` config block to DeepSpeed.

    Idempotent; does nothing on a DeepSpeed with the upstream patch applied. Raises ``RuntimeError`` on
    a DeepSpeed release outside ``SUPPORTED_DEEPSPEED``.
    """
    import deepspeed

    if deepspeed.__version__ not in SUPPORTED_DEEPSPEED:
        raise RuntimeError(f"layer-grad-norms supports DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)}; "
                           f"found {deepspeed.__version__}. Install it with: pip install deepspeed==0.19.8")
    if importlib.util.find_spec("deepspeed.runtime.layer_grad_norms") is not None:
        logging.getLogger(__name__).info("DeepSpeed carries layer_grad_norms already (the upstream patch): "
                                         "install() leaves it as it is")
        return
    from . import hooks

    hooks.apply()
