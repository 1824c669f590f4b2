"""index.html of specmd report: self-contained (embedded stylesheet, nothing fetched from the network), escaped,
tables in sideways-scrolling boxes with numbers right-aligned, figures as relative <img> with alt text, a paper
experiment's claim beside what was measured; and, in a real headless Chromium at a laptop's 1366 x 768, every
figure loads and the page never scrolls sideways."""

import json
import re
import shutil
import subprocess
import threading
from contextlib import contextmanager
from functools import partial
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from tests.commands.test_report import SPEC, make_sweep
from tests.commands.test_report_adhoc import make_adhoc

from specmd.commands.report import build

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# a pivoted table of 24 columns: far wider than a laptop screen, so it must scroll inside its own box
WIDE = dict(SPEC, paper="LS beats LRU <by far> & more",
            metrics=[{f"{name} {i}": expr} for i in range(4) for name, expr in (
                ("hit %", "cache.hit_rate"), ("miss ratio", "cache.misses / cache.requests"),
                ("gain %", "rel:cache.hit_rate"))])


def report(tmp_path):
    """An ad-hoc sweep (its figures, one failed job whose error holds markup) and a paper experiment (its spec's
    figures, a wide table) in one report."""
    adhoc = make_adhoc(tmp_path / "adhoc", failed=[{"eviction": "lru", "hardware.capacity": "0.25"}])
    (failed,) = adhoc.glob("*/failed.json")
    failed.write_text(json.dumps({"error": "ValueError: <script>alert(1)</script> & co"}))
    paper = make_sweep(tmp_path / "paper", spec=WIDE)
    return build([str(adhoc), str(paper)], str(tmp_path / "report"))


class Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_page_is_self_contained_escaped_and_styled_for_reading(tmp_path):
    out, sections = report(tmp_path)
    page = (out / "index.html").read_text()
    parser = Tags()
    parser.feed(page)
    tags = parser.tags
    # nothing from the network: the stylesheet is embedded, no external link, script or URL
    assert "<style>" in page and not re.search(r"https?://|<link|<script", page)
    css = page[page.index("<style>"):page.index("</style>")]
    assert ".table-wrap{overflow-x:auto" in css and "max-width:1200px" in css
    assert "img{display:block;max-width:100%" in css
    # every table sits in its scrolling box
    assert page.count("<div class='table-wrap'><table>") == page.count("<table") == 2
    # figures: one <img> per figure the report wrote, relative src that exists beside index.html, alt text
    imgs = [a for t, a in tags if t == "img"]
    assert len(imgs) == sum(len(s.figures) for s in sections) == 6 + 2
    for a in imgs:
        assert a["alt"] and "/" not in a["src"] and (out / a["src"]).is_file()
    # numbers right-aligned, names not: the ad-hoc table's first row is eviction, capacity, hit %, ...
    first_row = page.split("<tbody><tr>", 1)[1].split("</tr>", 1)[0]
    assert first_row.startswith("<td>lru</td><td class='num'>0.01</td><td class='num'>3.0</td>")
    # the paper's claim beside what was measured, escaped like every text
    assert "<h3>Paper's claim</h3><p>LS beats LRU &lt;by far&gt; &amp; more</p>" in page
    assert "<h3>Measured here</h3><p>hit % 0, miss ratio 0, " in page and "over 6 of 8 jobs" in page
    assert "<li class='bad'><b>failed</b> eviction=lru hardware.capacity=0.25 (" in page
    assert "ValueError: &lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in page
    assert page.count("Paper's claim") == 1  # an ad-hoc sweep has no claim


@contextmanager
def serve(directory):
    """The report directory over HTTP on a free localhost port: the browser loads it as a user's would."""

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def chromium(tmp_path, *args):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1366,768",
           *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# loads the report in a frame of the window's size and writes what the page's own scripts would see into <pre>
PROBE = """<!doctype html><meta charset='utf-8'>
<style>html,body{margin:0}iframe{border:0;display:block;width:1366px;height:768px}</style>
<iframe id='page' src='index.html'></iframe><pre id='probe'>pending</pre>
<script>
document.getElementById('page').addEventListener('load', function () {
  var d = this.contentDocument, w = this.contentWindow;
  document.getElementById('probe').textContent = JSON.stringify({
    images: Array.from(d.images).map(function (i) {
      return {src: i.getAttribute('src'), complete: i.complete, width: i.naturalWidth}; }),
    innerWidth: w.innerWidth, scrollWidth: d.documentElement.scrollWidth, clientWidth: d.documentElement.clientWidth,
    tables: Array.from(d.querySelectorAll('.table-wrap')).map(function (b) {
      return {scrollWidth: b.scrollWidth, clientWidth: b.clientWidth, overflowX: w.getComputedStyle(b).overflowX}; })
  });
});
</script>
"""


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install chromium)")
def test_report_in_headless_chromium_loads_every_figure_and_fits_a_laptop_screen(tmp_path):
    out, sections = report(tmp_path)
    (out / "_probe.html").write_text(PROBE)
    with serve(out) as url:
        dom = chromium(tmp_path, "--virtual-time-budget=5000", "--dump-dom", f"{url}/_probe.html")
        shot = tmp_path / "report_1366x768.png"
        chromium(tmp_path, "--hide-scrollbars", f"--screenshot={shot}", f"{url}/index.html")
    found = re.search(r"<pre id=\"probe\">(.*?)</pre>", dom, re.DOTALL)
    assert found and found.group(1) != "pending", dom[-2000:]
    got = json.loads(found.group(1).replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))
    figures = [name for s in sections for name, _ in s.figures]
    assert sorted(i["src"] for i in got["images"]) == sorted(figures) and len(figures) == 8
    assert all(i["complete"] and i["width"] > 0 for i in got["images"]), got["images"]
    # the page itself never scrolls sideways at 1366 px; the 24-column table scrolls inside its box instead
    assert got["innerWidth"] == 1366 and got["scrollWidth"] <= got["clientWidth"], got
    wide = max(got["tables"], key=lambda t: t["scrollWidth"])
    assert wide["overflowX"] == "auto" and wide["scrollWidth"] > wide["clientWidth"], got["tables"]
    from PIL import Image

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Image.open(shot).size == (1366, 768)
