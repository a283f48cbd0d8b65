"""The demo's log opened in TensorBoard, in headless Chromium: the NormFormer chart a user sees.

TensorBoard runs on a loopback port; the test reads what its page requests (``/data/runs``,
``/data/plugin/scalars/tags``, the custom-scalars layout) and what the Time Series tab draws, and
saves a screenshot of it. Chromium comes from the distribution (``apt-get install -y chromium``, done
by ``.ci/run``). Without it the screenshot test is skipped, with its reason, when it is collected (before the
module starts TensorBoard for it), unless ``REQUIRE_CHROMIUM`` is set in the environment (``.ci/run`` sets it):
then it runs and fails, naming the install command. The other tests read TensorBoard's data and need no browser.
"""

import os
import shutil
import urllib.parse

import pytest

from browser import CHROMIUM, get_json, screenshot_time_series, tensorboard
from deepspeed_patch.outputs.tags import OUTSIDE_LAYERS_ROOT, TAG_ROOT, run_name, scalar_tag
from megatron_integration.cpu_launch import launch
from megatron_integration.demo import DemoOptions, train_rank
from megatron_integration.run_scalars import GLOBAL_NORM_TAGS, LOSS_TAGS

pytestmark = pytest.mark.extended  # 19 s (TensorBoard and Chromium): CI's extended pass; tests/README.md

NUM_LAYERS, STEPS = 12, 12
SELECTED = [0, 1, 6, 10, 11]  # the demo's default: 0, 1, mid, -2, -1
OUTSIDE = ["embed", "pos_embed", "final_layernorm", "head"]  # the tiny GPT's buckets outside its layers
CARDS = [scalar_tag(phase, statistic) for phase in ("pre_clip", "post_clip") for statistic in ("norm", "min", "max")]
NORM_CARDS = {scalar_tag("post_clip", "norm"): len(SELECTED), scalar_tag("pre_clip", "norm"): len(SELECTED)}
RUN_SCALAR_CARDS = [LOSS_TAGS[0], GLOBAL_NORM_TAGS[0]]  # the demo's ``lm loss`` and ``grad-norm``, as Megatron's

REQUIRE_CHROMIUM = "REQUIRE_CHROMIUM"
"""Set (to anything but empty) where the browser test must run: CI, which installs Chromium."""
needs_chromium = pytest.mark.skipif(
    shutil.which(CHROMIUM) is None and not os.environ.get(REQUIRE_CHROMIUM),
    reason=f"{CHROMIUM} is not installed (apt-get install -y {CHROMIUM}; .ci/run installs it, and sets "
    f"{REQUIRE_CHROMIUM}=1, which makes this test fail instead of skipping)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """TensorBoard on a short run of the demo's training, with its defaults."""
    out = tmp_path_factory.mktemp("demo")
    options = DemoOptions(steps=STEPS, num_layers=NUM_LAYERS, out=str(out))
    launch(train_rank, options.world_size, options)
    with tensorboard(str(out / "tensorboard")) as url:
        yield url


def test_one_card_per_statistic_and_phase_one_run_per_selected_layer(served):
    runs = get_json(served + "data/runs")
    tags = get_json(served + "data/plugin/scalars/tags")
    layer_runs = [run_name(layer) for layer in SELECTED]
    outside_runs = [run_name(bucket) for bucket in OUTSIDE]
    assert runs[runs.index(layer_runs[0]):][:len(SELECTED)] == layer_runs  # started first: the first colours
    assert sorted(run for run in runs if run.startswith(TAG_ROOT + "/")) == sorted(layer_runs + outside_runs)
    runs_of_card = {}
    for run, run_tags in tags.items():
        for tag in run_tags:
            runs_of_card.setdefault(tag, []).append(run)
    assert {tag: sorted(runs_of_card[tag]) for tag in CARDS} == {tag: layer_runs for tag in CARDS}
    outside_cards = [scalar_tag(phase, statistic, root=OUTSIDE_LAYERS_ROOT) for phase in ("pre_clip", "post_clip")
                     for statistic in ("norm", "min", "max")]
    assert {tag: sorted(runs_of_card[tag]) for tag in outside_cards} == {tag: sorted(outside_runs)
                                                                         for tag in outside_cards}
    assert {tag: runs_of_card[tag] for tag in RUN_SCALAR_CARDS} == {tag: ["."] for tag in RUN_SCALAR_CARDS}
    assert len(runs_of_card) == len(CARDS) + len(outside_cards) + len(RUN_SCALAR_CARDS)


def test_custom_scalars_charts_gather_the_layer_runs(served):
    layout = get_json(served + "data/plugin/custom_scalars/layout")
    charts = {category["title"]: {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
              for category in layout["category"]}
    (pattern,) = charts[f"{TAG_ROOT} pre-clip"]["norm"]
    for layer in SELECTED:
        query = urllib.parse.urlencode({"run": run_name(layer), "tag": pattern})
        matched = get_json(served + "data/plugin/custom_scalars/scalars?" + query)
        assert list(matched["tag_to_events"]) == [scalar_tag("pre_clip", "norm")]
        assert [event[1] for event in matched["tag_to_events"][scalar_tag("pre_clip", "norm")]] == list(
            range(1, STEPS + 1))
    query = urllib.parse.urlencode({"run": run_name("embed"), "tag": pattern})
    assert get_json(served + "data/plugin/custom_scalars/scalars?" + query)["tag_to_events"] == {}


@needs_chromium
def test_time_series_tab_opens_on_the_norms_one_coloured_named_line_per_layer(served, tmp_path):
    from PIL import Image

    screenshot = tmp_path / "time_series.png"
    cards = screenshot_time_series(served, str(screenshot), NORM_CARDS)
    norm_cards = [card for card in cards if card["tag"] in NORM_CARDS]
    assert [card["tag"] for card in norm_cards] == list(NORM_CARDS)  # in view, after Megatron's ``grad-norm``
    assert all(card["in_view"] for card in norm_cards)
    for card in norm_cards:
        assert [row["run"] for row in card["legend"]] == [run_name(layer) for layer in SELECTED]
        colours = [row["colour"] for row in card["legend"]]
        assert len(set(colours)) == len(SELECTED)  # one colour per layer
        assert sorted(card["lines"]) == sorted(colours)  # one line per layer, in its legend colour
    image = Image.open(screenshot).convert("RGB")
    assert image.size == (1200, 1000)
    pixels = image.getcolors(image.size[0] * image.size[1])
    for colour in norm_cards[1]["lines"]:
        rgb = tuple(int(part) for part in colour[4:-1].split(","))
        assert sum(count for count, pixel in pixels if pixel == rgb) > 300, colour  # drawn, not only listed
