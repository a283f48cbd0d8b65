"""``optimizer_statistics`` under ZeRO-1/2 against a plain-PyTorch reference, on 1, 2 and 3 CPU ranks.

One launch per world size runs all of that world's cases (optimizer_workers.py). The reference of each step is
the full fp32 weights before and after it and the Adam moments after it, gathered by DeepSpeed's
``safe_get_full_*`` helpers, reduced per bucket in float64 (reference.bucket_stats).
"""

import math
from functools import lru_cache

import pytest
import torch
from optimizer_workers import KINDS, run_cases

from megatron_integration.cpu_launch import launch

TOLERANCE = 1e-4
"""Relative, on norm, min, max and abs_max; abs_min, an element that may be near zero, to this times abs_max."""
UNEVEN = 5  # layers: partitions of unequal size at 3 ranks
BF16_OPTIMIZER = {"dtype": "bf16", "grad_accum_dtype": "fp32"}  # at stage 1: BF16_Optimizer
OFFLOAD = {"zero": {"offload_optimizer": {"device": "cpu"}}, "top": {"zero_force_ds_cpu_optimizer": False}}

RECORDED = {"grad_norm_factor": 3.0, "window": 3, "capture_steps": 1, "history": 4}
"""A trigger whose fire (at the spiked last step) hands back steps 2 to 5 from the flight recorder."""
CASES = {
    1: {
        "z1_fp32_adamw_clip_scheduled": {"stage": 1, "clip": 0.1, "scheduler": 0.5, "compare_off": True},
        "z2_bf16_adam_l2": {"stage": 2, "dtype": "bf16", "optimizer": "adam", "compare_off": True},
        "z2_sgd_param_only": {"stage": 2, "optimizer": "sgd", "kinds": ["param"]},
        "refused_sgd_moments": {"stage": 2, "optimizer": "sgd", "kinds": ["param", "exp_avg"]},
        "refused_stage0_sgd_moments": {"stage": 0, "optimizer": "sgd", "kinds": ["param", "exp_avg"]},
        "refused_amsgrad": {"stage": 1, "optimizer": "adam", "options": {"amsgrad": True}, "kinds": ["update"]},
        "refused_z2_bf16_master": {"stage": 2, "top": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                                                "bf16_optimizer_states": True}}},
    },
    2: {
        "z1_fp32_adamw_gas2_clip": {"stage": 1, "gas": 2, "clip": 0.1, "compare_off": True},
        "z2_bf16_adamw_clip": {"stage": 2, "dtype": "bf16", "clip": 0.1},
        "z2_fp32_adam_l2_scheduled": {"stage": 2, "optimizer": "adam", "scheduler": 0.5},
        "z2_fp16_overflow_update_zero": {"stage": 2, "dtype": "fp16", "overflow_step": 2},
        "z2_recorded_fire": {"stage": 2, "clip": 0.1, "steps": 5, "recorded": RECORDED},
        "z1_bf16_optimizer_adamw_gas2_clip": {"stage": 1, **BF16_OPTIMIZER, "gas": 2, "clip": 0.1,
                                              "compare_off": True},
        "z2_offload_adamw_clip": {"stage": 2, **OFFLOAD, "clip": 0.1},
    },
    3: {
        "z1_bf16_adamw_uneven": {"stage": 1, "dtype": "bf16", "layers": UNEVEN, "clip": 0.1},
        "z2_fp32_adamw_gas2_uneven": {"stage": 2, "gas": 2, "layers": UNEVEN, "compare_off": True},
        "z1_bf16_optimizer_adam_l2_uneven": {"stage": 1, **BF16_OPTIMIZER, "optimizer": "adam", "layers": UNEVEN},
        "z1_fp16_overflow_update_zero_uneven": {"stage": 1, "dtype": "fp16", "overflow_step": 2, "layers": UNEVEN},
        "z2_offload_cpu_adam_uneven": {"stage": 2, "zero": OFFLOAD["zero"], "optimizer": "cpu_adam", "layers": UNEVEN,
                                       "clip": 0.1},
    },
}
MEASURED = [(world, name) for world, cases in CASES.items() for name in cases
            if not name.startswith("refused") and "recorded" not in cases[name]]
