"""The upstream series (deepspeed_patch/upstream/series/): current with the package, small, with a PR text each,
free of what belongs to the package only, clean under DeepSpeed's pre-commit hooks, and, applied whole to a
copy of the installed DeepSpeed, passing the core correctness tests without ``deepspeed_patch``."""

import ast
import glob
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from deepspeed_patch.upstream import precommit, series
from deepspeed_patch.upstream.build import installed_deepspeed_root
from deepspeed_patch.upstream.series_spec import SERIES
from deepspeed_patch.upstream.source_edit import (
    COLUMN_LIMIT,
    Cut,
    StaleCut,
    apply_cut,
    drop_unused,
    import_line,
    module_level_names,
    resolve_capabilities,
)
from megatron_integration.cpu_launch import free_port
from series_workers import COMPARED, RUNS, TRIGGER_RUNS
from zero_workers import CASES_ENV, FAMILY_CASES, UPSTREAM_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = sorted(glob.glob(os.path.join(series.SERIES_DIR, "*.patch")))
VENVS = os.environ.get("LGN_RELEASE_VENVS", os.path.expanduser("~/.cache/layer-grad-norms/venvs"))
PRECOMMIT_TOOLS = os.path.join(VENVS, "precommit", "bin")  # .ci/precommit prepare builds it
# tests/test_zero_stats.py's 2-rank cases that the tree after patch 02 must pass: DeepSpeedZeroOptimizer, stages 1, 2
CORE_PATCH_CASES = ("z1_fp16_overflow_gas2", "z2_fp16_clip", "z2_bf16_clip", "z2_fp32_clip_groups")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def test_one_small_patch_with_its_pr_text_per_pull_request():
    assert [os.path.basename(path) for path in PATCHES] == [f"{request.file_name}.patch" for request in SERIES]
    assert len(PATCHES) == 12
    for request, path in zip(SERIES, PATCHES):
        assert series.added_lines(_read(path)) <= series.CAPS.get(request.number, series.MAX_ADDED_LINES), path
        text = _read(path[:-len(".patch")] + ".md")
        assert "all-reduce" in text and "Tests" in text, path
        python = _added_python_lines(_read(path))
        assert [line for line in python if len(line) > COLUMN_LIMIT] == [], path  # DeepSpeed's line length, cut or not
        assert [line for line in python if PACKAGE_CITATION.search(line)] == [], path  # nothing DeepSpeed lacks
    # PR 01, written for DeepSpeed, within issue 47's 600 lines; only PR 02, onto the package's core, past the cap
    assert series.CAPS["01"] == 600 and [number for number, cap in series.CAPS.items() if cap > 1000] == ["02"]
    assert [request.number for request in SERIES if request.written_by_hand] == ["01"]


PACKAGE_CITATION = re.compile(r"Capabilities\.|upstream/|docs/\w|``plot``|``report``|plain\.py|hf\.py|tags\.py")
"""What the package's texts may cite of the package itself (its release table, bug reports, pages, commands and
package-only modules), and no added line upstream may."""


def _added_python_lines(patch: str) -> List[str]:
    """The lines a patch adds to Python files."""
    lines, python = [], False
    for line in patch.splitlines():
        if line.startswith("+++ "):
            python = line.endswith(".py")
        elif line.startswith("+") and python:
            lines.append(line[1:])
    return lines


def test_the_docs_quote_each_patchs_added_lines():
    """docs/upstream.md's table of the series: each patch's added lines, as the committed patch has them."""
    page = _read(os.path.join(REPO, "docs", "upstream.md"))
    quoted = dict(re.findall(r"^\| `(\d\d-[\w-]+)` \| (\d+) \|", page, re.M))
    committed = {request.file_name: str(series.added_lines(_read(path))) for request, path in zip(SERIES, PATCHES)}
    assert len(committed) == 12 and quoted == committed


NOT_A_MODULE_NAME = {"bf16": "a dtype every family reads, besides ``adapters/bf16.py``"}


