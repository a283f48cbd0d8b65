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


# DeepSpeed bugs the core tests meet on some releases. The statistics report the gradient the optimizer
# really steps on there (they add up to DeepSpeed's own global norm, and post_clip is the update applied);
# these facts say where that gradient is not the true average.

# ZeRO-1/2 with contiguous_gradients off hands the optimizer a wrong gradient for the token embedding
# (seen on 0.14.5, 0.15.4, 0.16.9, 0.17.6 and 0.18.9; right on 0.19.8).
NONCONTIGUOUS_GRADIENT_WRONG = RELEASE < Version("0.19")

# BF16_Optimizer with data parallelism steps on a gradient that is not the ranks' average, and each rank
# computes a global norm of its own, so clips by its own factor (0.18.9 on the CPU accelerator; shown
# without this package, by each rank's safe_get_full_grad at the step against the averaged gradient).
BF16_OPTIMIZER_DATA_PARALLEL_WRONG = Version("0.18") <= RELEASE < Version("0.19")

# A pipeline's loss is not divided by the accumulation steps in 0.16 and 0.17 (engine._backward_prologue
# divides only when backward all-reduces, which PipelineEngine turns off): the optimizer gets the sum of its
# micro-batches' gradients. In 0.18 the last stage gets their mean, and a stage before it that mean divided
# by them once more (the engine divides the activation gradient it receives, which already carries the
# division: _backward_prologue_per_tensor). Tested: 0.16.9, 0.17.6, 0.18.9, with 2 stages.


def pipeline_gradient_factor(gas: int, stage: int, stages: int) -> float:
    """What stage ``stage`` of a ``stages``-stage pipeline's optimizer gets, as a multiple of the mean
    gradient of its ``gas`` micro-batches."""
    if Version("0.16") <= RELEASE < Version("0.18"):
        return float(gas)
    if Version("0.18") <= RELEASE < Version("0.19") and stage < stages - 1:
        return 1.0 / gas
    return 1.0
