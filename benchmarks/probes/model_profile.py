"""Where does a whole model's GPU time go?  Inductor vs torchfuse, kernel by kernel (GPU probe).

    python benchmarks/probes/model_profile.py [--models gpt2-bf16,bert,vit] [--iters 3]
    python benchmarks/probes/model_profile.py --models gpt2-train --options partitioner=default

For each model: compile with Inductor and with torchfuse, warm up, profile a few iterations
with torch.profiler and print the top CUDA kernels by time per iteration, plus torchfuse's
ATen fallbacks.  Full tables go to $OUT/model_profile.txt when OUT is set.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

_tmp = tempfile.mkdtemp(prefix="tf-prof-")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_tmp, "inductor"))
os.environ.setdefault("TORCHFUSE_CACHE_DIR", os.path.join(_tmp, "torchfuse"))

import torch  # noqa: E402

import torchfuse  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpu_bench  # noqa: E402  (CUDA-event timing shared with the benchmark table)
import gpu_blocks  # noqa: E402

LINES: list[str] = []


def say(s: str = "") -> None:
    print(s, flush=True)
    LINES.append(s)


def models() -> dict:
    import transformers
    out = {}
    g = transformers.GPT2Config(resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    ids = lambda v: (torch.randint(0, v, (8, 512), device="cuda"),)  # noqa: E731
    out["gpt2-bf16"] = (lambda: transformers.GPT2LMHeadModel(g).cuda().eval().bfloat16(), lambda: ids(50257))
    out["gpt2-fp32"] = (lambda: transformers.GPT2LMHeadModel(g).cuda().eval(), lambda: ids(50257))
    # One training step (forward, loss, backward; no optimizer, so every step sees the same weights).
    out["gpt2-train"] = (lambda: _train_step(transformers.GPT2LMHeadModel(g).cuda().train()),
                         lambda: (torch.randint(0, 50257, (4, 512), device="cuda"),))
    out["bert"] = (lambda: transformers.BertModel(transformers.BertConfig()).cuda().eval(), lambda: ids(30000))
    try:
        import timm
        out["vit"] = (lambda: timm.create_model("vit_base_patch16_224", pretrained=False).cuda().eval().bfloat16(),
                      lambda: (torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.bfloat16),))
        out["resnet"] = (lambda: timm.create_model("resnet50", pretrained=False).cuda().eval().bfloat16()
                         .to(memory_format=torch.channels_last),
                         lambda: (torch.randn(64, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
                                  .to(memory_format=torch.channels_last),))
    except ImportError:
        pass
    return out


def _train_step(model: torch.nn.Module):
    step = gpu_blocks._train_step(model)
    step.is_train_step = True      # profiled with grad enabled; its "logits" are the loss
    return step


def _logits(out):
    """The main output tensor of a model (HF outputs carry logits / last_hidden_state)."""
    for key in ("logits", "last_hidden_state"):
        if hasattr(out, key):
            return getattr(out, key)
    return out[0] if isinstance(out, (tuple, list)) else out


def profile(fn, args, iters: int) -> tuple[float, list[tuple[str, float, int]]]:
    from torch.profiler import ProfilerActivity, profile as prof
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn(*args)
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[ev.name][1] += 1
    rows = sorted(((k, v[0] / iters / 1000, v[1] // iters) for k, v in per.items()), key=lambda r: -r[1])
    return sum(r[1] for r in rows), rows


def bench(fn, args) -> float:
    return gpu_bench.bench(fn, *args, reps=10, inner=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2-bf16,bert,vit")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--backends", default="eager,inductor,torchfuse")
    ap.add_argument("--options", default="", help="torchfuse options as k=v,k=v (ints/bools parsed)")
    a = ap.parse_args()
    opts = {}
    for kv in filter(None, a.options.split(",")):
        k, v = kv.split("=")
        opts[k] = {"True": True, "False": False}.get(v, int(v) if v.isdigit() else v)
    table = []
    avail = models()
    for name in a.models.split(","):
        make_model, make_args = avail[name]
        model, args = make_model(), make_args()
        training = getattr(model, "is_train_step", False)
        with torch.set_grad_enabled(training):
            res = {}
            ref = _logits(model(*args))
            for label, wrap in (("eager", lambda m: m), ("inductor", lambda m: torch.compile(m)),
                                ("torchfuse", lambda m: torch.compile(m, backend="torchfuse", options=opts))):
                if label not in a.backends.split(","):
                    continue
                torch._dynamo.reset()
                torchfuse.counters.clear()
                try:
                    fn = wrap(model)
                    ms = bench(fn, args)
                    total, rows = profile(fn, args, a.iters)
                except Exception as e:  # keep going: one broken row must not lose the others
                    say(f"{name} {label}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                res[label] = ms
                got = _logits(fn(*args))
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                say(f"  {name} {label}: relative error vs eager {err:.2e}" + ("  <-- WRONG" if err > 5e-2 else ""))
                say(f"\n## {name} / {label}: {ms:.2f} ms wall, {total:.2f} ms GPU kernels, "
                    f"{sum(r[2] for r in rows)} launches/iter  {dict(torchfuse.counters) if label == 'torchfuse' else ''}")
                for k, t, n in rows[:a.top]:
                    say(f"  {t:7.3f} ms  x{n:<4d} {k[:150]}")
            if "torchfuse" in res and not training:
                try:
                    ex = torchfuse.explain(model, *args, options=opts)
                    fb = collections.Counter(f.op for f in ex.fallbacks)
                    say(f"  torchfuse: {len(ex.kernels)} kernels, fallbacks: {dict(fb)}")
                except Exception as e:
                    say(f"  explain failed: {type(e).__name__}: {e}")
            table.append((name, res.get("eager", float("nan")), res.get("inductor", float("nan")),
                          res.get("torchfuse", float("nan"))))
        del model
        torch.cuda.empty_cache()
    say("\n| model | eager ms | inductor ms | torchfuse ms | inductor/torchfuse |\n|---|---|---|---|---|")
    for n, e, i, t in table:
        say(f"| {n} | {e:.2f} | {i:.2f} | {t:.2f} | {i / t:.2f} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "model_profile.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")


if __name__ == "__main__":
    sys.exit(main())
