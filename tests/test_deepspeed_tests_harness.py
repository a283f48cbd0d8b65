"""``deepspeed_patch.upstream.deepspeed_tests`` on a small fake DeepSpeed checkout: it applies the
patch to one copy only, injects the block in every process of the feature-on run (a spawned one
too), deselects stage-3 cases, and compares the outcomes node by node."""

import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from deepspeed_patch.upstream import deepspeed_tests
from deepspeed_patch.upstream.build import installed_deepspeed_root, make_patch
from deepspeed_patch.upstream.deepspeed_tests_report import final_outcomes, key_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.extended  # a session tool's logic, 16 s: CI's extended pass; tests/README.md

CONFIG_PY = '''\
class DeepSpeedConfig:

    def __init__(self, config):
        self._param_dict = config
        self._initialize_params(dict(config))

    def _initialize_params(self, param_dict):
        self.train_batch_size = param_dict.get("train_batch_size", 1)
'''

# what the fake patch makes of it: a reader of the block, which refuses one set-up when enabled
PATCHED_CONFIG_PY = CONFIG_PY + '''\
        self.layer_grad_norms_config = Block(param_dict.get("layer_grad_norms", {}))
        if self.layer_grad_norms_config.enabled and param_dict.get("unsupported"):
            raise RuntimeError("layer_grad_norms does not support this set-up yet")


class Block:

    def __init__(self, values):
        self.enabled = values.get("enabled", False)
'''

INIT_PY = '''\
def initialize(config):
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(config)
'''

TESTS = '''\
import multiprocessing

import pytest

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig


def test_passes():
    assert DeepSpeedConfig({"train_batch_size": 2}).train_batch_size == 2


def test_skips():
    pytest.skip("needs an accelerator")


def test_fails_everywhere():
    assert 1 == 2, "broken on this machine"


def test_unpatched_config():
    assert not hasattr(DeepSpeedConfig({}), "layer_grad_norms_config")


def test_unsupported_set_up():
    DeepSpeedConfig({"unsupported": True})


def _build_in_child(queue):
    try:
        DeepSpeedConfig({"unsupported": True})
        queue.put("")
    except RuntimeError as err:
        queue.put(str(err))


def test_unsupported_set_up_in_a_spawned_process():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_build_in_child, args=(queue,))
    child.start()
    error = queue.get(timeout=60)
    child.join()
    assert not error, error


def test_skips_when_initialize_fails():
    try:
        deepspeed.initialize({"unsupported": True})
    except Exception:
        pytest.skip("Could not initialize deepspeed")


def test_own_block_is_kept():
    DeepSpeedConfig({"layer_grad_norms": {"enabled": False}, "unsupported": True})


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_stage(zero_stage):
    assert zero_stage in (1, 2)


class TestZero3Partitioning:

    def test_it(self):
        raise AssertionError("stage 3 should have been deselected")
'''

NEW_TEST = '''\
from deepspeed.runtime.config import DeepSpeedConfig


def test_block_is_read():
    assert DeepSpeedConfig({"layer_grad_norms": {"enabled": True}}).layer_grad_norms_config.enabled
'''


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def fake_checkout(root) -> str:
    """A DeepSpeed-shaped tree: the package, version.txt, tests/ with its pytest.ini and conftest."""
    checkout = os.path.join(root, "DeepSpeed")
    write(os.path.join(checkout, "version.txt"), "0.0.1\n")
    write(os.path.join(checkout, "deepspeed", "__init__.py"), INIT_PY)
    write(os.path.join(checkout, "deepspeed", "runtime", "__init__.py"), "")
    write(os.path.join(checkout, "deepspeed", "runtime", "config.py"), CONFIG_PY)
    write(os.path.join(checkout, "tests", "pytest.ini"), "[pytest]\n")
    write(os.path.join(checkout, "tests", "conftest.py"),
          "import os, sys\nsys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))\n")
    write(os.path.join(checkout, "tests", "unit", "test_fake.py"), TESTS)
    return checkout


def file_diff(path: str, original: str, new: str) -> str:
    header = f"diff --git a/{path} b/{path}\n" + ("new file mode 100644\n" if not original else "")
    return header + "".join(
        difflib.unified_diff(original.splitlines(keepends=True), new.splitlines(keepends=True),
                             f"a/{path}" if original else "/dev/null", f"b/{path}"))


def fake_patch(root) -> str:
    """The fake feature as a git patch: the config reader changed, a new test file added."""
    patch = os.path.join(root, "fake.patch")
    write(patch, file_diff("deepspeed/runtime/config.py", CONFIG_PY, PATCHED_CONFIG_PY) +
          file_diff("tests/unit/test_new.py", "", NEW_TEST))
    return patch


