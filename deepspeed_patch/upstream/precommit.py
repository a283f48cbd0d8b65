"""DeepSpeed's pre-commit hooks on the files each patch of the upstream series touches, at DeepSpeed's pinned
versions, with the stored copy of their configuration in ``precommit/`` (CI cannot fetch DeepSpeed).

    python -m deepspeed_patch.upstream.precommit --tools VENV_BIN [--deepspeed CHECKOUT] [--series DIR]

``--tools``: a directory holding ``yapf``, ``flake8`` and ``codespell`` at the versions of
``precommit/requirements.txt`` (``.ci/precommit prepare`` builds it). Each patch is applied, after the ones
before it, to a scratch tree: the files it adds (whole, from the patches), and, with ``--deepspeed``, the
DeepSpeed files it changes (copied from the checkout). Without a checkout a changed file is checked by its
added lines only, with the line-based hooks (codespell, torchdist, torchcuda, whitespace). The hooks:
yapf (``--diff`` with ``style.yapf``), flake8 (``flake8.cfg``), codespell (the arguments of
``pre-commit-config.yaml``), the rules of DeepSpeed's check-license, check-torchdist and check-torchcuda
scripts, written here (their ``exclude`` patterns applied), and pre-commit-hooks' trailing-whitespace and
end-of-file-fixer.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "precommit")
SERIES_DIR = os.path.join(HERE, "series")
CODESPELL_ARGS = ("--skip=docs/Gemfile.lock,tests/unit/gpt2-merges.txt,tests/unit/gpt2-vocab.json",
                  r"--ignore-regex=\\n", "--ignore-words-list=youn,unsupport,noe,cann", "--check-filenames",
                  "--check-hidden")
LICENSED = re.compile(r"\.(py|c|cpp|cu|cc|h|hpp|cuh|hip|tr)$")


def _exclude(hook: str) -> "re.Pattern[str]":
    """The ``exclude`` pattern of a local hook, from the stored ``pre-commit-config.yaml``."""
    with open(os.path.join(CONFIG, "pre-commit-config.yaml"), encoding="utf-8") as handle:
        text = handle.read()
    found = re.search(rf"id: {hook}\n(?:.*\n)*?\s+exclude: (\S+)", text)
    if found is None:
        raise ValueError(f"pre-commit-config.yaml: no exclude of {hook}")
    return re.compile(found.group(1))


def patch_files(patch: str) -> Dict[str, Tuple[bool, List[str]]]:
    """``{path: (is new, added lines)}`` of the files a patch adds or changes (one it deletes is left out)."""
    files: Dict[str, Tuple[bool, List[str]]] = {}
    for diff in patch.split("diff --git ")[1:]:
        path = diff.split(" b/", 1)[1].split("\n", 1)[0]
        header = diff.split("@@", 1)[0]
        if "deleted file mode" in header:
            continue
        added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
        files[path] = ("new file mode" in header, added)
    return files


def _run(command: List[str], cwd: str) -> Tuple[bool, str]:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return result.returncode == 0, (result.stdout + result.stderr).strip()


LICENSE_LINES = ((re.compile(r"^(#|//) SPDX-License-Identifier: Apache-2\.0( AND BSD-3-Clause)?$", re.M),
                  "SPDX-License-Identifier: Apache-2.0"), (re.compile(r"^(#|//) DeepSpeed Team$", re.M),
                                                           "DeepSpeed Team"))
"""The header lines DeepSpeed's check-license hook requires of each new file (as a ``#`` or ``//`` comment)."""
TORCH_DISTRIBUTED = re.compile(r"torch\.distributed(?!\.nn)")
"""DeepSpeed's check-torchdist hook: communication goes through ``deepspeed.comm``."""
TORCH_CUDA = (re.compile(r"torch\.cuda"), re.compile(r"\.cuda\(\)"))
IS_CUDA = re.compile(r"\.is_cuda")
"""DeepSpeed's check-torchcuda hook: the accelerator through ``get_accelerator()``; a line marked ``#ignore-cuda``
may name ``torch.cuda``, none may call ``.cuda()``, and no Python file may test ``.is_cuda``."""


def _lines(root: str, path: str) -> List[str]:
    with open(os.path.join(root, path), encoding="utf-8") as handle:
        return handle.read().splitlines()


def _license(path: str, lines: List[str]) -> List[str]:
    text = "\n".join(lines)
    return [f"{path}: check-license: no '{name}' header line" for pattern, name in LICENSE_LINES
            if not pattern.search(text)]


def _torch_distributed(path: str, lines: List[str]) -> List[str]:
    return [f"{path}:{number}: check-torchdist: torch.distributed (use deepspeed.comm)"
            for number, line in enumerate(lines, 1) if TORCH_DISTRIBUTED.search(line)]


