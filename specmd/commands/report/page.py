"""Step 4 of a report: ``index.html``, one self-contained page a reader opens from the report directory.

Everything it needs is in the file or beside it: the stylesheet is embedded (report directories are read on
machines without network, and a CDN would leak that a report was opened), figures are ``<img>`` with
``src`` relative to the page. It reads on a laptop screen: a bounded content width, tables in a box that
scrolls sideways on its own (a pivoted table of 20 columns must not widen the page), numbers right-aligned,
figures never wider than the page (each links to its full-size file). A paper experiment shows the paper's
claim beside the verdict computed from its ``report.checks`` (verdicts.py): each check marked ✓ / ✗ / – and
coloured green / red / grey, with its status in words and the measured values (where it has no checks, what
was measured). Every text is escaped: captions and errors carry user input.
"""

from __future__ import annotations

import re
from html import escape
from pathlib import Path
from urllib.parse import quote

STYLE = """
:root{color-scheme:light}
*{box-sizing:border-box}
body{margin:0;background:#f5f6f8;color:#1f2328;font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
 "DejaVu Sans",Arial,sans-serif}
main{max-width:1200px;margin:0 auto;padding:12px 24px 48px}
h1{font-size:1.6rem;margin:.5em 0 .3em}
h2{font-size:1.3rem;margin:1.8em 0 .2em;padding-top:.7em;border-top:2px solid #d0d7de}
p,li,figcaption,dd{overflow-wrap:anywhere}
a{color:#0b5cad}
code{font-size:.88em;background:#eaeef2;padding:0 .3em;border-radius:3px}
.meta{color:#57606a;font-size:.9rem;margin:.2em 0}
.toc{columns:2 300px;padding-left:1.3em}
.claim{display:grid;grid-template-columns:repeat(auto-fit,minmax(280px,1fr));gap:12px;margin:.8em 0;
 align-items:start}
.claim>div{background:#fff;border:1px solid #d0d7de;border-left:4px solid #3b6fb6;border-radius:4px;
 padding:.5em .9em}
.claim>.measured{border-left-color:#2f8a4d}
.claim h3{font-size:.78rem;text-transform:uppercase;letter-spacing:.05em;color:#57606a;margin:0 0 .2em}
.claim p{margin:.2em 0}
.claim>.verdict{border-left-color:#6e7781}
.claim>.verdict.v-ok{border-left-color:#1a7f37}
.claim>.verdict.v-no{border-left-color:#cf222e}
.verdict .summary{font-weight:600}
.checks,.points{list-style:none;margin:.3em 0;padding:0}
.checks>li{display:flex;gap:.5em;padding:.3em 0;border-top:1px solid #eef1f4}
.checks>li:first-child{border-top:0}
.mark{flex:none;align-self:flex-start;width:1.4em;line-height:1.4em;margin-top:.05em;text-align:center;
 font-weight:700;border-radius:3px}
.state{font-weight:600}
.values{display:block;font-size:.88rem;font-variant-numeric:tabular-nums;color:#3d444d}
.claim.with-verdict{grid-template-columns:minmax(240px,2fr) minmax(320px,3fr)}
@media (max-width:760px){.claim.with-verdict{grid-template-columns:1fr}}
.points{display:flex;flex-wrap:wrap;gap:.1em 1.3em;font-size:.85rem;color:#3d444d}
.points .mark{display:inline-block;width:1.2em}
.v-ok>.mark,.v-ok>div>.state{color:#1a7f37}
.v-ok>.mark{background:#dafbe1}
.v-no>.mark,.v-no>div>.state{color:#cf222e}
.v-no>.mark{background:#ffebe9}
.v-na>.mark,.v-na>div>.state{color:#57606a}
.v-na>.mark{background:#eaeef2}
.points .mark{background:none}
.table-wrap{overflow-x:auto;width:fit-content;max-width:100%;margin:.7em 0;background:#fff;
 border:1px solid #d0d7de;border-radius:4px}
table{border-collapse:collapse;font-size:13.5px;font-variant-numeric:tabular-nums}
th,td{padding:5px 10px;border-bottom:1px solid #e4e8ec;border-right:1px solid #eef1f4;white-space:nowrap;
 text-align:left;vertical-align:top}
thead th{background:#eaeef2;border-bottom:2px solid #d0d7de;font-weight:600}
tbody tr:nth-child(even){background:#f7f8fa}
tbody tr:hover{background:#eaf2fc}
th.num,td.num{text-align:right}
.figures{display:flex;flex-wrap:wrap;gap:14px;margin:.8em 0}
figure{margin:0;max-width:100%;background:#fff;border:1px solid #d0d7de;border-radius:4px;padding:8px}
figure img{display:block;max-width:100%;height:auto}
figcaption{width:0;min-width:100%;font-size:.85rem;color:#57606a;margin-top:4px}
.note{color:#57606a;font-style:italic;margin:.3em 0}
.bad{color:#a40e26}
"""

