"""Every code block of README.md and docs/*.md says what it is, and those that claim to run, run as written.

An HTML comment on the line before a fenced block (invisible on the rendered page) marks it:

- ``<!-- snippet: file PATH -->``: the block is the file PATH of this repository, byte for byte (the file runs in a
  test of its own, ``tests/test_entry_points.py`` for ``examples/quickstart.py``);
- ``<!-- snippet: run LAUNCHER[; check COMMAND] -->``: the block, written to a file, runs in an empty directory
  with ``python`` (one process) or ``deepspeed --num_gpus N`` (N CPU ranks here), and must exit 0; then COMMAND,
  run in that directory, must exit 0 too (the extended tier: each takes a minute or two on 2 cores);
- ``<!-- snippet: skip REASON -->``: it runs, but not here (a fork checkout, a GPU, the network): skipped, with REASON;
- ``<!-- snippet: fragment REASON -->`` / ``<!-- snippet: text REASON -->``: not a program (calls without their
  surroundings, a synopsis, output, a config fragment).
"""

import glob
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List

import pytest

from megatron_integration.cpu_launch import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(page, ROOT) for page in glob.glob(os.path.join(ROOT, "docs", "*.md")))
BLOCK = re.compile(r"^(?:<!-- snippet: (?P<marker>.*?) -->\n)?```(?P<info>[^\n]*)\n(?P<code>.*?)^```\s*$",
                   re.MULTILINE | re.DOTALL)
KINDS = ("file", "run", "skip", "fragment", "text")


@dataclass
class Snippet:
    page: str
    line: int
    marker: str
    code: str

    @property
    def kind(self) -> str:
        return self.marker.split(" ", 1)[0]

    @property
    def argument(self) -> str:
        return self.marker.split(" ", 1)[1] if " " in self.marker else ""

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> List[Snippet]:
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as source:
            text = source.read()
        for block in BLOCK.finditer(text):
            line = text.count("\n", 0, block.start("info")) + 1
            found.append(Snippet(page, line, block.group("marker") or "", block.group("code")))
    return found


SNIPPETS = snippets()


def of_kind(*kinds: str) -> list:
    return [pytest.param(snippet, id=snippet.name) for snippet in SNIPPETS if snippet.kind in kinds]


def test_every_block_says_what_it_is():
    unmarked = [snippet.name for snippet in SNIPPETS if snippet.kind not in KINDS or not snippet.argument]
    assert unmarked == [], f"mark these blocks with one of {KINDS} and its argument (this module's docstring)"
    assert len(SNIPPETS) >= 14 and len(of_kind("run", "file")) >= 2  # the pattern still finds the blocks


@pytest.mark.parametrize("snippet", of_kind("file"))
def test_a_file_snippet_is_the_file(snippet):
    with open(os.path.join(ROOT, snippet.argument), encoding="utf-8") as source:
        assert snippet.code == source.read()


def empty(directory: pathlib.Path) -> None:
    """Remove what a launch wrote into ``directory``: a launch again after torch's gloo exit abort starts from an
    empty folder, as the first did (a second TensorBoard run beside the first makes ``report`` ask which)."""
    shutil.rmtree(directory)
    directory.mkdir()


@pytest.mark.extended
@pytest.mark.parametrize("snippet", of_kind("run", "skip"))
def test_a_run_snippet_runs_as_written(snippet, tmp_path):
    if snippet.kind == "skip":
        pytest.skip(snippet.argument)
    launcher, _, check = snippet.argument.partition("; check ")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if launcher == "python":
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=run_dir,
                                timeout=600)
    else:
        match = re.fullmatch(r"deepspeed --num_gpus (\d+)", launcher)
        assert match, f"{snippet.name}: unknown launcher {launcher!r}"
        result = run_script(str(script), num_ranks=int(match.group(1)), timeout=600, cwd=str(run_dir),
                            before_relaunch=lambda: empty(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if check:
        checked = subprocess.run(shlex.split(check), capture_output=True, text=True, cwd=run_dir, timeout=300)
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