def test_no_patch_names_a_module_a_later_one_adds():
    """A reviewer reads each pull request alone: its added lines name no module that a later one adds (``trigger``,
    ``control file``, ``skip_step``; a call or a definition of a function of the same name, ``skip_step(``, is not
    one), so that no docstring points at code the reviewer cannot see. PR 01, written for DeepSpeed before the
    sub-package exists, is left out: its words (``config``, ``statistics``) are DeepSpeed's, not module names."""
    named = []
    checked = 0
    for position, (request, path) in enumerate(zip(SERIES, PATCHES)):
        if request.written_by_hand:
            continue
        added = [line for line in _read(path).splitlines() if line.startswith("+") and not line.startswith("+++")]
        for later in SERIES[position + 1:]:
            for module in later.modules:
                stem = os.path.basename(module).removesuffix(".py")
                word = os.path.dirname(module) if stem == "__init__" else stem
                if not module.endswith(".py") or word in NOT_A_MODULE_NAME:
                    continue
                pattern = re.compile(r"\b" + word.replace("_", "[_ ]") + r"\b(?!\()", re.I)
                named += [(request.number, later.number, line) for line in added if pattern.search(line)]
                checked += 1
    assert checked > 100 and not named, named


def _new_files(upto: int, root: str) -> Dict[str, str]:
    """The files patches 1..``upto`` add, as ``git apply`` leaves them (DeepSpeed's own files left out)."""
    files = [precommit.patch_files(_read(path)) for path in PATCHES]
    added = {name for patch in files for name, (new, _) in patch.items() if new}
    changed = {name for patch in files for name in patch} - added
    subprocess.run(["git", "init", "-q", root], check=True)
    for path in PATCHES[:upto]:
        excluded = [f"--exclude={name}" for name in sorted(changed)]
        subprocess.run(["git", "apply", *excluded, path], cwd=root, check=True)
    found = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [name for name in dirs if name != ".git"]
        for name in names:
            found[os.path.relpath(os.path.join(folder, name), root)] = _read(os.path.join(folder, name))
    return found


def test_the_series_own_files_import_what_their_tree_defines(tmp_path):
    """The DeepSpeed-style tests and the op builder the series adds (``series_tree/``, written by hand) import
    names of the feature's modules; after the patch that adds each, those modules must define them. The package's
    tests cannot see a stale name there (patch 10's op test imported two names renamed in the package)."""
    checked, missing = 0, []
    for upto, path in enumerate(PATCHES, start=1):
        own = [name for name in precommit.patch_files(_read(path))
               if name.endswith(".py") and name.startswith(("tests/", "op_builder/"))]
        if not own:
            continue
        tree = _new_files(upto, str(tmp_path / str(upto)))
        for name in own:
            for node in ast.walk(ast.parse(tree[name])):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed.runtime.layer_grad"):
                    module = tree[node.module.replace(".", "/") + ".py"]
                    for alias in node.names:
                        checked += 1
                        if alias.name not in module_level_names(module):
                            missing.append((upto, name, node.module, alias.name))
    assert checked >= 8 and not missing, missing  # 8 names today: 1 in patch 02's test, 7 in patch 10's


@pytest.mark.parametrize("upto", [pytest.param(2, marks=pytest.mark.extended), len(SERIES)])
def test_committed_series_carries_the_current_package(tmp_path, upto):
    """The series is generated against a master checkout (CI has none, so its call-site and docs hunks are checked
    in a session: git apply --check); here, every file it adds after the first ``upto`` patches must be what the
    generator writes today from the package, with master's recorded capabilities facts."""
    facts = json.loads(_read(os.path.join(series.SERIES_DIR, series.FACTS_FILE)))["facts"]
    expected = {}
    for name, text in series.stage_texts(series.full_texts(facts), upto).items():
        if name.startswith("tree:"):
            expected[name[5:]] = text
        elif name != series.DOCS_KEY:
            expected[series.deepspeed_path(name)] = text
    committed = _new_files(upto, str(tmp_path))
    assert committed.keys() == expected.keys()
    stale = [path for path in expected if committed[path] != expected[path]]
    assert not stale, f"stale series, run python -m deepspeed_patch.upstream.series --deepspeed MASTER: {stale}"