def tree_digest(root: str) -> str:
    digest = hashlib.sha256()
    for folder, dirs, names in sorted(os.walk(root)):
        dirs[:] = sorted(name for name in dirs if name != "__pycache__")
        for name in sorted(names):
            with open(os.path.join(folder, name), "rb") as handle:
                digest.update(name.encode() + handle.read())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("harness"))
    checkout = fake_checkout(root)
    before = tree_digest(checkout)
    patch = fake_patch(root)
    work = os.path.join(root, "work")
    status = deepspeed_tests.main(["--deepspeed-checkout", checkout, "--patch", patch, "--work-dir", work, "--tests",
                                   "tests/unit", "tests/unit/test_new.py", "tests/unit/test_missing.py"])
    assert status == 0
    assert tree_digest(checkout) == before, "the checkout itself was changed"
    with open(os.path.join(work, "comparison.json"), encoding="utf-8") as handle:
        result = json.load(handle)
    with open(os.path.join(work, "comparison.md"), encoding="utf-8") as handle:
        result["markdown"] = handle.read()
    with open(os.path.join(work, "summary.md"), encoding="utf-8") as handle:
        result["summary"] = handle.read()
    result["work"] = work
    result["arguments"] = ["--deepspeed-checkout", checkout, "--patch", patch, "--work-dir", work]
    return result


def nodes(comparison, run: str, outcome: str):
    return {nodeid.split("::", 1)[1] for nodeid in comparison["runs"][run]["nodes"].get(outcome, [])}


def test_each_run_has_its_outcomes(comparison):
    unpatched = comparison["runs"]["unpatched"]
    assert unpatched["counts"] == {"passed": 8, "failed": 1, "skipped": 1, "deselected": 2}
    assert nodes(comparison, "unpatched", "deselected") == {"test_stage[3]", "TestZero3Partitioning::test_it"}
    assert nodes(comparison, "patched-off", "failed") == {"test_fails_everywhere", "test_unpatched_config"}
    assert nodes(comparison, "patched-on", "failed") == {
        "test_fails_everywhere", "test_unpatched_config", "test_unsupported_set_up",
        "test_unsupported_set_up_in_a_spawned_process"
    }
    assert unpatched["skip_reasons"] == {"needs an accelerator": 1}
    assert unpatched["absent"] == ["tests/unit/test_missing.py", "tests/unit/test_new.py"]
    assert comparison["runs"]["patched-on"]["absent"] == ["tests/unit/test_missing.py"]


def test_every_difference_is_listed_with_its_message(comparison):
    found = {entry["nodeid"].split("::", 1)[1]: entry for entry in comparison["differences"]}
    assert set(found) == {
        "test_unpatched_config", "test_unsupported_set_up", "test_unsupported_set_up_in_a_spawned_process",
        "test_skips_when_initialize_fails", "test_block_is_read"
    }
    assert found["test_unpatched_config"]["outcomes"] == {
        "unpatched": "passed", "patched-off": "failed", "patched-on": "failed"
    }
    assert found["test_unpatched_config"]["kind"] == "other"  # names layer_grad_norms_config, raised elsewhere
    refused = found["test_unsupported_set_up"]
    assert refused["outcomes"] == {"unpatched": "passed", "patched-off": "passed", "patched-on": "failed"}
    assert refused["kind"] == "error from layer_grad_norms"
    assert refused["key_lines"] == {"patched-on": "RuntimeError: layer_grad_norms does not support this set-up yet"}
    assert "layer_grad_norms does not support" in found["test_unsupported_set_up_in_a_spawned_process"]["messages"][
        "patched-on"]
    hidden = found["test_skips_when_initialize_fails"]
    assert hidden["outcomes"] == {"unpatched": "passed", "patched-off": "passed", "patched-on": "skipped"}
    refusal = "RuntimeError: layer_grad_norms does not support this set-up yet"
    assert hidden["initialize_raised"] == {"patched-on": [refusal]}
    assert hidden["kind"] == "error from layer_grad_norms"
    assert found["test_block_is_read"]["outcomes"]["unpatched"] == "not run"
    assert found["test_block_is_read"]["kind"] == "only in the patched tree"
    assert [entry["nodeid"].split("::", 1)[1] for entry in comparison["failing_in_every_run"]] == [
        "test_fails_everywhere"
    ]


def test_the_block_reached_the_patched_reader_in_every_process(comparison):
    site = comparison["runs"]["patched-on"]["site"]
    assert site["events"]["own block kept"] == 2  # test_own_block_is_kept, test_block_is_read
    assert site["events"]["injected"] >= 4
    assert site["enabled_seen"] >= 3
    patched_config = os.path.join(comparison["work"], "deepspeed", "deepspeed", "runtime", "config.py")
    assert site["config_files"] == [patched_config]
    assert comparison["runs"]["patched-off"]["site"]["events"] == {}
    spawned = os.path.join(comparison["work"], "runs", "patched-on", "site")
    assert len(os.listdir(spawned)) >= 2  # pytest and the spawned child
    assert comparison["valid"] and comparison["problems"] == []
    assert comparison["checkout"]["version"] == "0.0.1"


