"""`Explanation.save_html`: one self-contained page per explain() report -- a graph's kernels and
the nodes each fuses as an SVG picture, kernel sources (escaped), source lines, fallbacks with
reasons and compile time by stage.  Parsed with the standard library's HTML parser here, and
rendered by a real headless browser when one is installed."""
from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest
import torch

import torchfuse
from torchfuse.cli import main as cli_main


class Softmax(torch.nn.Module):
    def forward(self, x, w):
        h = torch.relu(x * 2 + 1)
        return (h @ w).softmax(-1) < 0.5         # "<" reaches the sources: must be escaped


class Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.open: list[str] = []
        self.text: list[str] = []
        self.titles: list[str] = []
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in ("meta", "br"):
            self.open.append(tag)
        self._in_title = tag == "title"

    def handle_endtag(self, tag):
        assert self.open and self.open[-1] == tag, f"</{tag}> closes <{self.open[-1] if self.open else None}>"
        self.open.pop()
        self._in_title = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_title:
            self.titles.append(data)


@pytest.fixture
def report():
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    e = torchfuse.explain(Softmax(), x, w)
    torch.testing.assert_close(e.output, Softmax()(x, w))
    return e


def test_page_is_well_formed_and_names_every_kernel_node_and_fallback(report, tmp_path):
    path = report.save_html(tmp_path / "report.html")
    page = path.read_text()
    parser = Collect()
    parser.feed(page)
    parser.close()
    assert not parser.open, parser.open                      # every element closed, in order
    assert parser.tags.count("svg") == 1                     # one graph, one picture
    n_nodes = sum(len(k.nodes) for k in report.kernels)
    # a box per kernel, per fused node and per fallback
    assert parser.tags.count("rect") == len(report.kernels) + n_nodes + len(report.fallbacks)
    text = "".join(parser.text)
    for k in report.kernels:
        assert k.name in text and all(n in text for n in k.nodes)
        assert f"{k.name} ({k.kind})" in parser.titles
        assert k.source.strip().splitlines()[0] in text      # unescaped back by the parser
    assert "aten.mm.default" in text and "no lowering" in text
    assert "h = torch.relu(x * 2 + 1)" in text               # the source line of the first kernel
    assert "compile stage" in text and set(report.stage_seconds) <= set(parser.text)
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_cli_writes_the_page(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodel.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return (lambda x: torch.tanh(x) * 3 + 1), (torch.randn(5, 6),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_main(["explain", "mymodel:make", "--html", "out.html"]) == 0
    assert "HTML report:" in capsys.readouterr().out
    assert "poi_fused_tanh_mul_add_0" in (tmp_path / "out.html").read_text()
    sys.modules.pop("mymodel", None)


BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(BROWSER is None, reason="no headless browser installed")
def test_a_real_browser_renders_it(report, tmp_path):
    path = report.save_html(tmp_path / "report.html")
    dom = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "<svg" in dom and all(k.name in dom for k in report.kernels)


def test_a_training_report_lists_each_fallback_under_its_own_graph(tmp_path):
    w = torch.randn(4, 3, requires_grad=True)

    def step(x):
        return (torch.relu(x * 2 + 1) @ w).softmax(-1).sum()

    x = torch.randn(8, 4, requires_grad=True)
    e = torchfuse.explain(lambda t: torch.autograd.grad(step(t), (t, w)), x)
    expected = torch.autograd.grad(step(x), (x, w))
    for got, want in zip(e.output, expected):
        torch.testing.assert_close(got, want)
    graphs = e.graph_names()
    assert len(graphs) >= 2, graphs                         # forward and backward
    assert {f.graph for f in e.fallbacks} <= set(graphs) and len({f.graph for f in e.fallbacks}) >= 2
    page = e.save_html(tmp_path / "r.html").read_text()
    assert page.count("(no lowering for this op)") == len(e.fallbacks)   # each listed once