def test_only_what_belongs_in_deepspeed(tmp_path):
    added = _new_files(len(PATCHES), str(tmp_path))
    modules = {path for path in added if path.startswith(series.UPSTREAM_PACKAGE)}
    package_only = ("capabilities.py", "plain.py", "tags.py", "hooks.py", "patching.py", "hf.py", "hf_readers.py")
    package = os.path.join(REPO, "deepspeed_patch")
    expected = set()  # every Python file of the package on disk but the package-only ones, where it goes upstream
    for folder, dirs, names in os.walk(package):
        dirs[:] = [name for name in dirs if name not in ("upstream", "__pycache__")]
        relative = os.path.relpath(folder, package).replace(os.sep, "/").replace(".", "")
        expected |= {f"{series.UPSTREAM_PACKAGE}/{relative}/{name}".replace("//", "/") for name in names
                     if name.endswith(".py") and name not in package_only}
    assert modules == expected
    for path, text in added.items():
        assert "deepspeed_patch" not in text and "megatron_integration" not in text, path
        assert "capabilities" not in text, path
        if path.endswith(".py"):
            sources = [(node.module, node.level) for node in ast.parse(text).body if isinstance(node, ast.ImportFrom)]
            assert len(sources) == len(set(sources)), path  # one import per module: the inlined ones joined
    config = added[f"{series.UPSTREAM_PACKAGE}/config.py"]
    assert "misspelling" not in config and "difflib" not in config  # no refusal of keys without the block


def test_an_import_past_the_column_limit_is_parenthesized_for_yapf_to_wrap():
    long = ast.parse("from .refusals import " + ", ".join(f"check_{index:02}" for index in range(12))).body[0]
    short = ast.parse("from .refusals import check_00, check_01").body[0]
    assert import_line(long).startswith("from .refusals import (check_00, ") and import_line(long).endswith("1)\n")
    assert import_line(short) == "from .refusals import check_00, check_01\n"


def test_inlined_imports_join_the_modules_own():
    """An inlined definition's ``from typing import ...`` joins the module's own; a name bound already goes."""
    text = "import weakref\nfrom typing import Optional\n\nfrom typing import Dict, Optional\nimport weakref\nX = 1\n"
    assert series._dedupe_imports(text) == "import weakref\nfrom typing import Dict, Optional\n\nX = 1\n"


@pytest.mark.extended  # CI's .ci/precommit test runs the same check on every run
@pytest.mark.skipif(not os.path.isfile(os.path.join(PRECOMMIT_TOOLS, "flake8")),
                    reason="the pre-commit tools' environment is not prepared (.ci/precommit prepare; CI does)")
def test_every_patch_passes_deepspeeds_precommit_hooks(tmp_path):
    results = precommit.check_series(PRECOMMIT_TOOLS)
    assert list(results) == [os.path.basename(path) for path in PATCHES]
    assert all(not problems for problems in results.values()), results
    bad = tmp_path / "01-bad.patch"  # the check itself: a misspelling, torch.distributed, no license
    bad.write_text("diff --git a/deepspeed/x.py b/deepspeed/x.py\nnew file mode 100644\n--- /dev/null\n"
                   "+++ b/deepspeed/x.py\n@@ -0,0 +1,2 @@\n+import torch.distributed as dist\n"
                   "+x = 1  # recieve  \n")
    problems = precommit.check_series(PRECOMMIT_TOOLS, series=str(tmp_path))["01-bad.patch"]
    text = "\n".join(problems)
    for hook in ("trailing whitespace", "codespell", "check-license", "check-torchdist"):
        assert hook in text, text


