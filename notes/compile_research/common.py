"""Shared setup: fpipe from the HEAD snapshot, the 4 x 8 width-64 MLP, helpers."""
import os, sys, time, statistics
# (the research ran on a snapshot of fa5be47; the installed fpipe is used here)
import torch
import fpipe
from fpipe.schedules import GPipe, OneFOneB, ZeroBubbleH1

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
STAGES, MB, WIDTH, BATCH = 4, 8, 64, 64

ORIG_CALL = fpipe.Step.__call__.__wrapped__   # the step without @torch.compiler.disable

def undecorate():
    """Monkeypatch (this process only) the @torch.compiler.disable away."""
    fpipe.Step.__call__ = ORIG_CALL

def stage(p, h):
    return h + torch.tanh(h @ p["w1"]) @ p["w2"]

def loss_fn(y, mb):
    return ((y - mb["t"]) ** 2).mean()

def first(p, mb):
    return stage(p, mb["x"])

def make_params(dtype=torch.float32, width=WIDTH, stages=STAGES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"w1": (torch.randn(width, width, generator=g) / width**0.5).to(dtype),
             "w2": (torch.randn(width, width, generator=g) / width**0.5).to(dtype)} for _ in range(stages)]

def make_batch(dtype=torch.float32, width=WIDTH, batch=BATCH, seq=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, width) if seq is None else (batch, seq, width)
    return {"x": torch.randn(*shape, generator=g).to(dtype), "t": torch.randn(*shape, generator=g).to(dtype)}

def stages_fns(n=STAGES):
    return [first] + [stage] * (n - 1)

def make_step(schedule, n=STAGES):
    return fpipe.pipeline(loss_fn, stages_fns(n), schedule)

SCHEDULES = {"GPipe": lambda m=MB: GPipe(m), "1F1B": lambda m=MB: OneFOneB(m), "ZBH1": lambda m=MB: ZeroBubbleH1(m)}

def unsplit(params, batch):
    h = batch["x"]
    for p in params:
        h = stage(p, h)
    return loss_fn(h, batch)

def flat(grads):
    return [g for s in grads for g in (s["w1"], s["w2"])]

def bitwise(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))

def maxrel(a, b):
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))

def interleaved(fns, repeats=41, warmup=5):
    """A/B interleaved medians in ms: (wall, cpu) per function."""
    for _ in range(warmup):
        for f in fns: f()
    wall = [[] for _ in fns]; cpu = [[] for _ in fns]
    for _ in range(repeats):
        for k, f in enumerate(fns):
            t, c = time.perf_counter(), time.process_time(); f()
            wall[k].append(time.perf_counter() - t); cpu[k].append(time.process_time() - c)
    return [(statistics.median(w) * 1e3, statistics.median(c) * 1e3) for w, c in zip(wall, cpu)]