COMPARED = [(world, name) for world, name in MEASURED if CASES[world][name].get("compare_off")]


@lru_cache(maxsize=None)
def results_of(world_size: int):
    return launch(run_cases, world_size, CASES[world_size])


def result_of(world_size: int, name: str):
    return rank_records(results_of(world_size), name)


def rank_records(results, name: str):
    """Every rank's record of case ``name`` in one launch's ``results``; a case that failed fails the test
    (a ``refused`` one records its error)."""
    by_rank = [ranks[name] for ranks in results]
    if "error" in by_rank[0] and not name.startswith("refused"):
        pytest.fail(by_rank[0]["error"])
    return by_rank


def world_param(world: int, name: str):
    return pytest.param(world, name, marks=[pytest.mark.extended] if world == 3 else [])


def close(measured: float, reference: float, scale: float) -> float:
    """The error of ``measured`` relative to ``scale``."""
    return abs(measured - reference) / scale if scale else abs(measured - reference)


@pytest.mark.parametrize("world, name", [world_param(*case) for case in MEASURED])
def test_each_kind_matches_the_full_fp32_state_per_bucket(world, name):
    """Every rank reports, for every step and every requested kind, each bucket's statistics of the gathered
    full fp32 weights (after the step), their change, and the moments."""
    check_each_kind(result_of(world, name), CASES[world][name].get("kinds", KINDS))


def check_each_kind(records, kinds) -> None:
    """Every rank's (``records``) every step against its reference, every bucket of every kind."""
    checked = 0
    for record in records:
        on = record["on"]
        assert len(on["measured"]) == len(on["reference"]) > 0
        checked += check_steps(on["measured"], on["reference"], kinds)
    assert checked == len(records) * len(on["reference"]) * len(kinds) * len(on["reference"][0]["param"])


def check_steps(measured_steps, reference_steps, kinds) -> int:
    """Each step's statistics of each kind against its reference; the bucket statistics checked."""
    checked, worst = 0, 0.0
    for measured, reference in zip(measured_steps, reference_steps, strict=True):
        assert set(kinds) <= set(measured) and set(measured) & set(KINDS) == set(kinds)
        for kind in kinds:
            assert measured[kind].keys() == reference[kind].keys() == measured["pre_clip"].keys()
            for bucket, ref in reference[kind].items():
                got = measured[kind][bucket]
                assert got["nonfinite"] == ref["nonfinite"] == 0
                for stat in ("norm", "min", "max", "abs_max"):
                    error = close(got[stat], ref[stat], abs(ref[stat]))
                    worst = max(worst, error)
                    assert error <= TOLERANCE, (kind, bucket, stat, got[stat], ref[stat])
                assert close(got["abs_min"], ref["abs_min"], ref["abs_max"]) <= TOLERANCE, (kind, bucket)
                checked += 1
    print(f"{checked} bucket statistics, worst relative error {worst:.2e}")
    return checked


def test_the_flight_recorder_carries_each_kind():
    """A fire hands back the recorded steps with every kind of each, against the reference of those steps;
    nothing measured on its own."""
    checked = 0
    for record in result_of(2, "z2_recorded_fire"):
        on = record["on"]
        assert all(step is None for step in on["measured"][:-1])
        (fire, ), (steps, ) = on["fires"].keys(), on["fires"].values()
        assert fire == 5 and [step["step"] for step in steps] == [2, 3, 4, 5]
        checked += check_steps(steps, on["reference"][1:], KINDS)
    assert checked == 2 * 4 * len(KINDS) * len(on["reference"][0]["param"])


def test_the_cases_cover_zero_and_bf16_optimizer():
    """The optimizer classes the measured cases ran under, as DeepSpeed picked them."""
    families = {result_of(world, name)[0]["on"]["optimizer"] for world, name in MEASURED if world < 3}
    assert families == {"DeepSpeedZeroOptimizer", "BF16_Optimizer"}


@pytest.mark.parametrize("world, name", [world_param(2, "z2_fp16_overflow_update_zero"),
                                         world_param(3, "z1_fp16_overflow_update_zero_uneven")])
