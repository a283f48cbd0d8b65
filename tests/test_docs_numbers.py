"""The numbers the docs quote are those the runs give: ``benchmarks/docs_numbers.py`` runs the demo four ways and
says which passage of which page states each number; every passage must be in its page (whitespace aside, the
pages wrap their lines). The runs take several minutes on 2 cores: the extended tier."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.extended
def test_every_quoted_number_is_the_runs(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "docs_numbers.py"), "--out",
                          str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=3000)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "docs_numbers.json", encoding="utf-8") as result:
        quotes = json.load(result)["quotes"]
    missing, checked = [], 0
    for page, passages in quotes.items():
        with open(os.path.join(ROOT, page), encoding="utf-8") as source:
            text = " ".join(source.read().split())
        missing += [f"{page}: {passage}" for passage in passages if " ".join(passage.split()) not in text]
        checked += len(passages)
    assert checked == 10 and missing == [], "\n".join(missing)
