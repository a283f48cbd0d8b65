"""What the DeepSpeed release under test does differently from 0.19.8, read from each release's source:
the tests' expectations follow it. Nothing here imports the code under test."""

import deepspeed
from packaging.version import Version

RELEASE = Version(Version(deepspeed.__version__).base_version)

# engine.backward: before 0.18, a loss without ZeRO goes to the fp16 optimizer's backward, which
# multiplies it by the loss scale; from 0.18 on only ZeRO optimizers scale it (scale_if_loss).
STAGE0_LOSS_CARRIES_SCALE = RELEASE < Version("0.18")

# engine._do_optimizer_sanity_check: before 0.17, bf16 without ZeRO (bf16 gradient accumulation) runs
# BF16_Optimizer; from 0.17 on, FP16_UnfusedOptimizer (or FP16_Optimizer with FusedAdam).
BF16_WITHOUT_ZERO_UNFUSED = "BF16_Optimizer" if RELEASE < Version("0.17") else "FP16_UnfusedOptimizer"
