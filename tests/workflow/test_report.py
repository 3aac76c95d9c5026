"""`snakemake --report report.html` on the default run (the session fixture `done`).

The report must embed the label page, the loss plots, the plan, the pilot gate, the evaluation
table and the samples, under the categories Overview, Data, Training, Evaluation and Run. It opens
on the run's overview (loss curves, stages with their durations, exports, samples) with the rule
graph below: opened in a real headless Chromium, the page it opens on must show the loss curve,
and clicked through to Training -> loss.png, the plot. Under CI (CI=true) these fail without
Chromium; elsewhere they skip.

Also a tool: the screenshot in docs/report_loss_plot.png was made with

    python tests/workflow/test_report.py report.html docs/report_loss_plot.png

and one of the page the report opens on with `--landing`.

(see docs/report.md).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RUN = "results/demo"

# Appended to a copy of the report: after the page has loaded, click what a reader clicks:
# the category in the menu, then the result's "eye" button (shows the file) and, with
# info, its "i" button (the caption, in a side bar half the window wide). The page title
# reports the outcome.
NAV_SCRIPT = """<script>
(function () {
  var CATEGORY = %(category)s, RESULT = %(result)s, INFO = %(info)s;
  function row() {
    var cell = Array.from(document.querySelectorAll("td")).find(function (el) {
      var t = el.textContent.trim(); return t === RESULT || t.endsWith("/" + RESULT);
    });
    return cell && cell.closest("tr");
  }
  function fail(msg) { document.title = "SCREENSHOT-FAILED: " + msg; }
  window.addEventListener("load", function () {
    setTimeout(function () {
      if (CATEGORY === null) {  // the landing page as it opens: where is its loss plot, and the rule graph?
        var img = document.querySelector("#sft-overview img.loss");
        if (!img) return fail("no loss plot on the landing page");
        var r = img.getBoundingClientRect(), g = document.querySelector("#rulegraph");
        var gr = g ? g.getBoundingClientRect() : null;
        document.title = "SCREENSHOT-READY " + JSON.stringify({
          img: [r.left, r.top, r.width, r.height], complete: img.complete && img.naturalWidth > 0,
          graph: gr ? [gr.left, gr.top, gr.width, gr.height] : null});
        return;
      }
      var menu = Array.from(document.querySelectorAll("a")).find(function (el) {
        return el.textContent.trim() === CATEGORY;
      });
      if (!menu) return fail("no menu entry " + CATEGORY);
      menu.click();
      setTimeout(function () {
        var r = row();
        if (!r) return fail("no result " + RESULT + " in " + CATEGORY);
        r.querySelectorAll("a")[0].click();
        setTimeout(function () {
          var r2 = row();
          if (INFO && r2) r2.querySelectorAll("a")[1].click();
          document.title = "SCREENSHOT-READY";
        }, 300);
      }, 300);
    }, 300);
  });
})();
</script>
"""


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def need_chromium() -> str:
    """Chromium's path; without one the test fails under CI (.ci/run installs it) and skips elsewhere."""
    path = chromium_binary()
    if path is None:
        message = "no chromium on PATH (Debian: apt-get install chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + "; under CI the report must be checked in a real browser")
        pytest.skip(message + "; the HTML checks still ran")
    return path


def landing_layout(dom: str) -> dict:
    """Where the landing page's loss plot and the rule graph were (CSS pixels), from the page title."""
    title = re.search(r"<title>SCREENSHOT-READY (.*?)</title>", dom, re.S)
    return json.loads(html.unescape(title.group(1)))


def screenshot(report: Path, out: Path, category: str | None = "Training", result: str = "loss.png",
               size: tuple[int, int] = (1600, 900), info: bool = False, chromium: str | None = None) -> str:
    """Open `report` in headless Chromium, click to `category` -> `result` (and its caption with
    `info`), save a PNG to `out`. With `category=None`: no clicks, the page the report opens on.

    Returns the DOM after the clicks (for checks). Raises if Chromium is missing or the
    clicks did not find their targets.
    """
    chromium = chromium or chromium_binary()
    if chromium is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    page = Path(report).read_text()
    cut = page.rindex("</body>")
    script = NAV_SCRIPT % {"category": json.dumps(category), "result": json.dumps(result), "info": json.dumps(info)}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "report.html"
        copy.write_text(page[:cut] + script + page[cut:])
        common = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                  f"--user-data-dir={tmp}/profile", f"--window-size={size[0]},{size[1]}",
                  "--virtual-time-budget=5000"]
        dom = subprocess.run(common + ["--dump-dom", copy.as_uri()], capture_output=True, text=True,
                             timeout=180, check=True).stdout
        title = re.search(r"<title>(.*?)</title>", dom, re.S)
        if title is None or not title.group(1).startswith("SCREENSHOT-READY"):
            raise RuntimeError(f"clicking through the report failed: {title.group(1) if title else 'no title'}")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(common + [f"--screenshot={Path(out).resolve()}", copy.as_uri()], capture_output=True,
                       timeout=180, check=True)
    return dom


