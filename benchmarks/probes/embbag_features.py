"""Embedding bags on the GPU: ATen's kernels (eager, Inductor, torchfuse with the Triton backend's
`Features.embedding_bag_kernels` off) against torchfuse's gather-scatter decomposition (on).

A DLRM-style sparse half: several EmbeddingBag tables (sum with per-sample weights, and mean),
their outputs concatenated into an MLP; inference and a training step (forward, backward, SGD).
ms per call, median of CUDA-event samples, backends alternating.  Run:
    PYTHONPATH=src python benchmarks/probes/embbag_features.py
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import torchfuse
from torchfuse import backends


class Sparse(torch.nn.Module):
    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(rows, dim, mode="sum" if i % 2 == 0 else "mean")
                                        for i in range(tables))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(tables * dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def forward(self, idx, offsets, weights):
        outs = [bag(idx[i], offsets, per_sample_weights=weights[i] if bag.mode == "sum" else None)
                for i, bag in enumerate(self.bags)]
        return self.mlp(torch.cat(outs, 1)).sigmoid()


def _time(fn, rounds: int = 30) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--pooling", type=int, default=20)
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--rows", type=int, default=100_000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    dev = "cuda"
    triton_backend = backends.by_name("triton", "cuda")
    base_features = triton_backend.features
    print("| mode | eager | Inductor | tf ATen bags | tf decomposed | decomposed / ATen |")
    print("|---|---|---|---|---|---|")
    for train in (False, True):
        torch.manual_seed(0)
        model = Sparse(args.tables, args.rows, 64).to(dev)
        n = args.batch * args.pooling
        idx = torch.randint(0, args.rows, (args.tables, n), device=dev)
        offsets = torch.arange(0, n, args.pooling, device=dev)
        weights = torch.rand(args.tables, n, device=dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(fn):
            def run():
                if train:
                    fn(idx, offsets, weights).sum().backward()
                    opt.step(); opt.zero_grad(set_to_none=True)
                else:
                    with torch.no_grad():
                        fn(idx, offsets, weights)
            return run

        results = {"eager": _time(step(model))}
        results["inductor"] = _time(step(torch.compile(model, backend="inductor")))
        for name, on in (("aten", False), ("decomposed", True)):
            torch._dynamo.reset()
            triton_backend.features = dataclasses.replace(base_features, embedding_bag_kernels=on)
            try:
                results[name] = _time(step(torchfuse.compile(model)))
            finally:
                triton_backend.features = base_features
        r = results
        print(f"| {'train' if train else 'infer'} | {r['eager']:.3f} | {r['inductor']:.3f} | {r['aten']:.3f} | "
              f"{r['decomposed']:.3f} | {r['aten'] / r['decomposed']:.2f}x |")


if __name__ == "__main__":
    main()
