"""The end-to-end harness (``layer-grad-norms megatron-e2e``) on the fake fork of tests/fake_fork, and its checks
on TensorBoard directories written here in both layouts: the one-run layout and a run per bucket."""

import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_integration.cpu_launch import GLOO_EXIT_ABORT
from megatron_integration.fork_e2e import checks, launch
from megatron_integration.fork_e2e.reference import REFERENCE_LINE, combined_norm, square_sums
from megatron_integration.fork_e2e.run import E2EOptions, run_e2e
from megatron_integration.fork_e2e.setups import SETUPS, Setup
from megatron_integration.fork_e2e.verdict import check_run

FAKE_FORK = Path(__file__).parent / "fake_fork"
TRAIN_ITERS = 5
# fp32 without ZeRO, where the fork logs no grad norm: the buckets are checked against reference.py's norm
# (data-parallel replicas here; pipeline-tied copies in the real fork's pipe-stage0)
FAKE_STAGE0 = Setup("stage0-dp", "fp32 without ZeRO, data parallel 2", zero_stage=0, optimizer="AdamW",
                    rss_against="reference")
REAL_LOG_LINE = (  # the microsoft fork at 4efb479 with microsoft.patch, ZeRO-1 on 2 CPU ranks, iteration 5
    " iteration        5/      10 | consumed samples:           20 | consumed tokens:          640 | elapsed time per "
    "iteration (ms): 588.3 | learning rate: 7.222E-04 | global batch size:     4 | lm loss: 4.861312E+00 | loss scale:"
    " 1.0 | grad norm: 1.650 | layer grad norm: 0: 7.803E-01 | 1: 6.722E-01 | 2: 6.251E-01 | 3: 6.465E-01 | actual "
    "seqlen:    32 | number of skipped iterations:   0 |")


FAKE_RUN = pytest.mark.extended
"""The harness's run on the fake fork (two 2-rank launches) in the extended tier: the suite trains the Megatron hook
itself (test_megatron_integration.py) and checks the harness's checks here on logs written in place."""


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """The harness on the fake fork with this interpreter's DeepSpeed. The ranks share the JIT build of
    ``deepspeed_shm_comm`` with the rest of the suite (``rank_environment`` keeps this interpreter's folder)
    rather than building their own."""
    fork = tmp_path_factory.mktemp("fork") / "fake_fork"
    shutil.copytree(FAKE_FORK, fork, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("e2e")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SETUPS, FAKE_STAGE0.name, FAKE_STAGE0)
        summary = run_e2e(E2EOptions(fork=str(fork), setups=("zero1", FAKE_STAGE0.name), out=str(out),
                                     train_iters=TRAIN_ITERS))
    return summary, out


@FAKE_RUN
def test_fake_fork_passes_every_check(fake_run):
    """Among them, that the engine has ``get_layer_grad_norms``: the fake fork, like the patched forks, never
    calls ``deepspeed_patch.install()``; ``--log-layer-grad-norms`` through ``layer_grad_norms_ds_config`` must
    be enough."""
    summary, out = fake_run
    result = summary["setups"]["zero1"]
    assert {"DeepSpeed optimizer", "layer-grad-norms scalars read back",
            "root-sum-square equals the fork's grad norm"} <= set(result["checks"])
    failed = {name: check["detail"] for name, check in result["checks"].items() if not check["ok"]}
    assert not failed, (out / "zero1" / "log_excerpt.txt").read_text()
    assert summary["passed"] and result["worst_relative_error"] < 1e-5
    assert [int(line.split()[1].split("/")[0]) for line in result["log_lines"]] == [5]
    rows = [line for line in (out / "summary.md").read_text().splitlines() if " | passed | " in line]
    assert len(rows) == len(summary["setups"]) == 2, rows  # one row per set-up, each passed


