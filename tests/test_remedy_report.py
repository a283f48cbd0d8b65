"""``report``'s remedy section and ``plot``'s markers and factor panel, on logs of known remedies written as each
writer writes them (the JSONL dump, the Megatron hook's runs, DeepSpeed's monitor, the Trainer's ``log_history``);
the real demo with ``--remedy`` (``demo`` through the CLI) in the extended tier."""

import json
from typing import Dict, List, Optional

import pytest
from test_plot_report import write_source

from megatron_integration.cli import main
from megatron_integration.plot import plot_run
from megatron_integration.remedy_report import SKIPPED_GID

STEPS = 12
WARMUP = 3
BUCKETS = [0, 1, 2, 3, "embedding"]
CLIPPED = {(6, 2): 0.5, (8, 2): 0.25, (10, 3): 0.9, (11, "embedding"): 0.8}
"""(step, bucket): a factor below 1; every other bucket's factor after the warm-up is 1."""
SKIPPED = {5: "grad norm 9 > mean 1 + 6 x std 0.1", 9: "loss 12 > mean 3 + 6 x std 0.2"}
EXPECTED_CLIPPED = {  # lowest first
    "layer02": {"steps": 2, "lowest": 0.25, "lowest_step": 8, "median": 0.375},
    "embedding": {"steps": 1, "lowest": 0.8, "lowest_step": 11, "median": 0.8},
    "layer03": {"steps": 1, "lowest": 0.9, "lowest_step": 10, "median": 0.9},
}
SOURCES = ["dump", "one run per bucket", "DeepSpeed monitor", "CSV", "trainer_state"]


def known_result(step: int) -> Dict:
    """A step's result with both remedies on: skipped at ``SKIPPED``'s steps (no factors then), the factors of
    ``CLIPPED`` after the warm-up."""
    norms = {bucket: {"norm": 1.0, "min": -0.1, "max": 0.1} for bucket in BUCKETS}
    skipped = step in SKIPPED
    factors = None if skipped or step <= WARMUP else {bucket: CLIPPED.get((step, bucket), 1.0) for bucket in BUCKETS}
    return {"step": step, "overflow": False, "clip_coef": None if skipped else 1.0, "pre_clip": norms,
            "post_clip": None if skipped else norms, "skipped": skipped, "skip_reason": SKIPPED.get(step),
            "adaptive_clip": factors}


@pytest.fixture(params=SOURCES)
def known_source(request, tmp_path):
    return request.param, write_source(str(tmp_path), [known_result(step) for step in range(1, STEPS + 1)],
                                       request.param)


def test_report_json_carries_the_skipped_steps_and_the_clipped_buckets(known_source, capsys):
    source, path = known_source
    main(["report", path, "--json"])
    remedies = json.loads(capsys.readouterr().out)["remedies"]
    reason = SKIPPED.get if source == "dump" else lambda step: None  # only the dump keeps the reason
    assert remedies["skip_step"] == {"judged_steps": STEPS,
                                     "skipped": [{"step": step, "reason": reason(step)} for step in SKIPPED]}
    adaptive = remedies["adaptive_clipping"]
    assert (adaptive["steps"], adaptive["buckets"]) == (STEPS - WARMUP - len(SKIPPED), len(BUCKETS))
    assert list(adaptive["clipped"]) == list(EXPECTED_CLIPPED)
    for label, expected in EXPECTED_CLIPPED.items():
        found = adaptive["clipped"][label]
        assert found == pytest.approx(expected, rel=1e-6), label


def test_report_text_shows_the_remedy_section(tmp_path, capsys):
    path = write_source(str(tmp_path), [known_result(step) for step in range(1, STEPS + 1)], "dump")
    main(["report", path])
    lines = capsys.readouterr().out.splitlines()
    section = lines[lines.index("remedies:"):]
    assert section == [
        "remedies:",
        f"  skip_step: 2 of {STEPS} judged steps skipped",
        f"    step 5: {SKIPPED[5]}",
        f"    step 9: {SKIPPED[9]}",
        "  adaptive_clipping: 3 of 5 buckets clipped (factor below 1) over 7 steps after the warm-up, lowest first:",
        "    layer02: 2 steps, lowest 0.25 (step 8), median 0.375",
        "    embedding: 1 steps, lowest 0.8 (step 11), median 0.8",
        "    layer03: 1 steps, lowest 0.9 (step 10), median 0.9",
    ]


