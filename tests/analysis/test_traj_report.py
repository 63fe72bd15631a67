"""``sfhpc traj report``: one self-contained HTML file, opened in headless Chromium (a screenshot, and every
image loaded); ``sfhpc traj compare``: two runs side by side."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from tests.analysis.runs import write_run
from tests.conftest import assert_one_line_error, run_sfhpc

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# After the page loads, the script writes every image's state into the DOM that --dump-dom prints.
PROBE = """<script>window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({loaded: i.complete && i.naturalWidth > 0, width: i.naturalWidth}));
  const out = document.createElement("pre"); out.id = "probe"; out.textContent = JSON.stringify(images);
  document.body.appendChild(out);
});</script>"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("report") / "run")


def _chromium() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs it: TEST_SYSTEM_PACKAGES)")
        pytest.skip("chromium is not installed (apt-get install chromium, or make test)")
    return CHROMIUM


def _browse(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: tests may run as root, where Chromium's sandbox refuses to start.
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--allow-file-access-from-files", *args], capture_output=True, text=True, timeout=120)


def test_report_opens_in_chromium_with_every_image(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    done = run_sfhpc("traj", "report", str(run_dir), "-o", str(out))
    assert done.returncode == 0, done.stderr
    page = out.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)  # self-contained: nothing to fetch
    assert page.count('src="data:image/png;base64,') == 1
    # The tables and sample conversations: best (plain, 1.0) and worst (multi, 0.0), decoded to text.
    assert "best reward: plain (reward 1)" in page and "worst reward: multi (reward 0)" in page
    assert "a partial rollout (cut by a weight update, continued): cut" in page
    assert "What is 2+3?" in page and "&lt;|assistant|&gt;" in page
    assert "<td>consumed</td><td>3</td>" in page and "<td>failed</td><td>1</td>" in page

    shot = tmp_path / "shot.png"
    browsed = _browse(f"--screenshot={shot}", "--window-size=1200,1400", out.as_uri(), profile=tmp_path / "p1")
    assert shot.exists(), browsed.stderr
    with Image.open(shot) as image:
        assert image.size == (1200, 1400)
        colours = {c for _, c in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    # The plot drew on screen: the staleness bars' orange and the version bars' purple (matplotlib's tab: colours).
    assert (255, 127, 14) in colours and (148, 103, 189) in colours

    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    dom = _browse("--dump-dom", "--virtual-time-budget=5000", probed.as_uri(), profile=tmp_path / "p2").stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom)
    assert found, dom[-2000:]
    images = json.loads(found.group(1))
    assert len(images) == 1 and all(i["loaded"] and i["width"] > 1000 for i in images), images


def test_report_never_overwrites_and_an_empty_store_gives_a_valid_report(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "mine.html"
    out.write_text("my notes")
    assert_one_line_error(run_sfhpc("traj", "report", str(run_dir), "-o", str(out)), "exists")
    assert out.read_text() == "my notes"
    assert_one_line_error(run_sfhpc("traj", "report", str(run_dir), "-o", str(tmp_path / "no" / "r.html")),
                          "no such folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    from sfhpc.data.store import TrajectoryStore

    TrajectoryStore.create(empty / "trajectories.h5").close()
    before = (empty / "trajectories.h5").read_bytes()
    done = run_sfhpc("traj", "report", str(empty))
    assert done.returncode == 0, done.stderr
    page = (empty / "report.html").read_text()
    assert "nothing to plot" in page and "no trajectory yet" in page and page.rstrip().endswith("</html>")
    assert (empty / "trajectories.h5").read_bytes() == before  # reading never writes to the store


def test_compare_two_runs(run_dir: Path, tmp_path: Path) -> None:
    other = write_run(tmp_path / "other", metrics=False)
    metrics = [{"step": 0, "version": 2, "reward_mean": 0.75, "trajectories": 2, "generated_tokens": 18,
                "trained_tokens": 50, "generated_tokens_per_s": 9.0, "step_s": 2.0, "bubble_fraction": 0.25},
               {"step": 1, "version": 3, "reward_mean": 0.0, "trajectories": 1, "generated_tokens": 5,
                "trained_tokens": 41, "generated_tokens_per_s": 2.5, "step_s": 3.0, "bubble_fraction": 0.75}]
    (run_dir.parent / "timed").mkdir(exist_ok=True)
    timed = write_run(run_dir.parent / "timed" / "run", metrics=False)
    (timed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    out = tmp_path / "rewards.png"
    done = run_sfhpc("traj", "compare", str(timed), str(other), "--out", str(out))
    assert done.returncode == 0, done.stderr
    cells = [re.split(r"\s{2,}", line.strip()) for line in done.stdout.splitlines()]
    rows = {parts[0]: parts[1:] for parts in cells}
    assert rows["trained tokens/s"][0] == "18"  # (50 + 41) tokens / (2 + 3) s
    assert rows["generated tokens/s"][0] == "5"  # (18 + 5) / 5 s
    assert rows["throughput from"] == ["metrics.jsonl", "store"]
    assert rows["bubble fraction"] == ["50.0%", "not recorded"]
    assert rows["step"] == ["reward run", "reward other"]
    assert ["0", "0.7500", "0.7500"] in [line.split() for line in done.stdout.splitlines()]
    with Image.open(out) as png:
        assert png.format == "PNG" and png.text["Panels"] == "reward"
    assert_one_line_error(run_sfhpc("traj", "compare", str(timed), str(other), "--out", str(out)), "exists")
    assert_one_line_error(run_sfhpc("traj", "compare", str(timed), str(tmp_path / "nope")), "no such file")
