"""What a compile produced, as data: `Explanation` (returned by `torchfuse.explain`) with a
`KernelInfo` per generated kernel and a `FallbackInfo` per op left to ATen.  A module at the
bottom of the package: the runtime, the front ends and the lazy mode fill these in, `api`
hands them to users, and nothing here imports a pipeline stage."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class KernelInfo:
    """One generated kernel."""
    name: str
    backend: str                 # "cpp", "triton" or "interpreter"
    source: str                  # the kernel's own source text
    nodes: list[str]             # names of the aten graph's nodes fused into it, e.g. "mul_1"
    kind: str = "pointwise"      # "pointwise" or "reduction"
    graph: str = ""              # the compiled graph it belongs to, e.g. "graph3_backward"
    lines: list[str] = field(default_factory=list)   # the user's source lines of those nodes
                                                     # ("model.py:42  return x * 2"), from Dynamo
    writes: list[str] = field(default_factory=list)  # buffers it stores, with the node each holds
                                                     # ("buf3 (relu)"); the rest stay in registers

    def __str__(self) -> str:
        where = f"{self.graph}." if self.graph else ""
        text = f"{where}{self.name} [{self.backend}, {self.kind}] <- " + ", ".join(self.nodes)
        if self.writes:
            text += "\n      writes " + ", ".join(self.writes)
        return text + "".join(f"\n      at {line}" for line in self.lines)


@dataclass
class FallbackInfo:
    """One aten op that ran through ATen inside a compiled graph."""
    node: str
    op: str
    reason: str
    graph: str = ""              # the compiled graph it belongs to

    def __str__(self) -> str:
        return f"{self.node}: {self.op} ({self.reason})"


@dataclass
class Explanation:
    """What torchfuse did to a program: graphs per stage, kernels, fallbacks, refused fusions."""
    graphs: list[str] = field(default_factory=list)
    kernels: list[KernelInfo] = field(default_factory=list)
    fallbacks: list[FallbackInfo] = field(default_factory=list)
    refused_fusions: list[str] = field(default_factory=list)
    passes: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)   # per graph: parameter-only values hoisted out of calls
    layouts: list[str] = field(default_factory=list)  # per graph with convolutions: its layout and why
    memory: list[str] = field(default_factory=list)   # per graph: the wrapper's planned peak bytes, reuse
    # per collective (torch.distributed's functional collectives): where it starts and waits, what runs between
    collectives: list[str] = field(default_factory=list)
    # per graph whose kernels compiled in the background while its calls ran through ATen
    # (Config.first_calls="eager"), and how many calls of explain's run did so
    first_calls: list[str] = field(default_factory=list)
    calls_tiered: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)   # compile wall time by stage
    output: Any = None

    def save_html(self, path: str | os.PathLike) -> Path:
        """Write this report as one self-contained HTML page (see `torchfuse.tools.html_report`):
        per graph, a picture of its kernels and the nodes each fuses, their sources and source
        lines, fallbacks and refused fusions with reasons, compile time by stage."""
        from .tools.html_report import render
        out = Path(path)
        out.write_text(render(self), encoding="utf-8")
        return out

    def graph_names(self) -> list[str]:
        """The compiled graphs, in order (`graphs` holds two texts per graph, before and after
        the passes, each starting "# <graph name>: ...")."""
        return list(dict.fromkeys(graph_of(g) for g in self.graphs))

    @staticmethod
    def graph_of(line: str) -> str:
        """The graph a per-graph report line belongs to (see `graph_of` below)."""
        return graph_of(line)

    def changed_passes(self) -> list[str]:
        """The pass runs that changed the graph (`passes` lists every run)."""
        return [p for p in self.passes if not p.endswith("(0 changes)")]

    def __str__(self) -> str:
        lines = [f"torchfuse explanation: {len(self.graph_names())} graph(s), {len(self.kernels)} kernel(s), "
                 f"{len(self.fallbacks)} ATen fallback(s)"]
        changed = self.changed_passes()
        if self.passes:
            lines.append("\npasses:")
            lines += [f"  {p}" for p in changed]
            if len(changed) < len(self.passes):
                lines.append(f"  ({len(self.passes) - len(changed)} pass run(s) changed nothing)")
        if self.layouts:
            lines.append("\nconvolution layouts:")
            lines += [f"  {f}" for f in self.layouts]
        if self.frozen:
            lines.append("\nhoisted parameter computations:")
            lines += [f"  {f}" for f in self.frozen]
        if self.memory:
            lines.append("\nmemory:")
            lines += [f"  {m}" for m in self.memory]
        if self.collectives:
            lines.append("\ncollectives (ATen calls; what runs between start and wait overlaps the communication):")
            lines += [f"  {c}" for c in self.collectives]
        if self.first_calls:
            lines.append(f"\nfirst calls ({self.calls_tiered} ran through ATen while kernels compiled):")
            lines += [f"  {f}" for f in self.first_calls]
        lines.append("\nkernels:")
        lines += [f"  {k}" for k in self.kernels] or ["  (none)"]
        lines.append("\nfallbacks to ATen:")
        lines += [f"  {f}" for f in self.fallbacks] or ["  (none)"]
        if self.refused_fusions:
            lines.append("\nrefused fusions:")
            lines += [f"  {r}" for r in self.refused_fusions]
        return "\n".join(lines)


def graph_of(line: str) -> str:
    """The graph a per-graph report line belongs to ("# graph3_backward: ..." and
    "graph3_backward: ..." -> "graph3_backward")."""
    return line.split(":", 1)[0].lstrip("# ").strip()
