"""The upstream patch, built on demand: applied and reverted cleanly by ``layer-grad-norms patch`` (which builds
what it applies), and, applied to a copy of the installed DeepSpeed, passing the core correctness tests without
``deepspeed_patch``."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Dict

import pytest
from yapf.yapflib.yapf_api import FormatCode

from deepspeed_patch.upstream.apply import RECORD
from deepspeed_patch.upstream.build import (
    DOCS_ANCHOR,
    DOCS_PAGE,
    LICENSE,
    SERIES_FACTS,
    installed_deepspeed_root,
    make_patch,
    upstream_files,
    upstream_modules,
)
from deepspeed_patch.upstream.series import committed_patch
from deepspeed_patch.upstream.series_spec import SERIES
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


def file_diffs(patch: str) -> Dict[str, str]:
    """``{path: its diff}`` of a patch."""
    return {diff.split(" ", 1)[0][2:]: "diff --git " + diff for diff in patch.split("diff --git ")[1:]}


def test_build_writes_the_patch_against_the_installed_deepspeed(tmp_path):
    """``python -m deepspeed_patch.upstream.build -o FILE``: every module that goes upstream as a new file, the call
    sites in DeepSpeed's files, the docs section at the line the series records of master's page."""
    output = tmp_path / "layer_grad_norms.patch"
    written = subprocess.run([sys.executable, "-m", "deepspeed_patch.upstream.build", "-o", str(output)],
                             capture_output=True, text=True, cwd=REPO)
    assert written.returncode == 0, written.stderr[-3000:]
    patch = output.read_text(encoding="utf-8")
    assert patch == make_patch()
    diffs = file_diffs(patch)
    modules = [path for path in diffs if path.startswith("deepspeed/runtime/layer_grad_norms/")]
    assert len(modules) == len(upstream_modules()) + 1  # and the tree's __init__.py
    assert "deepspeed/runtime/engine.py" in diffs and "new file mode" not in diffs["deepspeed/runtime/engine.py"]
    with open(SERIES_FACTS, encoding="utf-8") as handle:
        recorded = json.load(handle)["docs_line"]  # the line of master's page, where the series was generated
    assert diffs[DOCS_PAGE].split("\n")[3].startswith(f"@@ -{recorded},")


def test_new_files_follow_deepspeed_conventions():
    """DeepSpeed's license header, deepspeed.comm rather than torch.distributed, yapf with its style."""
    style = os.path.join(REPO, ".style.yapf")
    new_files = {path: text for path, (original, text) in upstream_files(installed_deepspeed_root()).items()
                 if original is None and path.endswith(".py")}
    assert len(new_files) == sum(module.endswith(".py") for module in upstream_modules()) + 2  # __init__, a test
    for path, text in new_files.items():
        assert text.startswith(LICENSE), path
        assert "torch.distributed" not in text, path
        assert FormatCode(text, style_config=style)[0] == text, f"{path}: run yapf --style .style.yapf -i"


@pytest.mark.extended  # the suite applies and reverts in test_applies_to_a_checkout_with_docs_and_unit_tests
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


@pytest.mark.extended  # the suite applies and reverts in test_applies_to_a_checkout_with_docs_and_unit_tests
def test_a_failing_hunk_changes_nothing(tmp_path):
    root = copy_installed(tmp_path)
    stray = os.path.join(root, "deepspeed", "runtime", "layer_grad_norms", "config.py")
    os.makedirs(os.path.dirname(stray))
    with open(stray, "w", encoding="utf-8") as handle:  # a file where the patch adds one
        handle.write("# not ours\n")
    before = digests(root)
    assert patch_command("check", root).returncode == 1
    result = patch_command("apply", root)
    assert result.returncode == 2 and "nothing changed" in result.stdout, result.stdout
    assert digests(root) == before  # engine.py and the rest untouched too
    assert patch_command("revert", root).returncode == 2
    assert digests(root) == before


@pytest.mark.extended  # the suite applies and reverts in test_applies_to_a_checkout_with_docs_and_unit_tests
def test_revert_takes_out_the_patch_applied(tmp_path):
    """``apply`` keeps the patch it built in the tree (``RECORD``); ``revert`` takes out that one, and refuses,
    changing nothing, once a file it patched was edited."""
    root = copy_installed(tmp_path)
    before = digests(root)
    assert patch_command("apply", root).returncode == 0
    with open(os.path.join(root, RECORD), encoding="utf-8") as handle:
        assert handle.read() == make_patch()  # the copy is the installed DeepSpeed's
    engine = os.path.join(root, "deepspeed", "runtime", "engine.py")
    with open(engine, encoding="utf-8") as handle:
        text = handle.read()
    with open(engine, "w", encoding="utf-8") as handle:  # a local edit inside a hunk of the patch
        handle.write(text.replace("layer_grad_norms.attach(self)", "layer_grad_norms.attach(self)  # edited"))
    edited = digests(root)
    assert edited != before
    assert patch_command("check", root).returncode == 1
    result = patch_command("revert", root)
    assert result.returncode == 2 and "nothing changed" in result.stdout, result.stdout
    assert digests(root) == edited
    with open(engine, "w", encoding="utf-8") as handle:
        handle.write(text)
    assert patch_command("revert", root).returncode == 0
    assert digests(root) == before


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


def install_in(root: str) -> subprocess.CompletedProcess:
    """``deepspeed_patch.install()`` in a fresh process whose ``deepspeed`` is the copy under ``root``: it checks
    that the engine was not patched, and prints the module of its ``get_layer_grad_norms`` (``None``: none)."""
    script = ("import logging; logging.basicConfig(level=logging.INFO)\n"
              "import deepspeed_patch; deepspeed_patch.install()\n"
              "from deepspeed.runtime.engine import DeepSpeedEngine\n"
              "assert not getattr(DeepSpeedEngine, '_layer_grad_norms_installed', False)\n"
              "print(getattr(getattr(DeepSpeedEngine, 'get_layer_grad_norms', None), '__module__', None))\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": root})


def test_install_leaves_a_patched_deepspeed_alone(patched_copy):
    """Both at once would call every call site twice."""
    result = install_in(patched_copy)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "deepspeed.runtime.engine", result.stdout


def test_install_leaves_a_deepspeed_with_the_seed_alone(tmp_path):
    """A DeepSpeed with PR 01 as written for it (``upstream/seed/``), its module in ``deepspeed/runtime/zero/``."""
    root = copy_installed(tmp_path)
    module = "deepspeed/runtime/zero/layer_grad_norms.py"
    with open(committed_patch(SERIES[0]), encoding="utf-8") as handle:
        diff = file_diffs(handle.read())[module]
    with open(os.path.join(root, module), "w", encoding="utf-8") as handle:
        handle.write("".join(line[1:] + "\n" for line in diff.splitlines() if line.startswith("+")
                             and not line.startswith("+++")))
    result = install_in(root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "None", result.stdout  # its engine.py, unpatched here, has none
    assert "carries layer_grad_norms already (deepspeed.runtime.zero.layer_grad_norms)" in result.stderr, result.stderr