def test_capabilities_are_folded_and_cuts_fail_loudly():
    source = ("def f(self, x):\n    if self.capabilities.new:\n        return x\n    else:\n        return -x\n\n\n"
              "def g(self, x):\n    return self.capabilities.old and bool(x)\n")
    assert resolve_capabilities(source, {"new": True, "old": False}) == (
        "def f(self, x):\n    return x\n\n\ndef g(self, x):\n    return False\n")
    assert resolve_capabilities(source, {"new": False, "old": True}) == (
        "def f(self, x):\n    return -x\n\n\ndef g(self, x):\n    return bool(x)\n")
    table = 'SUPPORTED = {"a": capabilities.old, "b": capabilities.new}\nBLOCK = {"enabled": False, "interval": 1}\n'
    assert resolve_capabilities(table, {"new": True, "old": False}) == (
        'SUPPORTED = {"b": True}\nBLOCK = {"enabled": False, "interval": 1}\n')  # data's False is no fact
    with pytest.raises(StaleCut, match="nothing defines 'h'"):
        apply_cut(source, Cut("m.py", drop=("h", )))
    cut = apply_cut("import os\nimport re\n\n\ndef _used():\n    return re\n\n\ndef f():\n    return 1\n",
                    Cut("m.py", statements=(("", r"^def f"), )))
    assert drop_unused(cut).strip() == ""


def test_an_unwrapped_guard_leaves_its_body_and_a_stale_one_fails_loudly():
    source = ("def f(m):\n    a = 1\n    with m.guarded('read'):  # never into training\n        b = 2\n"
              "        if b:\n            a = b\n    try:\n        m.write(a)\n    except Exception:\n"
              "        m.off()\n    return a\n")
    unwrapped = apply_cut(source, Cut("m.py", unwrap=(("f", r"with m\.guarded"), ("f", r"try:"))))
    assert unwrapped == "def f(m):\n    a = 1\n    b = 2\n    if b:\n        a = b\n    m.write(a)\n    return a\n"
    with pytest.raises(StaleCut, match="no with or try statement in 'f'"):
        apply_cut(unwrapped, Cut("m.py", unwrap=(("f", r"with m\.guarded"), )))
    with pytest.raises(StaleCut, match="has an else or a finally to keep"):
        apply_cut("def f(m):\n    try:\n        m.write()\n    finally:\n        m.close()\n",
                  Cut("m.py", unwrap=(("f", r"try:"), )))


def _installed_layout(patch: str) -> str:
    """``patch`` with DeepSpeed's ``op_builder/`` and ``csrc/`` where an installed DeepSpeed keeps them."""
    moved = r"diff --git a/deepspeed/ops/\1 b/deepspeed/ops/\1"
    patch = re.sub(r"(?m)^diff --git a/((?:op_builder|csrc)/\S+) b/\1$", moved, patch)
    return re.sub(r"(?m)^(--- a/|\+\+\+ b/)((?:op_builder|csrc)/)", r"\1deepspeed/ops/\2", patch)