STATUS = {"-", "missing", "failed", "not run", "ok"}  # cells that say a value is absent, in any column
_NUMBER = re.compile(r"[-+]?(\d[\d,]*\.?\d*|\.\d+)([eE][-+]?\d+)?%?( |$)")


def numeric_columns(header: list, rows: list) -> list:
    """Which columns hold numbers (``50.0 ± 14.1 (n=2)`` counts): those are right-aligned."""
    out = []
    for i in range(len(header)):
        cells = [str(r[i]) for r in rows if i < len(r) and str(r[i]) not in STATUS]
        out.append(bool(cells) and all(_NUMBER.match(c) for c in cells))
    return out


def table_html(header: list, rows: list) -> str:
    num = numeric_columns(header, rows)

    def cls(i: int) -> str:
        return " class='num'" if num[i] else ""

    head = "".join(f"<th scope='col'{cls(i)}>{escape(str(h))}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{escape(str(c))}</td>" for i, c in enumerate(r)) + "</tr>"
                   for r in rows)
    return f"<div class='table-wrap'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def measured_text(sec) -> str:
    spec = sec.spec
    ok = sum(j.status == "ok" for j in sec.jobs)
    axes = list(sec.rows) + ([spec.cols] if spec.cols else [])
    metrics = ", ".join(label for label, _ in spec.metrics)
    return (f"{metrics}" + (f" by {' × '.join(axes)}" if axes else "") +
            f", over {ok} of {len(sec.jobs)} jobs (table" + (" and figures" if sec.figures else "") + " below).")


STATE = {"holds": "ok", "does not hold": "no", "not measured": "na"}  # a verdict's CSS class


def verdict_html(sec) -> str:
    """The computed verdict (verdicts.py): a summary line, then each check with its mark, its status in words
    (colour is never the only cue), the paper's claim and the measured values (per ``each`` value below)."""
    from .verdicts import summary

    vs = sec.verdicts
    overall = "no" if any(v.status == "does not hold" for v in vs) else (
        "ok" if all(v.status == "holds" for v in vs) else "na")
    items = []
    for v in vs:
        points = "".join(f"<li class='v-{STATE[p.status]}'><span class='mark' aria-hidden='true'>{p.mark}</span> "
                         f"{escape(', '.join(x for x in (p.where, str(p.at)) if x))}: {escape(p.text)}</li>"
                         for p in v.points)
        items.append(f"<li class='v-{STATE[v.status]}'><span class='mark' aria-hidden='true'>{v.mark}</span>"
                     f"<div><b class='state'>{escape(v.status)}</b> {escape(v.check.claim)}"
                     f"<span class='values'>{escape(v.values)}</span>"
                     + (f"<ul class='points'>{points}</ul>" if points else "") + "</div></li>")
    return (f"<div class='verdict v-{overall}'><h3>Verdict</h3><p class='summary'>{escape(summary(vs))}</p>"
            f"<ul class='checks'>{''.join(items)}</ul>"
            f"<p class='meta'>Measured here: {escape(measured_text(sec))}</p></div>")


