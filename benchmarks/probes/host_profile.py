"""cProfile of the host side of a compiled model's forward (GPU probe): where do the
microseconds per launch go?   python benchmarks/probes/host_profile.py [gpt2-bf16|vit] """
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from model_profile import models  # noqa: E402
from profile_text import cprofile_text  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "gpt2-bf16"
backends = sys.argv[2].split(",") if len(sys.argv) > 2 else ["torchfuse", "inductor"]
backends = [{"eager": lambda m: m}.get(b, b) for b in backends]
make_model, make_args = models()[name]
model, args = make_model(), make_args()
out = []
with torch.no_grad():
    for backend in backends:
        torch._dynamo.reset()
        fn = backend(model) if callable(backend) else torch.compile(model, backend=backend)
        for _ in range(3):
            fn(*args)
        torch.cuda.synchronize()
        # host time per call with the GPU never the bottleneck: tiny enqueue-only loop timed on host
        t = time.perf_counter()
        for _ in range(20):
            fn(*args)
        host = (time.perf_counter() - t) / 20
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(5):
                fn(*args)
            torch.cuda.synchronize()
        out.append(f"===== {name} {backend}: torch.profiler CPU self time (5 calls)\n"
                   + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        stats = cprofile_text(lambda: fn(*args), 20, tottime_rows=35, cumulative_rows=45)
        out.append(f"===== {name} {getattr(backend, '__name__', backend)}: host loop {host * 1e3:.2f} ms/call\n" + stats)
text = "\n".join(out)
if os.environ.get("OUT"):
    open(os.path.join(os.environ["OUT"], f"host_profile_{name}.txt"), "w").write(text)
print(text[-11000:])
