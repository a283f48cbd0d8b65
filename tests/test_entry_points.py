"""What a user runs: the demo through the CLI, the README's quick-start through DeepSpeed's launcher."""

import json
import os
import subprocess

import pytest

from megatron_integration.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_end_to_end(tmp_path, capsys):
    main(["demo", "--steps", "6", "--num-layers", "4", "--hidden", "16", "--out", str(tmp_path)])
    output = capsys.readouterr().out
    assert "early/late ratio (layers 0,1 vs -2,-1)" in output
    records = [json.loads(line) for line in (tmp_path / "layer_grad_norms.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(1, 7))
    # 4 layers: 0, 1, mid = 2, -2 = 2, -1 = 3
    assert sorted(key for key in records[-1]["pre_clip"] if key.isdigit()) == ["0", "1", "2", "3"]


def test_demo_rejects_a_bad_layer_spec(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--layers", "0,first"])
    assert "'first' is not a layer index or 'mid'" in capsys.readouterr().err


def test_readme_quickstart_runs_on_two_ranks():
    result = subprocess.run(["deepspeed", "--num_gpus", "2", os.path.join(ROOT, "examples", "quickstart.py")],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 3 clip_coef" in result.stdout
    assert "  head  norm" in result.stdout
