"""Probe: where does the host time of one tiny torchfuse call go on the GPU?"""
import cProfile
import pstats
import time

import torch

import torchfuse  # noqa: F401

fn = lambda t: t + 1
x = torch.randn(1024, device="cuda")
cf = torch.compile(fn, backend="torchfuse")
for _ in range(50):
    cf(x)
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
t = time.perf_counter()
for _ in range(2000):
    cf(x)
torch.cuda.synchronize()
pr.disable()
print("us per call (profiled):", (time.perf_counter() - t) / 2000 * 1e6)
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
