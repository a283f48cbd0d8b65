"""What the DeepSpeed release under test does differently from 0.19.8, read from each release's source:
the tests' expectations follow it. Nothing here imports the code under test."""

import deepspeed
from packaging.version import Version

RELEASE = Version(Version(deepspeed.__version__).base_version)

# engine.backward: before 0.18, a loss without ZeRO goes to the fp16 optimizer's backward, which
# multiplies it by the loss scale; from 0.18 on only ZeRO optimizers scale it (scale_if_loss).
STAGE0_LOSS_CARRIES_SCALE = RELEASE < Version("0.18")



def bf16_without_zero(fused: bool) -> str:
    """The optimizer bf16 without ZeRO runs (engine._do_optimizer_sanity_check): BF16_Optimizer before 0.17;
    from 0.17 on FP16_Optimizer with DeepSpeed's FusedAdam, FP16_UnfusedOptimizer with a torch optimizer."""
    if RELEASE < Version("0.17"):
        return "BF16_Optimizer"
    return "FP16_Optimizer" if fused else "FP16_UnfusedOptimizer"
