"""What ``optimizer_statistics`` refuses at initialize, by name: master weights or optimizer states below fp32 in
any family (their update would be derived in fp32, not rounded as the real step rounds it), and optimizers that
do not run a known Adam step (recognised by their ``step`` method, not by their ancestors).

Unit tests on optimizers built without their constructors where building them is slow (ZeRO's, DeepSpeedCPUAdam's
host kernel), as the ZeRO-3 refusals are tested. The real ZeRO-2 engine with bf16 master weights and bf16 optimizer
states, refused by ``deepspeed.initialize``, is a case of tests/test_optimizer_statistics.py's one-rank launch.
"""

import pytest
import torch

from deepspeed_patch.config import UnsupportedSetupError, load_config

KINDS = ["param", "update"]
KEY = f"optimizer_statistics={KINDS}"


def check(optimizer, family):
    from deepspeed_patch.adapters.refusals import check_optimizer_statistics

    config = load_config({"layer_grad_norms": {"optimizer_statistics": KINDS}})
    check_optimizer_statistics(optimizer, family, config)


def refusal(optimizer, family) -> str:
    with pytest.raises(UnsupportedSetupError) as error:
        check(optimizer, family)
    return str(error.value)


def zero_optimizer(inner=None, **attributes):
    """A ZeRO-1/2 optimizer with only the attributes the refusals read (``__new__``: no partitions built)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
    master = attributes.get("master_weights_and_grads_dtype", torch.float32)
    inner = inner or torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, dtype=master))])
    optimizer.__dict__.update({"optimizer": inner, "master_weights_and_grads_dtype": master, **attributes})
    return optimizer


def cpu_adam(fp32_optimizer_states: bool, dtype: torch.dtype) -> torch.optim.Optimizer:
    """DeepSpeedCPUAdam as its constructor leaves it, without building its host kernel."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = [torch.nn.Parameter(torch.zeros(4, dtype=dtype))]
    optimizer = DeepSpeedCPUAdam.__new__(DeepSpeedCPUAdam)
    torch.optim.Optimizer.__init__(optimizer, params, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                                           bias_correction=True, amsgrad=False))
    optimizer.__dict__.update(adam_w_mode=True, fp32_optimizer_states=fp32_optimizer_states)
    return optimizer


@pytest.mark.parametrize("attributes, words", [
    ({"master_weights_and_grads_dtype": torch.bfloat16}, ["master weights in torch.bfloat16",
                                                          "bf16.bf16_master_weights_and_grads=true"]),
    ({"master_weights_and_grads_dtype": torch.bfloat16, "bf16_optimizer_states": True},
     ["master weights in torch.bfloat16", "bf16.bf16_optimizer_states=true"]),
    ({"master_weights_and_grads_dtype": torch.float16}, ["master weights in torch.float16",
                                                         "fp16.fp16_master_weights_and_grads=true"]),
])
def test_zero_master_weights_or_states_below_fp32_are_refused_by_key(attributes, words):
    from deepspeed_patch.adapters.zero import ZeroAdapter

    check(zero_optimizer(), ZeroAdapter)  # fp32 master weights and states: accepted
    message = refusal(zero_optimizer(**attributes), ZeroAdapter)
    for word in [KEY, "fp32 master weights and optimizer states", *words]:
        assert word in message, message


def test_cpu_adam_without_fp32_states_is_refused_by_its_argument_where_its_moments_are_not_fp32():
    """DeepSpeedCPUAdam keeps its moments in the precision of the parameters it steps with
    ``fp32_optimizer_states=False``: fp32 master weights keep them fp32 (accepted), bf16 ones make them bf16."""
    from deepspeed_patch.adapters.zero import ZeroAdapter

    check(zero_optimizer(cpu_adam(True, torch.float32)), ZeroAdapter)
    check(zero_optimizer(cpu_adam(False, torch.float32)), ZeroAdapter)
    inner = cpu_adam(False, torch.bfloat16)
    message = refusal(zero_optimizer(inner, master_weights_and_grads_dtype=torch.bfloat16), ZeroAdapter)
    assert "DeepSpeedCPUAdam(fp32_optimizer_states=False)" in message and KEY in message, message


def test_parameters_below_fp32_in_any_family_are_refused_by_dtype():
    """Without ZeRO (``family`` None) the torch optimizer steps the model's parameters: bf16 ones are named."""
    check(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))]), None)
    message = refusal(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]), None)
    assert "parameters of AdamW in torch.bfloat16" in message and KEY in message, message


class KeepsAdamsStep(torch.optim.Adam):
    """A subclass that only changes the defaults: it steps as Adam does."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True)


class OwnStep(torch.optim.AdamW):
    """An Adam subclass whose step does something else (here: clamps the weights after Adam's step)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                param.clamp_(-1, 1)
        return loss


class NotAdam(torch.optim.Adam):
    """A subclass in name only: its own groups (no ``betas``) and its own step (plain SGD)."""

    def __init__(self, params) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                param.add_(param.grad, alpha=-group["lr"])


def test_adam_is_known_by_the_step_it_runs():
    """A subclass that keeps Adam's step gets Adam's rule; one with a step of its own, Adam's or not in name, is
    refused naming its class (not a bare ``KeyError: 'betas'``)."""
    from deepspeed_patch.optimizer_state.adam_rule import adam_rule

    params = [torch.nn.Parameter(torch.zeros(4))]
    kept = KeepsAdamsStep(params)
    check(kept, None)
    assert adam_rule(kept, kept.param_groups[0]).decoupled
    for cls, parent in ((OwnStep, "AdamW"), (NotAdam, "Adam")):
        message = refusal(cls(params), None)
        own = f"{cls.__name__}, a subclass of {parent} with a step method of its own"
        for word in [KEY, "need an Adam optimizer", own]:
            assert word in message, message
    check(torch.optim.AdamW(params), None)  # torch's own, whose class's step torch wraps in a profiling hook

