"""Q3: 4 stages x 8 microbatches, width 64 (batch 64 x 64, float32): times, compile times, equality."""
import sys, json
from common import *
from proto import make_flat_step
torch._dynamo.config.trace_autograd_ops = True
torch._dynamo.config.cache_size_limit = 64
params, batch = make_params(), make_batch()
rows, out = {}, {}

def timed_first(f):
    t = time.perf_counter(); r = f(); return r, time.perf_counter() - t

# fpipe eager
steps = {n: make_step(SCHEDULES[n]()) for n in ["GPipe", "1F1B", "ZBH1"]}
ref = {n: steps[n](params, batch, key=0) for n in steps}
for n in steps: rows[f"fpipe eager {n}"] = (lambda s=steps[n]: s(params, batch, key=0))
# fpipe eager with inductor-compiled stages (today's advice)
cs = torch.compile(stage, dynamic=False); cfirst = torch.compile(first, dynamic=False)
cstep = fpipe.pipeline(loss_fn, [cfirst] + [cs] * 3, OneFOneB(MB))
_, out["compile s: fpipe 1F1B, compiled stages"] = timed_first(lambda: cstep(params, batch, key=0))
rows["fpipe eager 1F1B, inductor stages"] = lambda: cstep(params, batch, key=0)
# prototype: eager, aot_eager, inductor
for n in ["GPipe", "1F1B", "ZBH1"]:
    f = make_flat_step(stages_fns(), loss_fn, SCHEDULES[n]().program(STAGES, None), w_mode="fused")
    if n == "1F1B": rows["proto eager 1F1B"] = lambda f=f: f(params, batch)
    for be in ["aot_eager", "inductor"]:
        cf = torch.compile(f, backend=be, fullgraph=True)
        r, out[f"compile s: proto {n} {be}"] = timed_first(lambda: cf(params, batch))
        if be == "aot_eager":
            out[f"bitwise aot_eager proto {n}"] = torch.equal(r[0], ref[n][0]) and bitwise(flat(r[1]), flat(ref[n][1]))
        else:
            out[f"maxrel f32 inductor proto {n}"] = maxrel(flat(r[1]), flat(ref[n][1]))
        if be == "inductor" or n == "1F1B":
            rows[f"proto {be} {n}"] = lambda cf=cf: cf(params, batch)
# unsplit model: plain autograd eager; compiled forward + eager autograd; whole thing compiled
leaves = lambda: [{k: v.detach().requires_grad_() for k, v in p.items()} for p in params]
def plain(fn):
    P = leaves(); loss = fn(P, batch)
    return loss.detach(), torch.autograd.grad(loss, [t for p in P for t in p.values()])
def plain_all(P0, b):
    P = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in P0]
    loss = unsplit(P, b); return loss.detach(), torch.autograd.grad(loss, [t for p in P for t in p.values()])
cu = torch.compile(unsplit)
_, out["compile s: unsplit fwd compiled"] = timed_first(lambda: plain(cu))
cua = torch.compile(plain_all, fullgraph=True)
_, out["compile s: unsplit fwd+grad compiled"] = timed_first(lambda: cua(params, batch))
rows["unsplit eager autograd"] = lambda: plain(unsplit)
rows["unsplit inductor fwd + autograd"] = lambda: plain(cu)
rows["unsplit inductor fwd+grad in graph"] = lambda: cua(params, batch)
names = list(rows)
res = interleaved([rows[k] for k in names], repeats=int(sys.argv[1]) if len(sys.argv) > 1 else 41)
for k, (w, c) in zip(names, res):
    print(f"{k:40s} wall {w:7.3f} ms   cpu {c:7.3f} ms")
for k, v in out.items(): print(k, v if not isinstance(v, float) else f"{v:.3g}")
json.dump({"times": dict(zip(names, res)), **out}, open("exp3.json", "w"), indent=1)
