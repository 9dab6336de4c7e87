"""`Explanation.save_html(path)`: the explain() report as one self-contained HTML page.

Per compiled graph: a picture (inline SVG, generated here) of its kernels in order, each with
the aten nodes it fuses, and its ATen fallbacks; then each kernel's source and the user's lines
it came from; the fallbacks and refused fusions with their reasons; the passes that changed
something; the planned memory; the aten graph before and after the passes.  Compile time by
stage for the whole explain() call on top.  No scripts, no external files: it opens anywhere.
"""
from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..report import Explanation, KernelInfo

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; margin-top: 2em; } h3 { margin-bottom: .3em; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; font-size: 12px; }
table { border-collapse: collapse; } td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
.muted { color: #777; } details { margin: .4em 0; }
"""
_COLORS = {"pointwise": "#cfe8ff", "reduction": "#ffe2c2", "aten": "#e4e4e4"}


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def picture(kernels: list["KernelInfo"], fallbacks: list[str]) -> str:
    """An SVG of one graph: a row per kernel (its name, then a box per fused node), then a row
    per ATen fallback."""
    rows: list[tuple[str, str, list[str]]] = [(k.name, k.kind, list(k.nodes)) for k in kernels]
    rows += [(f, "aten", []) for f in fallbacks]
    name_w, chip_w, row_h, pad = 300, 96, 30, 6
    width = name_w + pad + max([len(r[2]) for r in rows] + [1]) * (chip_w + pad)
    height = len(rows) * (row_h + pad) + pad
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">']
    for i, (name, kind, nodes) in enumerate(rows):
        y = pad + i * (row_h + pad)
        out.append(f'<rect x="0" y="{y}" width="{name_w}" height="{row_h}" rx="4" fill="{_COLORS[kind]}" '
                   f'stroke="#888"><title>{_e(name)} ({_e(kind)})</title></rect>')
        out.append(f'<text x="6" y="{y + 19}">{_e(name[:44])}</text>')
        for j, node in enumerate(nodes):
            x = name_w + pad + j * (chip_w + pad)
            out.append(f'<rect x="{x}" y="{y + 4}" width="{chip_w}" height="{row_h - 8}" rx="8" fill="#fff" '
                       f'stroke="#aaa"><title>{_e(node)}</title></rect>')
            out.append(f'<text x="{x + 6}" y="{y + 19}">{_e(node[:13])}</text>')
    out.append("</svg>")
    return "\n".join(out)


def render(report: "Explanation") -> str:
    graphs = report.graph_names()
    body = [f"<h1>torchfuse: {len(graphs)} graph(s), {len(report.kernels)} kernel(s), "
            f"{len(report.fallbacks)} ATen fallback(s)</h1>"]
    if report.stage_seconds:
        body.append("<table><tr><th>compile stage</th><th>seconds</th></tr>")
        body += [f"<tr><td>{_e(k)}</td><td>{v:.3f}</td></tr>"
                 for k, v in sorted(report.stage_seconds.items(), key=lambda kv: -kv[1])]
        body.append("</table>")
    for g in graphs:
        kernels = [k for k in report.kernels if k.graph == g]
        fallbacks = [f for f in report.fallbacks if f.graph == g]
        body.append(f'<h2 id="{_e(g)}">{_e(g)}</h2>')
        body.append(picture(kernels, [f"{f.node}: {f.op}" for f in fallbacks]))
        for k in kernels:
            body.append(f'<h3 id="{_e(g)}.{_e(k.name)}"><code>{_e(k.name)}</code> '
                        f'<span class="muted">[{_e(k.backend)}, {_e(k.kind)}]</span></h3>')
            body.append(f"<div>fuses: <code>{_e(', '.join(k.nodes))}</code></div>")
            if k.writes:
                body.append(f"<div>writes: <code>{_e(', '.join(k.writes))}</code></div>")
            if k.lines:
                body.append("<div>from: " + "<br>".join(f"<code>{_e(line)}</code>" for line in k.lines) + "</div>")
            body.append(f"<details><summary>source</summary><pre>{_e(k.source)}</pre></details>")
        if fallbacks:
            body.append("<h3>fallbacks to ATen</h3><ul>")
            body += [f"<li><code>{_e(f.node)}</code>: <code>{_e(f.op)}</code> ({_e(f.reason)})</li>"
                     for f in fallbacks]
            body.append("</ul>")
        body.append(_items("passes that changed something",
                           [p for p in report.changed_passes() if report.graph_of(p) == g]))
        body.append(_items("memory", [m for m in report.memory if report.graph_of(m) == g]))
        body.append(_items("first calls", [f for f in report.first_calls if report.graph_of(f) == g]))
        body.append(_items("collectives (start, wait, what overlaps)",
                           [c for c in report.collectives if report.graph_of(c) == g]))
        for text in report.graphs:
            if report.graph_of(text) == g:
                title = text.split("\n", 1)[0].lstrip("# ")
                body.append(f"<details><summary>{_e(title)}</summary><pre>{_e(text)}</pre></details>")
    # (refused fusions name their kernels, not their graph: one list for the whole report)
    body.append(_items("refused fusions", report.refused_fusions))
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>torchfuse report</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _items(title: str, items: list[str]) -> str:
    if not items:
        return ""
    return f"<h3>{_e(title)}</h3><ul>" + "".join(f"<li><code>{_e(i)}</code></li>" for i in items) + "</ul>"