def test_a_skipped_step_updates_nothing(world, name):
    """The fp16 step the loss scaler skips reports a zero update in every bucket (and the reference agrees)."""
    check_skipped_second_step(result_of(world, name)[0]["on"])


def check_skipped_second_step(record) -> None:
    """The second step, skipped, has a zero update in every bucket, as the reference has."""
    skipped = record["measured"][1]
    assert skipped["overflow"] is True
    assert len(skipped["update"]) == len(record["reference"][1]["update"]) > 0
    for bucket, stats in skipped["update"].items():
        assert stats["norm"] == stats["abs_max"] == record["reference"][1]["update"][bucket]["norm"] == 0.0


@pytest.mark.parametrize("world, name", [world_param(*case) for case in COMPARED])
def test_training_is_bit_identical_and_the_collectives_unchanged(world, name):
    """The same weights with the kinds on, with gradient statistics only and with the block off; a measured step
    makes the two collectives of the gradient statistics and no more."""
    for record in result_of(world, name):
        check_unchanged(record, 0 if world == 1 else 2)


def check_unchanged(record, collectives: int) -> None:
    """The same final weights with the kinds on, with gradient statistics only and with the block off; the kinds
    add no collective to the ``collectives`` the gradient statistics make in each step."""
    for other in ("grad_only", "off"):
        for key, value in record["on"]["final"].items():
            assert torch.equal(value, record[other]["final"][key]), (other, key)
    assert record["on"]["collectives"] == record["grad_only"]["collectives"]
    added = [on - off for on, off in zip(record["on"]["collectives"], record["off"]["collectives"])]
    assert added == [collectives] * len(added)


@pytest.mark.parametrize("name, words", [
    ("refused_sgd_moments", ["optimizer_statistics=['param', 'exp_avg']", "Adam", "SGD"]),
    ("refused_stage0_sgd_moments", ["optimizer_statistics=['param', 'exp_avg']", "Adam", "SGD"]),
    ("refused_amsgrad", ["optimizer_statistics=['update']", "amsgrad"]),
    ("refused_z2_bf16_master", ["master weights in torch.bfloat16", "bf16.bf16_master_weights_and_grads=true",
                                "bf16.bf16_optimizer_states=true"]),
])
def test_refused_at_initialize_by_name(name, words):
    record = result_of(1, name)[0]
    assert record.get("type") == "UnsupportedSetupError", record
    for word in words:
        assert word in record["message"]


def test_kinds_are_validated_naming_key_and_value():
    from deepspeed_patch.config import LayerGradNormsConfigError, load_config

    assert load_config({"layer_grad_norms": {}}).optimizer_statistics == ()
    assert load_config({"layer_grad_norms": {"optimizer_statistics": ["update", "param"]}
                        }).optimizer_statistics == ("param", "update")
    for value, words in ((["momentum"], "'momentum'"), ("param", "expected a list")):
        with pytest.raises(LayerGradNormsConfigError, match="optimizer_statistics") as error:
            load_config({"layer_grad_norms": {"optimizer_statistics": value}})
        assert words in str(error.value)
    assert load_config({"layer_grad_norms": {"optimizer_statistics": ["param"], "trigger": {"history": 4}}
                        }).trigger.history == 4


def test_update_rule_reconstructs_torch_adam_steps():
    """The update derived from the weights and moments after a torch Adam / AdamW step, against the step's own
    after minus before, on one tensor (with and without bias correction's effect of a later step)."""
    from deepspeed_patch.optimizer_state.adam_rule import adam_rule

    checked = 0
    for optimizer_class, decay in ((torch.optim.Adam, 0.1), (torch.optim.AdamW, 0.1), (torch.optim.AdamW, 0.0)):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(1000))
        optimizer = optimizer_class([param], lr=1e-2, weight_decay=decay)
        for _ in range(3):
            before = param.detach().clone()
            param.grad = torch.randn(1000)
            optimizer.step()
            state = optimizer.state[param]
            rule = adam_rule(optimizer, optimizer.param_groups[0])
            derived = rule.update_into(torch.empty(1000), param.detach(), state["exp_avg"], state["exp_avg_sq"],
                                       float(state["step"]))
            actual = param.detach() - before
            assert torch.allclose(derived, actual, rtol=0, atol=1e-6), (optimizer_class, decay)
            assert math.isclose(derived.norm().item(), actual.norm().item(), rel_tol=TOLERANCE)
            checked += 1
    assert checked == 9