@FAKE_RUN
def test_without_zero_the_buckets_add_up_to_the_reference_norm(fake_run):
    """The fake fork logs no grad norm in fp32 without ZeRO; the reference printed at each step stands in."""
    summary, out = fake_run
    result = summary["setups"][FAKE_STAGE0.name]
    failed = {name: check["detail"] for name, check in result["checks"].items() if not check["ok"]}
    assert not failed, (out / FAKE_STAGE0.name / "log_excerpt.txt").read_text()
    assert "root-sum-square equals the reference norm (the fork logs none)" in result["checks"]
    assert "root-sum-square equals the fork's grad norm" not in result["checks"]
    assert sorted(result["root_sum_square"]) == list(range(1, TRAIN_ITERS + 1))
    assert result["worst_relative_error"] < 1e-5


@FAKE_RUN
def test_the_shims_ran_in_the_ranks(fake_run):
    """The fake fork cannot import or train without them: each one it needs is named in the run's log."""
    summary, _ = fake_run
    shims = summary["setups"]["zero1"]["shims"]
    assert "stub torchvision" in shims
    assert "contiguous q/k/v for CoreAttention.forward" in shims
    assert "grad norm reported on the non-pipeline path" in shims


def test_ranks_of_another_interpreter_build_into_a_folder_of_their_own(monkeypatch):
    """Another installation's DeepSpeed gets its own torch-extension folder (another release's build fails to
    load); this interpreter's ranks keep the environment's, the folder the suite's other launches use."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(launch, "extension_cache_name", lambda python: "deepspeed-0.14.5-0123abcd")
    assert "TORCH_EXTENSIONS_DIR" not in launch.rank_environment(sys.executable)
    other = launch.rank_environment("/opt/other-venv/bin/python")["TORCH_EXTENSIONS_DIR"]
    assert Path(other).name == "deepspeed-0.14.5-0123abcd"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/tmp/chosen")
    assert launch.rank_environment("/opt/other-venv/bin/python")["TORCH_EXTENSIONS_DIR"] == "/tmp/chosen"


def fake_training(monkeypatch, endings):
    """``run_setup``'s launches, each writing a log and a TensorBoard file and ending as ``endings`` says (an
    exit status and the log's last line); returns whether each launch found a TensorBoard folder left over."""
    found_leftover = []

    def train(python, fork, world_size, fork_args, out, timeout):
        returncode, last_line = endings[len(found_leftover)]
        found_leftover.append((out / "tensorboard").exists())
        (out / "tensorboard").mkdir()
        (out / "tensorboard" / f"events.{len(found_leftover)}").write_text("")
        (out / "stdout.log").write_text(f" iteration        5/       5 | lm loss: 3.3\n{last_line}\n")
        return returncode

    monkeypatch.setattr(launch, "_train", train)
    return found_leftover


@pytest.mark.parametrize("endings, launches, returncode", [
    ([(250, GLOO_EXIT_ABORT), (0, "")], 2, 0),
    ([(250, GLOO_EXIT_ABORT), (250, GLOO_EXIT_ABORT)], 2, 250),
    ([(250, "exits with return code = -6"), (0, "")], 1, 250),
    ([(1, "ValueError: layers"), (0, "")], 1, 1),
], ids=["abort-then-clean", "two-aborts", "abort-without-message", "error"])
def test_a_setup_ending_in_the_gloo_exit_abort_is_trained_again_from_an_empty_tensorboard_folder(
        monkeypatch, tmp_path, endings, launches, returncode):
    """The fork's ranks die of torch's gloo exit abort after their last step now and then (more often on a loaded
    machine): the harness launches once more, as ``run_script`` does, and the checks read the second launch's
    TensorBoard alone; anything else is launched once."""
    found_leftover = fake_training(monkeypatch, endings)
    assert launch.run_setup(FAKE_STAGE0, tmp_path, tmp_path / "data", tmp_path / "out", sys.executable, 5, "all",
                            60) == returncode
    assert found_leftover == [False] * launches
    assert len(os.listdir(tmp_path / "out" / "tensorboard")) == 1