def test_each_run_imported_the_copy(comparison):
    expected = os.path.join(comparison["work"], "deepspeed", "deepspeed", "__init__.py")
    imported = {name: run["deepspeed"] for name, run in comparison["runs"].items()}
    assert imported == {name: expected for name in ("unpatched", "patched-off", "patched-on")}


def test_markdown_names_counts_and_differences(comparison):
    text = comparison["markdown"]
    assert "| unpatched | 8 | 1 | 1 | 2 |" in text
    assert "`unit/test_fake.py::test_unsupported_set_up` | passed | passed | failed" in text
    assert "## Failing in every run" in text
    assert "<details>" in text and "<details>" not in comparison["summary"]
    assert comparison["summary"] == text[:text.index("\n<details>")] + text[text.index("## Failing in every run") - 1:]


def test_compare_only_reads_the_runs_again(comparison):
    outcomes = os.path.join(comparison["work"], "runs", "unpatched", "outcomes.jsonl")
    before = os.path.getmtime(outcomes)
    assert deepspeed_tests.main(comparison["arguments"] + ["--runs"]) == 0
    assert os.path.getmtime(outcomes) == before
    with open(os.path.join(comparison["work"], "comparison.json"), encoding="utf-8") as handle:
        again = json.load(handle)
    assert again["runs"]["patched-on"]["counts"] == comparison["runs"]["patched-on"]["counts"]
    assert again["differences"] == comparison["differences"]


def test_a_patch_that_does_not_apply_stops_before_any_run(tmp_path):
    checkout = fake_checkout(str(tmp_path))
    patch = fake_patch(str(tmp_path))
    write(os.path.join(checkout, "deepspeed", "runtime", "config.py"), CONFIG_PY.replace("get(", "pop("))
    work = os.path.join(str(tmp_path), "work")
    assert deepspeed_tests.main(["--deepspeed-checkout", checkout, "--patch", patch, "--work-dir", work]) == 2
    assert not os.path.exists(os.path.join(work, "runs"))


def test_a_selection_matching_no_file_stops_before_pytest(tmp_path, capsys):
    """A node id without the checkout's tests/ prefix selects nothing: an error, not a run of every test."""
    checkout = fake_checkout(str(tmp_path))
    work = os.path.join(str(tmp_path), "work")
    argv = ["--deepspeed-checkout", checkout, "--patch", fake_patch(str(tmp_path)), "--work-dir", work,
            "--tests", "unit/test_fake.py::test_passes", "--runs", "unpatched"]
    assert deepspeed_tests.main(argv) == 2
    assert "none of the 1 selection entries exists" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(work, "runs", "unpatched", "outcomes.jsonl"))


def test_generates_the_patch_against_the_checkout(tmp_path):
    """Without --patch, the generator writes the patch against the checkout: for a copy of the
    installed DeepSpeed, the patch built against the installed one."""
    root = os.path.join(str(tmp_path), "installed")
    shutil.copytree(os.path.join(installed_deepspeed_root(), "deepspeed"), os.path.join(root, "deepspeed"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    output = os.path.join(str(tmp_path), "generated.patch")
    deepspeed_tests.generate_patch(root, output)
    with open(output, encoding="utf-8") as generated:
        assert generated.read() == make_patch()


def test_final_outcome_of_setup_call_and_teardown():
    def record(nodeid, when, outcome, message=""):
        return {"nodeid": nodeid, "when": when, "outcome": outcome, "message": message, "duration": 1.0}

    outcomes = final_outcomes([
        record("a", "setup", "passed"), record("a", "call", "passed"), record("a", "teardown", "failed", "E  boom"),
        record("b", "setup", "failed", "fixture"), record("b", "teardown", "passed"),
        record("c", "setup", "passed"),
        record("d", "setup", "passed"), record("d", "call", "skipped", "no GPU"), record("d", "teardown", "passed"),
        {"session": True, "exitstatus": 1, "deepspeed": None}
    ])
    assert {nodeid: node.outcome for nodeid, node in outcomes.items()} == {
        "a": "error", "b": "error", "c": "not finished", "d": "skipped"
    }
    assert outcomes["a"].duration == 3.0 and outcomes["a"].message == "E  boom"
    assert key_line("Traceback\n  x = 1\nE   ValueError: bad\nE   second\n") == "second"


def test_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "deepspeed_patch.upstream.deepspeed_tests", "--help"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0 and "--deepspeed-checkout" in result.stdout
