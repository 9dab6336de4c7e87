"""cProfile as text, for the GPU benchmarks' host-side profiles (launch_bench.py --profile,
probes/host_profile.py, cudagraph_bench.py).  No side effects on import (cpu_bench.py points the compile caches at
fresh folders when imported, so it is not the place)."""
from __future__ import annotations

import cProfile
import io
import pstats
from typing import Any, Callable

import torch


def cprofile_text(run: Callable[[], Any], calls: int, tottime_rows: int = 30, cumulative_rows: int = 30) -> str:
    """`run()` called `calls` times under cProfile (the GPU synchronized after, outside the
    profile): the top functions by own time, then by cumulative time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        run()
    pr.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(tottime_rows)
    if cumulative_rows:
        st.sort_stats("cumulative").print_stats(cumulative_rows)
    return s.getvalue()