def claim_html(sec) -> str:
    """The paper's claim beside the verdict: computed from the spec's ``checks`` (verdicts.py) where it has
    them, else what was measured, for the reader to compare with the prose claim (experiments/README.md
    keeps the hand-checked verdicts of the committed runs)."""
    spec = sec.spec
    paper = f"<div class='paper'><h3>Paper's claim</h3><p>{escape(spec.paper)}</p></div>" if spec.paper else ""
    if sec.verdicts:
        return f"<div class='claim{' with-verdict' if paper else ''}'>{paper}{verdict_html(sec)}</div>"
    return ("<div class='claim'>" + paper +
            f"<div class='measured'><h3>Measured here</h3><p>{escape(measured_text(sec))}</p>"
            "<p class='meta'>Verdict: not computed (no report.checks: the claim is prose); compare it with the "
            "table.</p></div>"
            "</div>")


def figures_html(figures: list) -> str:
    """Each figure at its natural size (never wider than the page), linked to its full-size file."""
    items = []
    for name, caption in figures:
        src = escape(quote(name))
        items.append(f"<figure><a href='{src}'><img src='{src}' alt='{escape(caption)}'></a>"
                     f"<figcaption>{escape(caption)}</figcaption></figure>")
    return f"<div class='figures'>{''.join(items)}</div>" if items else ""


def section_html(sec) -> list:
    from ...sweeps import unfinished
    from .tables import table

    spec = sec.spec
    ok = sum(j.status == "ok" for j in sec.jobs)
    sid = escape(spec.id)
    parts = [f"<section><h2 id='{sid}'>{escape(spec.title or spec.id)}</h2>",
             f"<p class='meta'><code>{sid}</code> · {ok}/{len(sec.jobs)} jobs finished · sweeps: " +
             ", ".join(f"<code>{escape(s.dir)}</code>" for s in sec.sweeps) + "</p>"]
    if spec.paper or sec.verdicts:
        parts.append(claim_html(sec))
    parts.append(table_html(*table(sec)))
    parts.append(figures_html(sec.figures))
    parts += [f"<p class='note'>{escape(n)}</p>" for n in sec.notes]
    bad = unfinished(sec.sweeps)
    if bad:
        parts.append(f"<p class='bad'>Not finished ({len(bad)} of {len(sec.jobs)} jobs; left out of every number "
                     "and figure):</p><ul>" + "".join(f"<li class='bad'><b>{escape(status)}</b> {escape(what)}</li>"
                                                      for status, what in bad) + "</ul>")
    parts.append(f"<p class='meta'>Data: <a href='{escape(quote(spec.id + '.csv'))}'>{sid}.csv</a> · "
                 f"<a href='{escape(quote(spec.id + '.md'))}'>{sid}.md</a></p></section>")
    return parts


def write_html(sections: list, notes: list, out: Path) -> None:
    parts = ["<!doctype html>", "<html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             "<title>specmd report</title>", f"<style>{STYLE}</style></head><body><main>", "<h1>specmd report</h1>"]
    parts += [f"<p class='bad'>{escape(n)}</p>" for n in notes]
    from .verdicts import summary

    parts.append("<nav><ul class='toc'>" + "".join(
        f"<li><a href='#{escape(s.spec.id)}'>{escape(s.spec.title or s.spec.id)}</a>" +
        (f" <span class='meta'>({escape(summary(s.verdicts))})</span>" if s.verdicts else "") + "</li>"
        for s in sections) + "</ul></nav>")
    for sec in sections:
        parts += section_html(sec)
    parts.append("</main></body></html>")
    from ...results import write_text_atomic

    write_text_atomic(out / "index.html", "\n".join(parts) + "\n")