def embedded(report_html: str) -> tuple[dict, dict]:
    """The report's `categories` and `results` objects (results carry each file as a data URI)."""
    def obj(name):
        start = report_html.index(f"var {name} = {{") + len(f"var {name} = ")
        return json.JSONDecoder().raw_decode(report_html, start)[0]
    return obj("categories"), obj("results")


def content(result: dict) -> bytes:
    return base64.b64decode(result["data_uri"].split("base64,", 1)[1])


@pytest.fixture(scope="module")
def report(done, run_snakemake) -> Path:
    """`snakemake --report report.html`, the README's command, in the finished run."""
    out = done / "report.html"
    proc = run_snakemake(done, "--report", out.name, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.workflow
def test_report_embeds_plots_plan_gate_and_table(done, report):
    categories, results = embedded(report.read_text())
    where = {Path(path).name: cat for cat, subcats in categories.items() for paths in subcats.values()
             for path in paths}
    assert where == {
        "overview.html": "Overview", "labels.html": "Data", "data.html": "Data", "loss.png": "Training",
        "val_loss.png": "Evaluation", "summary.html": "Evaluation", "summary.csv": "Evaluation",
        "samples.html": "Evaluation", "benchmarks.html": "Evaluation", "benchmarks.png": "Evaluation",
        "benchmarks.csv": "Evaluation",
        "plan.html": "Run", "plan.json": "Run", "pilot_gate.html": "Run", "pilot_report.json": "Run",
    }, where
    by_name = {Path(path).name: (path, r) for path, r in results.items()}
    # Every file is embedded as it is on disk, with a caption.
    for name, (path, result) in by_name.items():
        assert content(result) == (done / path).read_bytes(), name
        assert len(re.sub("<[^>]+>", "", result["caption"])) > 80, (name, result["caption"])
    for name in ("loss.png", "val_loss.png"):
        assert by_name[name][1]["mime_type"] == "image/png" and content(by_name[name][1])[:4] == b"\x89PNG"
    # Captions are rendered with the run's config.
    assert "run <strong>demo</strong>" in by_name["loss.png"][1]["caption"]

    # The HTML pages, which the report shows inline, carry the marked records, the table, the plan and the gate.
    assert 'class="t s' in content(by_name["labels.html"][1]).decode()
    data_page = content(by_name["data.html"][1]).decode()  # the training data, its shards and their times
    assert "<td>train</td>" in data_page and "Shards: records and seconds" in data_page
    # The HTML pages, which the report shows inline, carry the table, the plan and the gate.
    summary = content(by_name["summary.html"][1]).decode()
    table = (done / RUN / "eval/summary.csv").read_text().splitlines()
    assert len(table) > 1 and summary.count("<tr>") >= len(table)  # header + a row per CSV row, and more
    for weights in ("base", "raw", "ema_0.9", "ema_0.98", "merged"):
        assert f">{weights}<" in summary, weights
    plan = json.loads((done / RUN / "plan.json").read_text())
    plan_page = content(by_name["plan.html"][1]).decode()
    for stage in plan["stages"]:
        assert f">{stage['name']}<" in plan_page and f">{stage['end']}<" in plan_page
    gate = json.loads((done / RUN / "pilot_report.json").read_text())
    gate_page = content(by_name["pilot_gate.html"][1]).decode()
    assert ("PASSED" if gate["passed"] else "FAILED") in gate_page
    for check, result in gate["checks"].items():
        assert f">{check}<" in gate_page and html.escape(result["detail"]) in gate_page


@pytest.mark.workflow
def test_report_pages_samples_overview_and_landing(done, report):
    """The samples page (every stage end: raw and each EMA answer the same held-out prompts, next to
    the reference), the overview (stage table with durations, exports), and the landing page."""
    report_html = report.read_text()
    _, results = embedded(report_html)
    by_name = {Path(path).name: (path, r) for path, r in results.items()}
    evals = {json.loads(p.read_text())["stage"]: json.loads(p.read_text()) for p in (done / RUN / "eval").glob("*.json")}
    plan = json.loads((done / RUN / "plan.json").read_text())
    stages = [s["name"] for s in plan["stages"]]

    samples = content(by_name["samples.html"][1]).decode()
    for stage in stages:
        rows = {r["weights"]: r for r in evals[stage]["rows"]}
        assert set(rows) == {"raw", "ema_0.9", "ema_0.98"}, set(rows)
        prompts = [s["prompt"] for s in rows["raw"]["samples"]]
        assert len(prompts) == 8, prompts  # the first 8 held-out prompts ...
        for weights, row in rows.items():  # ... the same ones for every weight set
            assert [s["prompt"] for s in row["samples"]] == prompts, weights
        assert f"after {stage}" in samples
        for sample in rows["ema_0.9"]["samples"]:
            assert f"<code>{html.escape(sample['answer'])}</code>" in samples
            assert f"<code>{html.escape(sample['reference'])}</code>" in samples
    for weights in ("raw answer", "ema_0.9 answer", "ema_0.98 answer"):
        assert f">{weights}</th>" in samples

    overview = content(by_name["overview.html"][1]).decode()
    loss_b64 = base64.b64encode((done / RUN / "eval/loss.png").read_bytes()).decode()
    assert f'src="data:image/png;base64,{loss_b64}"' in overview  # the plot itself, embedded
    for stage in stages:
        assert f">{stage}</td>" in overview
        bench = (done / "benchmarks/train_stage/demo" / f"{stage}.tsv").read_text().splitlines()
        assert float(bench[1].split("\t")[0]) > 0
    assert "wall clock" in overview and "all stages" in overview
    for name in ("adapter_final", "adapter_ema", "merged"):
        assert f"<code>{name}/</code>" in overview
    assert overview.count(">written</td>") == sum((done / RUN / "export" / n).is_dir() for n in
                                                   ("adapter_final", "adapter_ema", "adapter_best",
                                                    "adapter_best_ema", "merged"))
    assert "passed" in overview and "exact match" in overview

    # The workflow description (what the report shows first) carries the overview, plot included.
    start = report_html.index("var workflow_desc = ") + len("var workflow_desc = ")
    desc = json.JSONDecoder().raw_decode(report_html, start)[0]
    assert 'id="sft-overview"' in desc and loss_b64 in desc


@pytest.mark.workflow
def test_report_opens_on_the_loss_curve_in_headless_chromium(report, tmp_path):
    """Acceptance: a screenshot of the page the report opens on (no clicks) shows the loss curve,
    above the fold, with the rule graph below it."""
    chromium = need_chromium()
    import matplotlib.image

    png = tmp_path / "landing.png"
    dom = screenshot(report, png, category=None, chromium=chromium)
    layout = landing_layout(dom)
    loss_b64 = base64.b64encode((Path(report).parent / RUN / "eval/loss.png").read_bytes()).decode()
    assert f'src="data:image/png;base64,{loss_b64}"' in dom
    left, top, width, height = layout["img"]
    assert layout["complete"], layout
    assert width > 700 and height > 400 and 0 <= top and top + 0.6 * height < 900, layout  # in the window
    assert layout["graph"] is not None and layout["graph"][1] >= top + height, layout  # the rule graph below
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (900, 1600)
    crop = pixels[int(top):min(900, int(top + height)), int(left):int(left + width), :3]
    colours = {tuple(p) for p in (crop.reshape(-1, 3)[::5] * 255).astype(int).tolist()}
    # The plot drawn: many colours, among them the training curve's blue (tab:blue, 31 119 180).
    assert len(colours) > 200 and crop.std() > 0.05, (len(colours), float(crop.std()))
    blue = (abs(crop[..., 0] - 31 / 255) < 0.06) & (abs(crop[..., 1] - 119 / 255) < 0.06) & (abs(crop[..., 2] - 180 / 255) < 0.06)
    assert blue.sum() > 500, int(blue.sum())


@pytest.mark.workflow
def test_report_shows_the_loss_plot_in_headless_chromium(report, tmp_path):
    chromium = need_chromium()
    import matplotlib.image

    png = tmp_path / "report.png"
    dom = screenshot(report, png, chromium=chromium)
    _, results = embedded(report.read_text())
    loss_uri = next(r["data_uri"] for path, r in results.items() if path.endswith("/loss.png"))
    # The plot is displayed: an <img> with the embedded loss.png.
    assert f'<img src="{loss_uri}"' in dom
    # ... and the screenshot is not blank: the plot's area has many colours, not a flat page.
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (900, 1600)
    right = pixels[:, 450:, :3].reshape(-1, 3)
    colours = {tuple(p) for p in (right[::7] * 255).astype(int).tolist()}
    assert len(colours) > 200 and right.std() > 0.05, (len(colours), float(right.std()))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Screenshot a Snakemake report after clicking to one result.")
    ap.add_argument("report", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--category", default="Training")
    ap.add_argument("--result", default="loss.png")
    ap.add_argument("--size", default="1600x900", help="window WIDTHxHEIGHT")
    ap.add_argument("--info", action="store_true", help="also open the result's caption (side bar)")
    ap.add_argument("--landing", action="store_true", help="no clicks: the page the report opens on")
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    screenshot(args.report, args.out, None if args.landing else args.category, args.result, (width, height),
               args.info)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
