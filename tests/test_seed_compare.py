"""``deepspeed_patch/upstream/seed/compare.py``, which compares the seed of PR 01 with the package bit for bit: its
float64 distance in ulps, its equality that takes NaN for NaN and its per-field count of differences, on results made
up here; and (extended) its seed-wired runs on the installed release against the package, six set-ups at 1, 2 and 3
ranks (the seed applied to a master checkout, its other runs, is a session script's: CI cannot fetch one)."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

COMPARE = os.path.join(os.path.dirname(__file__), "..", "deepspeed_patch", "upstream", "seed", "compare.py")


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("seed_compare", COMPARE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def step_result(step: int, norm: float, overflow: bool = False) -> dict:
    """A result as ``engine.get_layer_grad_norms()`` gives it, two layers; no post-clip on an overflowed step."""
    def stats() -> dict:
        return {key: {"norm": norm * (key + 1), "min": -norm, "max": norm} for key in (0, 1)}

    return {"step": step, "overflow": overflow, "clip_coef": None if overflow else 0.5, "loss_scale": 1.0,
            "pre_clip": stats(), "post_clip": None if overflow else stats()}


def test_ulps_counts_float64_steps_across_zero(compare):
    assert compare.ulps(1.0, 1.0) == 0
    assert compare.ulps(1.0, math.nextafter(1.0, 2.0)) == 1
    assert compare.ulps(math.nextafter(0.0, 1.0), math.nextafter(0.0, -1.0)) == 2
    assert compare.ulps(math.inf, 1.0) == -1


def test_nan_equals_nan_and_nothing_else(compare):
    assert compare.equal(math.nan, math.nan)
    assert not compare.equal(math.nan, 1.0)
    assert compare.equal(None, None) and not compare.equal(0.5, None)


def test_compare_counts_each_differing_field_once(compare, capsys):
    seed = [None, step_result(2, 1.0), step_result(3, math.nan, overflow=True)]
    package = [None, step_result(2, 1.0), step_result(3, math.nan, overflow=True)]
    package[1]["pre_clip"][1]["norm"] = math.nextafter(2.0, 3.0)  # one ulp off, one field of one layer
    counts = compare.compare("seed", seed, "package", package)
    assert counts["pre_clip.norm"][:3] == [4, 1, 1]  # 2 steps x 2 layers compared, one differs by one ulp
    assert counts["post_clip.norm"][:2] == [2, 0]  # the overflowed step has no post-clip to compare
    assert counts["clip_coef"][:2] == [2, 0] and counts["step"][:2] == [2, 0]
    assert sum(entry[1] for entry in counts.values()) == 1
    assert "step 2 pre_clip 1 norm" in capsys.readouterr().out


def test_compare_names_a_phase_only_one_run_has(compare):
    seed, package = [step_result(1, 1.0)], [step_result(1, 1.0)]
    package[0]["post_clip"] = None
    counts = compare.compare("seed", seed, "package", package)
    assert counts["post_clip missing"][1] == 1


# The seed's module on the installed release against the package's stock path: (the script's options, the results a
# run returns, how many of them are measured). Every set-up measures 6 buckets (embed, layers 0 to 3, head).
RELEASE_SETUPS = {
    "1-rank-zero2": (["--world", "1"], 4, 4),
    "2-ranks-zero2-accumulation-interval": (["--gas", "2", "--interval", "2"], 8, 7),
    "2-ranks-zero2-fp16-overflows": (["--fp16"], 8, 8),
    "2-ranks-zero2-bf16-offload": (["--bf16", "--offload", "--gas", "2", "--interval", "2"], 8, 7),
    "3-ranks-zero1-accumulation": (["--world", "3", "--stage", "1", "--gas", "2"], 4, 4),
    "3-ranks-zero1-fp16-overflows": (["--world", "3", "--stage", "1", "--fp16"], 8, 8),
}
COUNT_LINE = re.compile(r"^  (\S+)\s+(\d+) compared,\s+(\d+) differ", re.MULTILINE)


def printed_counts(stdout: str) -> dict:
    """The script's per-field counts, as it prints them: ``{field: (compared, differing)}``."""
    return {field: (int(total), int(differ)) for field, total, differ in COUNT_LINE.findall(stdout)}


def run_against_release(options: list, out_dir: str, seed_patch: str = "") -> subprocess.CompletedProcess:
    """``compare.py``'s seed-wired and package-stock runs on the installed DeepSpeed, sharing the suite's JIT
    builds (its environment's ``TORCH_EXTENSIONS_DIR``, or torch's default folder)."""
    command = [sys.executable, COMPARE, "--runs", "seed-wired,package-stock", "--master", "", "--out-dir", out_dir]
    command += ["--seed-patch", seed_patch] if seed_patch else []
    return subprocess.run(command + options, capture_output=True, text=True, timeout=900)


@pytest.mark.extended
@pytest.mark.parametrize("setup", sorted(RELEASE_SETUPS))
def test_the_seed_gives_the_packages_numbers_on_the_release(setup, tmp_path):
    """PR 01 as written for DeepSpeed (its module, wired where the patch calls it) and the package's
    stock path, the same training: every field of every measured step equal with ``==``, every rank alike."""
    options, num_results, measured = RELEASE_SETUPS[setup]
    result = run_against_release(options, str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "seed-wired == package-stock on every field: True" in result.stdout, result.stdout
    counts = printed_counts(result.stdout)
    assert counts["pre_clip.norm"] == (6 * measured, 0) and counts["clip_coef"] == (measured, 0), counts
    assert sum(differ for _, differ in counts.values()) == 0, counts
    with open(tmp_path / "seed-wired-0.json") as handle:
        run = json.load(handle)
    results = [step for step in run["results"] if step is not None]
    assert len(run["results"]) == num_results and len(results) == measured
    overflowed = sum(step["overflow"] for step in results)
    if "--fp16" in options:  # both kinds of step: pre-clip alone on an overflow, post-clip on the others
        assert 0 < overflowed < measured and counts["post_clip.norm"] == (6 * (measured - overflowed), 0), counts
    assert ("cpu_offload=True" in run["setup"]) == ("--offload" in options), run["setup"]


@pytest.mark.extended
def test_the_release_comparison_fails_on_a_seed_that_sums_in_other_pieces(compare, tmp_path):
    """The check above can fail: a seed that reads its dot products in pieces of 2^18 elements, not the package's
    2^19, differs in the norms' last bits, and the script says so."""
    with open(compare.SEED_PATCH, encoding="utf-8") as handle:
        patch = handle.read()
    assert patch.count("HOST_PIECE, DEVICE_PIECE = 1 << 19, 1 << 22") == 1
    changed = tmp_path / "seed.patch"
    changed.write_text(patch.replace("HOST_PIECE, DEVICE_PIECE = 1 << 19, 1 << 22",
                                     "HOST_PIECE, DEVICE_PIECE = 1 << 18, 1 << 22"), encoding="utf-8")
    result = run_against_release(["--world", "1"], str(tmp_path / "out"), str(changed))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "seed-wired == package-stock on every field: False" in result.stdout, result.stdout
    counts = printed_counts(result.stdout)
    assert counts["pre_clip.min"] == (24, 0) and counts["pre_clip.norm"][1] > 0, counts
