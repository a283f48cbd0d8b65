"""TensorBoard on a loopback port, and headless Chromium driving its page: what a user sees.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``): no debugging
port, no extra package. The page is opened with TensorBoard's own ``forceSVG`` flag: its default
renderer draws the lines with WebGL in a worker, which headless Chromium (software GL) delivers some
time after the rest of the page, so a screenshot catches some cards with their axes and values but no
line; drawn as SVG, the lines are in the page as soon as the cards are, and can be checked.

Run as a script to redraw the README's screenshot of the demo's log:

    python tests/browser.py runs/demo/tensorboard docs/demo_tensorboard.png
"""

import base64
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, Iterator, List

CHROMIUM = "chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--remote-debugging-pipe"]
TIMEOUT_S = 60

# Every scalar card of the Time Series tab: its tag, whether it is in view, the colours of its lines (the
# smoothed ones, drawn opaque; the raw ones are drawn at 0.25 opacity) and the runs and colours of its
# table, its legend.
CARDS_JS = """JSON.stringify(Array.from(document.querySelectorAll('scalar-card')).map(card => ({
  tag: card.querySelector('tb-truncated-path').getAttribute('title'),
  in_view: card.getBoundingClientRect().top < window.innerHeight,
  lines: Array.from(card.querySelectorAll('line-chart path')).filter(p => p.style.opacity === '1')
    .map(p => p.style.stroke),
  legend: Array.from(card.querySelectorAll('tb-data-table-content-row')).map(row => ({
    run: row.querySelectorAll('tb-data-table-content-cell')[1].textContent.trim(),
    colour: row.querySelector('.row-circle span').style.backgroundColor})),
})))"""


def chromium_path() -> str:
    path = shutil.which(CHROMIUM)
    if path is None:
        raise RuntimeError("chromium is not installed: apt-get install -y chromium (.ci/run installs it)")
    return path


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@contextlib.contextmanager
def tensorboard(logdir: str) -> Iterator[str]:
    """TensorBoard serving ``logdir`` on a free loopback port; yields its address once it answers with
    every run loaded, and stops it by its process id."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host",
                                    "127.0.0.1", "--port", "0", "--load_fast", "false"],
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            url = _wait_for(lambda: _served_address(log), "TensorBoard to print its address")
            _wait_for(lambda: len(get_json(url + "data/runs")) == _count_runs(logdir), "TensorBoard to load every run")
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _served_address(log) -> str:
    log.seek(0)
    match = re.search(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+/)", log.read())
    return match.group(1) if match else ""


def _count_runs(logdir: str) -> int:
    return sum(any(name.startswith("events.out.tfevents") for name in names) for _, _, names in os.walk(logdir))


def _wait_for(condition, what: str, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            result = condition()
            if result:
                return result
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout:.0f} s for {what}")


class Chromium:
    """Headless Chromium with one page, driven over the DevTools protocol on a pipe."""

    def __init__(self, width: int, height: int) -> None:
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        to_browser, self._to_browser = _high_pipe()
        self._from_browser, from_browser = _high_pipe()
        # The protocol pipe is the browser's fd 3 (commands in) and fd 4 (replies out).
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_browser} 4>&{from_browser} {to_browser}<&- {from_browser}>&-', "bash",
             chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
             "about:blank"],
            pass_fds=(to_browser, from_browser), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._next_id, self._buffer, self.session = 0, b"", None
        try:
            target = self.send("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.send("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def send(self, method: str, session: bool = False, **params) -> Dict[str, Any]:
        """Send one command and return its result (events in between are dropped)."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = json.loads(self._read_message())
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read_message(self) -> bytes:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], TIMEOUT_S)
            chunk = os.read(self._from_browser, 1 << 20) if ready else b""
            if not chunk:
                raise RuntimeError("chromium did not answer")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return message

    def open(self, url: str) -> None:
        self.send("Page.navigate", session=True, url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        return result["result"].get("value")

    def next_frames(self) -> None:
        """Return once the page has laid out and drawn what the last commands changed."""
        self.evaluate("new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")

    def screenshot(self, path: str) -> None:
        with open(path, "wb") as out:
            out.write(base64.b64decode(self.send("Page.captureScreenshot", session=True, format="png")["data"]))

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)


def _high_pipe():
    """A pipe whose two ends are above 9, so that bash can put them on fds 3 and 4 in either order."""
    ends = os.pipe()
    high = tuple(fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 10) for end in ends)
    for end in ends:
        os.close(end)
    return high


def cards(browser: Chromium) -> List[Dict[str, Any]]:
    return json.loads(browser.evaluate(CARDS_JS) or "[]")


def show_legends(browser: Chromium, tags: List[str]) -> None:
    """Close the settings pane and expand the tables (legends) of the cards of ``tags``."""
    browser.evaluate("""document.querySelector('[aria-label="Close side pane"]')?.click()""")
    for tag in tags:
        browser.evaluate(f"""Array.from(document.querySelectorAll('scalar-card'))
            .filter(card => card.querySelector('tb-truncated-path').getAttribute('title') === {json.dumps(tag)})
            .forEach(card => card.querySelector('[aria-label="Expand Table"]')?.click())""")


def screenshot_time_series(url: str, path: str, expected_lines: Dict[str, int], width: int = 1200,
                           height: int = 1000) -> List[Dict[str, Any]]:
    """The Time Series tab of the TensorBoard at ``url`` (lines drawn as SVG) as a PNG, once the cards
    of ``expected_lines`` draw that many lines, their legends shown, and every card in view draws its
    lines; returns the cards as drawn."""
    browser = Chromium(width, height)
    try:
        browser.open(url + "?forceSVG=true#timeseries")
        _wait_for(lambda: set(expected_lines) <= {card["tag"] for card in cards(browser)}, "the cards to appear")
        show_legends(browser, list(expected_lines))

        def drawn():
            now = cards(browser)
            lines = {card["tag"]: len(card["lines"]) for card in now}
            complete = all(lines.get(tag, 0) >= count for tag, count in expected_lines.items())
            return now if complete and all(card["lines"] for card in now if card["in_view"]) else None

        drawn_cards = _wait_for(drawn, f"the cards {sorted(expected_lines)} and every card in view to draw")
        browser.next_frames()
        browser.screenshot(path)
        return drawn_cards
    finally:
        browser.close()


if __name__ == "__main__":
    logdir, out = sys.argv[1:3]
    layer_runs = sum(name.startswith("layer") for name in os.listdir(os.path.join(logdir, "layer-grad-norms")))
    with tensorboard(logdir) as address:
        drawn = screenshot_time_series(address, out, {"layer-grad-norms/pre-clip": layer_runs,
                                                      "layer-grad-norms/post-clip": layer_runs})
    print(f"{out}: {len(drawn)} cards")