def test_parse_log_reads_the_real_forks_line():
    (line,) = checks.parse_log("noise\n" + REAL_LOG_LINE + "\n")
    assert (line.iteration, line.grad_norm) == (5, 1.650)
    assert line.layers == {0: 0.7803, 1: 0.6722, 2: 0.6251, 3: 0.6465}


def write_run(logdir: Path, layout: str, norms, grad_norm_scale: float = 1.0, new_style: bool = False) -> None:
    """Per-layer pre-clip norms and the fork's grad norm, in the ``layout`` "one-run" or "run-per-bucket"; the
    grad norm as a tensor summary with ``new_style`` (the bigscience fork's writer)."""
    from torch.utils.tensorboard import SummaryWriter

    main = SummaryWriter(str(logdir))
    writers = {}
    for step, buckets in norms.items():
        for bucket, value in buckets.items():
            if layout == "one-run":
                main.add_scalar(f"layer-grad-norms/pre-clip/{bucket}", value, step)
            else:
                root = "layer-grad-norms" if bucket.startswith("layer") else "non-layer-grad-norms"
                writer = writers.setdefault(bucket, SummaryWriter(str(logdir / "layer-grad-norms" / bucket)))
                writer.add_scalar(f"{root}/pre-clip", value, step)
        rss = math.sqrt(sum(value ** 2 for value in buckets.values()))
        main.add_scalar("grad-norm/grad-norm", rss * grad_norm_scale, step, new_style=new_style)
    for writer in [main, *writers.values()]:
        writer.close()


NORMS = {step: {"layer00": 0.3 * step, "layer01": 0.2, "embed": 0.1 + step} for step in (1, 2, 3)}


@pytest.mark.parametrize("layout", ["one-run", "run-per-bucket"])
def test_root_sum_square_in_either_layout(tmp_path, layout):
    write_run(tmp_path, layout, NORMS)
    data = checks.read_tensorboard(str(tmp_path))
    assert len(data.bucket_norms()) == 3
    errors = checks.root_sum_square_errors(data)
    assert sorted(errors) == [1, 2, 3]
    assert max(error for _, _, error in errors.values()) < 1e-6


def test_a_new_style_grad_norm_is_read(tmp_path):
    write_run(tmp_path, "run-per-bucket", NORMS, new_style=True)
    errors = checks.root_sum_square_errors(checks.read_tensorboard(str(tmp_path)))
    assert sorted(errors) == [1, 2, 3] and max(error for _, _, error in errors.values()) < 1e-6


def test_a_wrong_grad_norm_fails_the_check(tmp_path):
    write_run(tmp_path, "one-run", NORMS, grad_norm_scale=1.01)
    result = check_run("", str(tmp_path), 0, train_iters=3, optimizer="DeepSpeedZeroOptimizer")
    check = result["checks"]["root-sum-square equals the fork's grad norm"]
    assert not check["ok"] and result["worst_relative_error"] == pytest.approx(0.01 / 1.01, rel=1e-3)
    assert not result["checks"]["log line with the per-layer field"]["ok"]
    assert not result["passed"]


def test_setups_divide_their_ranks():
    assert {"zero1", "zero2", "bloom", "tp2", "bloom3d", "zero1-3d", "pipe-stage0"} <= set(SETUPS)
    for setup in SETUPS.values():
        config = setup.ds_config()
        assert setup.tensor_parallel * setup.pipeline_parallel * setup.data_parallel == setup.world_size
        assert config["train_batch_size"] == (config["train_micro_batch_size_per_gpu"] * setup.data_parallel
                                              * config["gradient_accumulation_steps"])
    for name in ("bloom", "bloom3d"):
        assert SETUPS[name].ds_config()["data_types"] == {"grad_accum_dtype": "fp32"}
        assert "--no-pipeline-parallel" not in SETUPS[name].fork_flags()