def _torch_cuda(path: str, lines: List[str]) -> List[str]:
    found = []
    for number, line in enumerate(lines, 1):
        if (TORCH_CUDA[0].search(line) and "#ignore-cuda" not in line) or TORCH_CUDA[1].search(line) or \
                (path.endswith(".py") and IS_CUDA.search(line)):
            found.append(f"{path}:{number}: check-torchcuda: CUDA named directly (use get_accelerator())")
    return found


def _whitespace(root: str, paths: List[str], whole: bool) -> List[str]:
    """Trailing whitespace; and, in whole files, the end of the file."""
    problems = []
    for path in paths:
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            text = handle.read()
        if any(line != line.rstrip() for line in text.splitlines()):
            problems.append(f"{path}: trailing whitespace")
        if whole and text and (not text.endswith("\n") or text.endswith("\n\n")):
            problems.append(f"{path}: the file must end with exactly one newline")
    return problems


def check_files(root: str, whole: List[str], lines_only: List[str], tools: str) -> List[str]:
    """The hooks' complaints about ``whole`` (checked as files) and ``lines_only`` (files holding only the added
    lines of a changed file), under ``root``, a git repository."""
    problems = _whitespace(root, whole, True) + _whitespace(root, lines_only, False)
    python = [path for path in whole if path.endswith(".py")]
    if python:
        ok, out = _run([os.path.join(tools, "yapf"), "--diff", "--style",
                        os.path.join(CONFIG, "style.yapf")] + python, root)
        if not ok or out:
            problems.append(f"yapf:\n{out}")
        flake8 = [os.path.join(tools, "flake8"), f"--config={os.path.join(CONFIG, 'flake8.cfg')}"]
        ok, out = _run(flake8 + python, root)
        if not ok:
            problems.append(f"flake8:\n{out}")
    every = whole + lines_only
    ok, out = _run([os.path.join(tools, "codespell"), *CODESPELL_ARGS] + every, root)
    if not ok:
        problems.append(f"codespell:\n{out}")
    licensed = [path for path in whole if LICENSED.search(path) and not path.startswith("docs/")]
    checks = ((_license, licensed),
              (_torch_distributed, [p for p in every if not _exclude("check-torchdist").match(p)]),
              (_torch_cuda, [p for p in every if not _exclude("check-torchcuda").match(p)]))
    for check, paths in checks:
        problems += [problem for path in paths for problem in check(path, _lines(root, path))]
    return problems


def _git_apply(root: str, patch_path: str, excluded: List[str]) -> None:
    options = [f"--exclude={path}" for path in excluded]
    result = subprocess.run(["git", "apply", *options, patch_path], cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{patch_path} does not apply: {result.stderr}")


def check_series(tools: str, deepspeed: Optional[str] = None, series: str = SERIES_DIR) -> Dict[str, List[str]]:
    """``{patch file: problems}`` of every patch of the series, in order."""
    patches = sorted(glob.glob(os.path.join(series, "*.patch")))
    changed = set()  # DeepSpeed's own files the series changes
    for path in patches:
        with open(path, encoding="utf-8") as handle:
            changed |= {name for name, (new, _) in patch_files(handle.read()).items() if not new}
    changed -= {name for path in patches for name, (new, _) in patch_files(_read(path)).items() if new}
    results = {}
    with tempfile.TemporaryDirectory(prefix="lgn-precommit-") as root:
        subprocess.run(["git", "init", "-q", root], check=True)
        for name in changed if deepspeed else ():
            os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
            shutil.copy(os.path.join(deepspeed, name), os.path.join(root, name))
        for path in patches:
            files = patch_files(_read(path))
            _git_apply(root, path, [] if deepspeed else sorted(changed))
            whole = [name for name in files if deepspeed or name not in changed]
            lines_only = [] if deepspeed else _added_lines_files(root, files, changed)
            subprocess.run(["git", "add", "-A"], cwd=root, check=True)
            results[os.path.basename(path)] = check_files(root, whole, lines_only, tools)
    return results


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _added_lines_files(root: str, files: Dict[str, Tuple[bool, List[str]]], changed: set) -> List[str]:
    """Without a checkout, each changed DeepSpeed file's added lines, as a file under ``added-lines/``."""
    written = []
    for name, (_, added) in files.items():
        if name in changed:
            target = f"added-lines/{name}"
            os.makedirs(os.path.dirname(os.path.join(root, target)), exist_ok=True)
            with open(os.path.join(root, target), "w", encoding="utf-8") as handle:
                handle.write("\n".join(added) + "\n")
            written.append(target)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", required=True, help="the directory holding yapf, flake8 and codespell")
    parser.add_argument("--deepspeed", help="a DeepSpeed master checkout: check changed files whole")
    parser.add_argument("--series", default=SERIES_DIR)
    args = parser.parse_args(argv)
    failed = False
    for name, problems in check_series(args.tools, args.deepspeed, args.series).items():
        print(f"{name}: {'clean' if not problems else 'FAILED'}")
        for problem in problems:
            print("  " + problem.replace("\n", "\n  "))
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