def _patched_copy(root, upto: Optional[int] = None) -> str:
    """A copy of the installed DeepSpeed with the series (its first ``upto`` patches), generated against it,
    applied."""
    shutil.copytree(os.path.join(installed_deepspeed_root(), "deepspeed"), os.path.join(root, "deepspeed"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for request, patch in series.make_series(str(root), upto):
        path = os.path.join(root, f"{request.file_name}.patch")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(_installed_layout(patch))
        subprocess.run(["git", "apply", "--include=deepspeed/*", path], cwd=root, check=True)
    return str(root)


def _zero_stats_pass_on(root: str, cases: Tuple[str, ...]) -> None:
    """tests/test_zero_stats.py's 2-rank ``cases`` pass against the DeepSpeed under ``root``, with deepspeed_patch
    unimportable: the same checks against the plain-PyTorch reference that the package passes."""
    env = {**os.environ, "PYTHONPATH": root, UPSTREAM_ENV: root, CASES_ENV: ",".join(cases)}
    command = [sys.executable, "-m", "pytest", "-q", "-rfEp", "-p", "no:cacheprovider", "tests/test_zero_stats.py"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=1500)
    lines = result.stdout.splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    assert result.returncode == 0 and not failed, "\n".join(failed) + result.stdout[-3000:]
    checked = 0
    for test in ("test_pre_clip_matches_reference", "test_post_clip_is_what_the_optimizer_applied"):
        for name in cases:
            assert f"PASSED tests/test_zero_stats.py::{test}[2-{name}]" in lines, f"{test}[2-{name}]"
            checked += 1
    assert checked == 2 * len(cases)


@pytest.mark.extended
def test_whole_series_gives_the_packages_results(tmp_path):
    """One case per optimizer family, against the whole series applied to the installed DeepSpeed (generated
    against it: its call sites and capabilities facts are 0.19.8's)."""
    _zero_stats_pass_on(_patched_copy(tmp_path), FAMILY_CASES)


@pytest.mark.extended
def test_the_core_alone_gives_exact_zero12_statistics(tmp_path):
    """The series up to patch 02 (the package's core) applied to the installed DeepSpeed, which PR 01's call-site
    hunks do not fit (it is left out: ``make_series``; ``tests/test_seed_compare.py`` runs its module there): ZeRO-1
    and ZeRO-2 in fp16 (an overflow step, gradient accumulation, a loss-scale growth step, clipping), bf16 and fp32
    (clipping, two parameter groups), training unchanged with the block off where the case compares. Then what the
    tree up to patch 03 (the failure latch) does otherwise than the package (``tests/core_patch_workers.py``): an
    encoder-decoder refused by name, a raising monitor written once."""
    assert [request.number for request, _ in series.make_series(installed_deepspeed_root(), upto=3)] == ["02", "03"]
    _zero_stats_pass_on(_patched_copy(tmp_path / "core", upto=2), CORE_PATCH_CASES)
    root = _patched_copy(tmp_path / "latch", upto=3)
    env = {**os.environ, "PYTHONPATH": root, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    command = [sys.executable, os.path.join(REPO, "tests", "core_patch_workers.py")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["refusal"].startswith("UnsupportedSetupError: layer_grad_norms: the transformer layers lie in several "
                                      "stacks (['decoder.layers.', 'encoder.layers.'])"), seen["refusal"]
    assert seen["monitor"]["writer"] == "deepspeed.runtime.layer_grad_norms.outputs.monitor", seen["monitor"]
    assert seen["monitor"]["calls"] == 1 and seen["monitor"]["events"] > 0, seen["monitor"]
    assert seen["monitor"]["step"] == 3 and seen["monitor"]["buckets"] == [0, 1], seen["monitor"]


def _series_runs(tmp_path, name: str, env: Dict[str, str]) -> dict:
    """``series_workers``' runs in a process of their own, with ``env``; what they recorded."""
    output = tmp_path / f"{name}.pkl"
    command = [sys.executable, os.path.join(REPO, "tests", "series_workers.py"), str(output)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, **env},
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    with open(output, "rb") as handle:
        return pickle.load(handle)


@pytest.mark.extended
def test_whole_series_gives_the_same_result_dicts_as_the_package(tmp_path):
    """The same small runs (ZeRO-1 with accumulation, ZeRO-2 fp16 with an overflow and clipping, ZeRO-3,
    BF16_Optimizer, optimizer statistics, the trigger and flight recorder with a fired spike) with the package on
    the installed DeepSpeed and with the whole series applied to a copy of it: every step's result dict, the
    recorder's history and fires, DeepSpeed's global norm and the final weights, bit for bit."""
    root = _patched_copy(tmp_path / "deepspeed-series")
    package = _series_runs(tmp_path, "package", {"PYTHONPATH": REPO})
    upstream = _series_runs(tmp_path, "series", {"PYTHONPATH": os.pathsep.join([root, REPO]), UPSTREAM_ENV: root})
    assert package.keys() == upstream.keys() == set(RUNS) | set(TRIGGER_RUNS)
    checked = 0
    for name, record in package.items():
        assert "error" not in record and "error" not in upstream[name], (record.get("error"), upstream[name])
        for key in COMPARED:
            if key == "final":
                assert record[key].keys() == upstream[name][key].keys()
                assert all(torch.equal(value, upstream[name][key][param]) for param, value in record[key].items())
            elif key in record:
                assert repr(upstream[name][key]) == repr(record[key]), (name, key)  # repr: floats bit for bit
            checked += key in record
    assert checked == len(RUNS) * 3 + len(TRIGGER_RUNS) * 4  # the recorder runs keep no global norm
