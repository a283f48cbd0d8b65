"""The upstream patch: current with the sources, applied and reverted cleanly by ``layer-grad-norms patch``,
and, applied to a copy of the installed DeepSpeed, passing the core correctness tests without
``deepspeed_patch``."""

import hashlib
import os
import shutil
import subprocess
import sys
from typing import Dict

import pytest
from yapf.yapflib.yapf_api import FormatCode

from deepspeed_patch.upstream.build import (
    DOCS_ANCHOR,
    DOCS_PAGE,
    LICENSE,
    MASTER_PATCH_FILE,
    PATCH_FILE,
    installed_deepspeed_root,
    make_patch,
    upstream_files,
)
from zero_workers import CASES_ENV, FAMILY_CASES, UPSTREAM_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_installed(root) -> str:
    """A copy of the installed ``deepspeed`` package under ``root``."""
    shutil.copytree(os.path.join(installed_deepspeed_root(), "deepspeed"), os.path.join(root, "deepspeed"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    return str(root)


def digests(root: str) -> Dict[str, str]:
    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [name for name in dirs if name != "__pycache__"]
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def patch_command(action: str, root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_integration.cli", "patch", action, "--deepspeed", root],
                          capture_output=True, text=True, cwd=REPO)


def test_committed_patch_is_current():
    with open(PATCH_FILE, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == make_patch(), "stale patch: run python -m deepspeed_patch.upstream.build"


def file_diffs(patch: str) -> Dict[str, str]:
    """``{path: its diff}`` of a patch."""
    return {diff.split(" ", 1)[0][2:]: "diff --git " + diff for diff in patch.split("diff --git ")[1:]}


def test_master_patch_carries_the_current_package():
    """The master patch is generated in a session (CI has no master checkout), so its call-site hunks are
    checked there (``git apply --check``); here, every file it adds and the docs section must still be what
    the generator writes today."""
    with open(MASTER_PATCH_FILE, encoding="utf-8") as handle:
        master = file_diffs(handle.read())
    current = file_diffs(make_patch())
    assert master.keys() == current.keys()
    added = {path: diff for path, diff in current.items() if "new file mode" in diff}
    assert len(added) >= 10
    for path, diff in added.items():
        assert master[path] == diff, f"{path}: stale master patch, regenerate it against a master checkout"
    docs_body = [diff.split("\n@@", 1)[1].split("\n", 1)[1] for diff in (master[DOCS_PAGE], current[DOCS_PAGE])]
    assert docs_body[0] == docs_body[1]


def test_new_files_follow_deepspeed_conventions():
    """DeepSpeed's license header, deepspeed.comm rather than torch.distributed, yapf with its style."""
    style = os.path.join(REPO, ".style.yapf")
    new_files = {path: text for path, (original, text) in upstream_files(installed_deepspeed_root()).items()
                 if original is None and path.endswith(".py")}
    assert len(new_files) >= 10
    for path, text in new_files.items():
        assert text.startswith(LICENSE), path
        assert "torch.distributed" not in text, path
        assert FormatCode(text, style_config=style)[0] == text, f"{path}: run yapf --style .style.yapf -i"


def test_apply_is_idempotent_and_revert_restores_every_byte(tmp_path):
    root = copy_installed(tmp_path)
    before = digests(root)
    assert patch_command("check", root).returncode == 1
    applied = patch_command("apply", root)
    assert applied.returncode == 0 and "applied to" in applied.stdout, applied.stdout + applied.stderr
    patched = digests(root)
    assert "deepspeed/runtime/layer_grad_norms/adapters/zero.py" in patched
    assert patched["deepspeed/runtime/engine.py"] != before["deepspeed/runtime/engine.py"]
    again = patch_command("apply", root)
    assert again.returncode == 0 and "already applied" in again.stdout
    assert digests(root) == patched
    assert patch_command("check", root).returncode == 0
    assert patch_command("revert", root).returncode == 0
    assert digests(root) == before
    assert "not applied" in patch_command("revert", root).stdout


def test_refuses_another_release(tmp_path):
    root = copy_installed(tmp_path)
    version_file = os.path.join(root, "deepspeed", "git_version_info_installed.py")
    with open(version_file, encoding="utf-8") as handle:
        text = handle.read()
    with open(version_file, "w", encoding="utf-8") as handle:
        handle.write(text.replace("version='0.19.8'", "version='0.19.7'"))
    before = digests(root)
    result = patch_command("apply", root)
    assert result.returncode == 2
    assert "DeepSpeed 0.19.7" in result.stdout and "0.19.8" in result.stdout
    assert digests(root) == before


def test_a_failing_hunk_changes_nothing(tmp_path):
    root = copy_installed(tmp_path)
    stage_1_and_2 = os.path.join(root, "deepspeed", "runtime", "zero", "stage_1_and_2.py")
    with open(stage_1_and_2, encoding="utf-8") as handle:
        text = handle.read()
    with open(stage_1_and_2, "w", encoding="utf-8") as handle:  # a local edit where the patch has a hunk
        handle.write(text.replace("loss_scaler.update_scale(has_overflow)", "loss_scaler.update_scale(True)"))
    before = digests(root)
    result = patch_command("apply", root)
    assert result.returncode == 2 and "nothing changed" in result.stdout, result.stdout
    assert digests(root) == before  # engine.py and the rest untouched too


def test_applies_to_a_checkout_with_docs_and_unit_tests(tmp_path):
    root = copy_installed(tmp_path)
    with open(os.path.join(root, "version.txt"), "w", encoding="utf-8") as handle:
        handle.write("0.19.8\n")
    docs = os.path.join(root, DOCS_PAGE)
    os.makedirs(os.path.dirname(docs))
    page = "".join(["### Gradient Clipping\n", "\n"] + list(DOCS_ANCHOR) + ["\nEnabling ZeRO\n"])
    with open(docs, "w", encoding="utf-8") as handle:
        handle.write(page)
    before = digests(root)
    assert patch_command("apply", root).returncode == 0
    with open(docs, encoding="utf-8") as handle:
        patched_page = handle.read()
    assert "### Per-layer Gradient Statistics" in patched_page
    assert patched_page.index("layer_grad_norms") < patched_page.index("### ZeRO Optimizations")
    assert os.path.isfile(os.path.join(root, "tests", "unit", "runtime", "zero", "test_layer_grad_norms.py"))
    assert patch_command("revert", root).returncode == 0
    assert digests(root) == before


@pytest.fixture(scope="module")
def patched_copy(tmp_path_factory) -> str:
    root = copy_installed(tmp_path_factory.mktemp("patched"))
    assert patch_command("apply", root).returncode == 0
    return root


@pytest.mark.extended  # the suite runs these cases on the installed package (test_zero_stats.py); CI's extended pass
def test_core_correctness_on_the_patched_copy_without_install(patched_copy):
    """tests/test_zero_stats.py on one case per optimizer family (FAMILY_CASES), run against the patched copy
    with deepspeed_patch unimportable: every test of those cases passes, and every other case is skipped as
    not chosen."""
    env = {**os.environ, "PYTHONPATH": patched_copy, UPSTREAM_ENV: patched_copy, CASES_ENV: ",".join(FAMILY_CASES)}
    command = [sys.executable, "-m", "pytest", "-q", "-rsp", "-p", "no:cacheprovider", "tests/test_zero_stats.py"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:]
    lines = result.stdout.splitlines()
    skipped = [line for line in lines if line.startswith("SKIPPED")]
    assert skipped and all(f"among {CASES_ENV}" in line for line in skipped), skipped
    for test in ("test_pre_clip_matches_reference", "test_post_clip_is_what_the_optimizer_applied"):
        for name in FAMILY_CASES:
            assert f"PASSED tests/test_zero_stats.py::{test}[2-{name}]" in lines, f"{test}[2-{name}]"


def test_install_leaves_a_patched_deepspeed_alone(patched_copy):
    """Both at once would call every call site twice."""
    script = ("import deepspeed_patch; deepspeed_patch.install()\n"
              "from deepspeed.runtime.engine import DeepSpeedEngine\n"
              "assert DeepSpeedEngine.get_layer_grad_norms.__module__ == 'deepspeed.runtime.engine'\n"
              "assert not getattr(DeepSpeedEngine, '_layer_grad_norms_installed', False)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": patched_copy})
    assert result.returncode == 0, result.stderr[-3000:]