def test_the_update_in_small_windows_matches_the_step():
    """A flat fp32 partition stepped by AdamW, read with windows far smaller than its spans and cutting them:
    each bucket's update, weights and moments against plain torch on the actual after minus before. The lr
    changes between the step and the read, as the engine's lr scheduler changes it: the step's lr counts."""
    from deepspeed_patch.optimizer_state.optimizer_stats import OptimizerStatistics
    from deepspeed_patch.statistics.kernels import STOCK, chunk_partition
    from deepspeed_patch.statistics.partition_slices import slices_of_spans
    from deepspeed_patch.statistics.statistics import SUMSQ, empty_stats

    torch.manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(1000))
    spans = [(0, 300, 1), (310, 200, 0), (510, 490, 2)]  # a gap of padding that no bucket counts
    optimizer = torch.optim.AdamW([flat], lr=1e-2, weight_decay=0.1)
    checked = 0
    for kernel in (None, STOCK):
        chunking = chunk_partition(slices_of_spans(spans), "cpu", kernel=kernel, chunk=64)
        statistics = OptimizerStatistics(optimizer, [flat], [chunking], tuple(KINDS), piece=97)
        assert statistics.scratch.numel() == 97
        before = flat.detach().clone()
        flat.grad = torch.randn(1000)
        statistics.begin_step()
        optimizer.step()
        optimizer.param_groups[0]["lr"] *= 0.5  # the scheduler's step, before the engine's step ends
        tables = {kind: empty_stats(3, "cpu") for kind in KINDS}
        statistics.accumulate(tables, skipped=False)
        state = optimizer.state[flat]
        values = {"param": flat.detach(), "update": flat.detach() - before, **{m: state[m] for m in KINDS[2:]}}
        for kind, table in tables.items():
            for start, length, bucket in spans:
                expected = values[kind][start:start + length].double().square().sum().item()
                assert math.isclose(table[bucket, SUMSQ].item(), expected, rel_tol=TOLERANCE), (kind, bucket)
                checked += 1
    assert checked == 2 * len(KINDS) * len(spans)


def adam_update(before: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, decay: float, decoupled: bool,
                bias_correction: bool) -> torch.Tensor:
    """The update of one Adam step, in float64, from the weights before it, its gradient and the state after it
    (the moments and the step count): the optimizers' rule written out, L2 decay already in the moments."""
    before, moment, second = (value.double() for value in (before, state["exp_avg"], state["exp_avg_sq"]))
    step = int(state["step"])
    first_correction, second_correction = (1 - 0.9**step, 1 - 0.999**step) if bias_correction else (1.0, 1.0)
    adam = -(lr / first_correction) * moment / (second.sqrt() / math.sqrt(second_correction) + 1e-8)
    return adam - lr * decay * before if decoupled else adam


