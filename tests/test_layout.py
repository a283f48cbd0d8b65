"""docs/layout.md's account of one measured step is true: the package's files whose functions a traced ZeRO-2
step runs are exactly the files the doc's tables name, for the plain step, with the optimizer's statistics and
the flight recorder, and with both remedies acting."""

import os
import re
from functools import lru_cache
from typing import Dict, List

from layout_workers import VARIANTS, trace_measured_steps
from megatron_integration.cpu_launch import launch

LAYOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "layout.md")
SECTIONS = {
    "plain": "### The files of a measured step",
    "optimizer_statistics_and_recorder": "### The files optimizer_statistics and the recorder add",
    "remedies": "### The files the remedies add",
}
"""The heading of each variant's table in docs/layout.md; the second lists only the files the first lacks."""


@lru_cache(maxsize=None)
def traced() -> Dict:
    return launch(trace_measured_steps, 1)[0]


def section_files(heading: str, pattern: str) -> List[str]:
    """The package files that ``pattern`` (one group: the path) finds in the section under ``heading``, up to the
    next heading."""
    text = open(LAYOUT).read()
    assert heading in text, f"docs/layout.md has no section {heading!r}"
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    return sorted("deepspeed_patch/" + name for name in re.findall(pattern, section, re.M))


def documented_files(heading: str) -> List[str]:
    """The package files named in the first column of the table under ``heading``."""
    return section_files(heading, r"^\| `([\w/]+\.py)` \|")


def files_not_run(heading: str) -> List[str]:
    """The package files the section under ``heading`` says its step does not run (lines ``Not run: `x.py` ...``)."""
    return section_files(heading, r"^Not run: `([\w/]+\.py)`")


def test_the_doc_names_exactly_the_files_a_traced_measured_step_runs():
    assert set(traced()) == set(VARIANTS) == set(SECTIONS)
    plain = documented_files(SECTIONS["plain"])
    assert traced()["plain"]["files"] == plain
    for variant in VARIANTS:
        assert traced()[variant]["measured_step"] == 3, variant
        added = documented_files(SECTIONS[variant]) if variant != "plain" else []
        not_run = files_not_run(SECTIONS[variant])
        assert set(not_run) <= set(plain), variant
        assert traced()[variant]["files"] == sorted(set(plain + added) - set(not_run)), variant
    assert files_not_run(SECTIONS["remedies"]) == ["deepspeed_patch/statistics/kernels.py"]
    # the traced remedy step acted: adaptive factors applied, skip_step judged it (and did not skip it)
    assert [traced()["remedies"][key] for key in ("factors_applied", "skipped")] == [True, False]
    assert [traced()["plain"][key] for key in ("factors_applied", "skipped")] == [False, None]
    assert len(plain) == 16 and len(documented_files(SECTIONS["remedies"])) == 5


def test_the_map_names_every_docs_page():
    """The map's ``docs/`` entry names every page under docs/ (a folder of pages by its name), this map aside."""
    text = open(LAYOUT).read()
    entry = text.split("\ndocs/", 1)[1].split("```", 1)[0]
    docs = os.path.dirname(LAYOUT)
    pages = [name for name in sorted(os.listdir(docs)) if name.endswith(".md") and name != "layout.md"]
    folders = [f"{name}/" for name in sorted(os.listdir(docs))
               if os.path.isdir(os.path.join(docs, name)) and any(
                   page.endswith(".md") for _, _, names in os.walk(os.path.join(docs, name)) for page in names)]
    missing = [name for name in pages + folders if name not in entry]
    assert len(pages) == 9 and folders == ["megatron_e2e/"] and missing == [], missing