def test_a_log_without_remedies_has_no_remedy_section(tmp_path, capsys):
    results = [{key: value for key, value in known_result(step).items()
                if key not in ("skipped", "skip_reason", "adaptive_clip")} for step in range(1, STEPS + 1)]
    main(["report", write_source(str(tmp_path), results, "one run per bucket"), "--json"])
    assert "remedies" not in json.loads(capsys.readouterr().out)


def skipped_markers(axis) -> List[float]:
    return [line.get_xdata()[0] for line in axis.get_lines() if line.get_gid() == SKIPPED_GID]


def test_plot_marks_the_skipped_steps_and_draws_the_factors(known_source, tmp_path):
    _, path = known_source
    figure = plot_run(path, str(tmp_path / "figure.png"))
    pre, post, _, factors = figure.axes[:4]
    for axis in (pre, post, factors):
        assert sorted(skipped_markers(axis)) == sorted(SKIPPED), axis.get_title()
    drawn = {line.get_label(): dict(zip(line.get_xdata(), line.get_ydata())) for line in factors.get_lines()
             if line.get_gid() != SKIPPED_GID and not line.get_label().startswith("_")}
    assert list(drawn)[:3] == list(EXPECTED_CLIPPED)  # lowest first
    assert drawn["layer02"][8] == 0.25 and len(drawn["layer02"]) == STEPS - WARMUP - len(SKIPPED)


def demo_remedies(tmp_path, capsys, *flags: str) -> Optional[Dict]:
    """The remedy section of the demo run with ``flags``, as ``report --json`` gives it from the demo's dump."""
    main(["demo", "--steps", "30", "--num-layers", "4", "--hidden", "16", "--out", str(tmp_path), *flags])
    output = capsys.readouterr().out
    assert "remedies:" in output
    main(["report", str(tmp_path / "layer_grad_norms.jsonl"), "--json"])
    return json.loads(capsys.readouterr().out).get("remedies")


@pytest.mark.extended
def test_demo_remedy_skip_skips_the_injected_spike(tmp_path, capsys):
    """A gradient spike at step 25 (30x the global norm, on layer 1), after skip_step's window of 20 has filled: the
    one skipped step, with the rule's reason; the figure marks it."""
    remedies = demo_remedies(tmp_path, capsys, "--remedy", "skip", "--spike", "25:1")
    assert list(remedies) == ["skip_step"]
    (skipped, ) = remedies["skip_step"]["skipped"]
    assert skipped["step"] == 25 and skipped["reason"].startswith("grad norm "), skipped
    assert remedies["skip_step"]["judged_steps"] == 30
    figure = plot_run(str(tmp_path / "tensorboard"), str(tmp_path / "again.png"))
    assert skipped_markers(figure.axes[0]) == [25]


@pytest.mark.extended
def test_demo_remedy_adaptive_reports_the_factors(tmp_path, capsys):
    """AdaGC after the demo's warm-up of 20 steps: factors on the 10 steps after it, for every bucket; those below
    1 are the section's (AdaGC's warm-up average is the smallest norm seen, so some bucket is clipped)."""
    remedies = demo_remedies(tmp_path, capsys, "--remedy", "adaptive")
    adaptive = remedies["adaptive_clipping"]
    assert adaptive["steps"] == 10 and adaptive["buckets"] == 8  # 4 layers, 2 embeddings, the final norm, the head
    assert adaptive["clipped"], adaptive
    assert all(0 < entry["lowest"] < 1 and entry["steps"] >= 1 for entry in adaptive["clipped"].values())
    figure = plot_run(str(tmp_path / "tensorboard"), str(tmp_path / "again.png"))
    assert figure.axes[3].get_title().startswith("adaptive clipping")