@pytest.mark.parametrize("kinds", [tuple(KINDS), ("update", ), ("param", "exp_avg_sq")])
def test_each_kernel_reads_every_kind_as_a_float64_reference(kinds):
    """The C++ kernel's one read of the weights and moments (the update derived per element) and the stock path's,
    each against float64 PyTorch: the weights and moments as the optimizer holds them, the update from Adam's rule
    written out (itself checked against the step's real change of the weights), per bucket. Norm to 1e-5;
    min, max, abs_min and abs_max to 1e-5 of the bucket's abs_max (fp32 kernels; abs_min sits where the
    decoupled decay cancels). For AdamW, Adam with L2 and FusedAdam without bias correction."""
    from deepspeed.ops.adam import FusedAdam

    from deepspeed_patch.optimizer_state.optimizer_stats import OptimizerStatistics
    from deepspeed_patch.statistics.kernels import HOST, STOCK, chunk_partition
    from deepspeed_patch.statistics.partition_slices import slices_of_spans
    from deepspeed_patch.statistics.statistics import bucket_results, empty_stats
    from reference import bucket_stats

    spans = [(0, 3000, 1), (3010, 200, 0), (3210, 70000, 2)]  # longer than a chunk, and a gap
    optimizers = {  # (make, decoupled decay, bias correction)
        "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), True, True),
        "adam_l2": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1), False, True),
        "fused_adamw_no_bias_correction": (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, bias_correction=False),
                                           True, False),
    }
    checked = 0
    for name, (make, decoupled, bias_correction) in optimizers.items():
        torch.manual_seed(0)
        flat = torch.nn.Parameter(torch.randn(73210))
        optimizer = make([flat])
        chunkings = {kernel: chunk_partition(slices_of_spans(spans), "cpu", kernel=kernel) for kernel in (HOST, STOCK)}
        readers = {
            kernel: OptimizerStatistics(optimizer, [flat], [chunking], kinds)
            for kernel, chunking in chunkings.items()
        }
        for _ in range(2):
            before = flat.detach().clone()
            flat.grad = torch.randn(73210)
            for reader in readers.values():
                reader.begin_step()
            optimizer.step()
        state = optimizer.state[flat]
        update = adam_update(before, flat.grad, state, 1e-2, 0.1, decoupled, bias_correction)
        applied = flat.detach().double() - before.double()
        # The rule is the optimizer's: the weights' real change, to their fp32 rounding.
        rounding = 2 * torch.finfo(torch.float32).eps * before.double().abs() + 1e-5 * update.abs().max()
        assert ((update - applied).abs() <= rounding).all(), name
        values = {"param": flat.detach(), "update": update, "exp_avg": state["exp_avg"],
                  "exp_avg_sq": state["exp_avg_sq"]}
        for kernel, reader in readers.items():
            tables = {kind: empty_stats(3, "cpu") for kind in kinds}
            reader.accumulate(tables, skipped=False)
            for kind in kinds:
                want = bucket_stats({str(bucket): values[kind][start:start + length]
                                     for start, length, bucket in spans}, key_of=int)
                got = bucket_results(tables[kind], [0, 1, 2], [0, 1, 2], 1.0)
                for bucket, expected in want.items():
                    assert got[bucket]["norm"] == pytest.approx(expected["norm"], rel=1e-5), (name, kernel, kind)
                    for stat in ("min", "max", "abs_min", "abs_max"):
                        assert abs(got[bucket][stat] - expected[stat]) <= 1e-5 * expected["abs_max"], (
                            name, kernel, kind, bucket, stat)
                    checked += 1
    assert checked == 3 * 2 * len(kinds) * 3


def test_before_the_first_step_the_moments_and_update_are_zero():
    """A step the loss scaler skips before the optimizer ever stepped (fp16's first steps): no state yet, so
    zero moments and a zero update, over every element of each bucket; the weights as they are."""
    from deepspeed_patch.optimizer_state.optimizer_stats import OptimizerStatistics
    from deepspeed_patch.statistics.kernels import STOCK, chunk_partition
    from deepspeed_patch.statistics.partition_slices import slices_of_spans
    from deepspeed_patch.statistics.statistics import MAX, NEG_ABS_MIN, NUMEL, SUMSQ, empty_stats

    torch.manual_seed(0)
    flat = torch.nn.Parameter(torch.randn(100))
    optimizer = torch.optim.AdamW([flat], lr=1e-2)
    chunking = chunk_partition(slices_of_spans([(0, 40, 0), (40, 60, 1)]), "cpu", kernel=STOCK)
    tables = {kind: empty_stats(2, "cpu") for kind in KINDS}
    OptimizerStatistics(optimizer, [flat], [chunking], tuple(KINDS), piece=32).accumulate(tables, skipped=True)
    assert tables["param"][:, SUMSQ].sum().item() == pytest.approx(flat.detach().double().square().sum().item())
    for kind in KINDS[1:]:
        assert tables[kind][:, NUMEL].tolist() == [40, 60]
        assert tables[kind][:, [SUMSQ, MAX, NEG_ABS_MIN]].abs().sum().item() == 0, kind