@pytest.mark.parametrize("name, bf16", [("bloom3d", True), ("zero1-3d", False)])
def test_3d_setups_are_tp2_pp2_dp2_on_eight_ranks(name, bf16):
    setup = SETUPS[name]
    assert (setup.tensor_parallel, setup.pipeline_parallel, setup.data_parallel, setup.world_size) == (2, 2, 2, 8)
    flags = setup.fork_flags()
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "2"
    assert ("--bf16" in flags) == bf16 and "--no-pipeline-parallel" not in flags
    assert setup.ds_config()["zero_optimization"] == {"stage": 1}
    assert setup.ds_config()["gradient_accumulation_steps"] == 2


def test_reference_norm_counts_each_parameter_once():
    """Two data-parallel replicas of a two-stage pipeline whose stages share a tied weight: the reference is
    the norm of the distinct parameters' gradients, in plain torch."""
    torch.manual_seed(0)
    tied = torch.nn.Linear(5, 3)  # the same module, name and gradient on both stages, as a pipeline-tied copy
    first = torch.nn.ModuleDict({"tied": tied, "1": torch.nn.Linear(3, 4)})
    last = torch.nn.ModuleDict({"2": torch.nn.Linear(4, 2), "tied": tied})
    for param in [*first.parameters(), *last.parameters()]:
        param.grad = torch.randn_like(param)
    distinct = [param.grad for param in torch.nn.ModuleList([first, last]).parameters()]  # each parameter once
    tables = [square_sums(first), square_sums(last), square_sums(first), square_sums(last)]  # 2 replicas
    norm, spread, zero_copies = combined_norm(tables)
    assert len(distinct) == len({name for table in tables for name in table}) == 6
    assert norm == pytest.approx(torch.cat([grad.flatten() for grad in distinct]).double().norm().item(), rel=1e-12)
    assert spread == 0.0 and zero_copies == []


def test_reference_norm_reports_copies_that_differ():
    _, spread, zero_copies = combined_norm([{"tied": 4.0, "a": 1.0}, {"tied": 3.0}])
    assert spread == pytest.approx(0.25) and zero_copies == []


def test_reference_norm_leaves_out_an_unused_all_zero_copy():
    """The last stage's copy of the position embeddings: unused there, its gradient DeepSpeed's zeros."""
    norm, spread, zero_copies = combined_norm([{"position": 9.0, "a": 16.0}, {"position": 0.0, "b": 0.0}])
    assert (norm, spread, zero_copies) == (5.0, 0.0, ["position"])


@pytest.mark.parametrize("scale, passes", [(1.0, True), (1.01, False)])
def test_the_reference_check_reads_the_printed_norms(tmp_path, scale, passes):
    write_run(tmp_path, "one-run", NORMS)
    norms = {step: scale * math.sqrt(sum(value ** 2 for value in buckets.values())) for step, buckets in NORMS.items()}
    stdout = "".join(f"{REFERENCE_LINE} iteration {step}: {norm!r} (copies differ by 0.0e+00; "
                     "all-zero copies of: none)\n" for step, norm in norms.items())
    result = check_run(stdout, str(tmp_path), 0, train_iters=3, optimizer="AdamW", rss_against="reference")
    check = result["checks"]["root-sum-square equals the reference norm (the fork logs none)"]
    assert check["ok"] == passes and sorted(result["root_sum_square"]) == [1, 2, 3]
    assert result["checks"]["reference norm: copies of a parameter agree"]["ok"]


def test_pipe_stage0_is_fp32_without_zero_pp2_dp2_on_four_ranks():
    setup = SETUPS["pipe-stage0"]
    assert (setup.tensor_parallel, setup.pipeline_parallel, setup.data_parallel, setup.world_size) == (1, 2, 2, 4)
    flags = setup.fork_flags()
    assert "--no-pipeline-parallel" not in flags and "--bf16" not in flags
    assert flags[flags.index("--zero-stage") + 1] == "0" and setup.ds_config()["zero_optimization"] == {"stage": 0}
    assert setup.rss_against == "reference"
