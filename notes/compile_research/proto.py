"""Prototype: a straight-line step generated from fpipe's program (one process).

The program's execution order is a constant tuple of (stage, kind, microbatch); dynamo unrolls the
loop over it, so the traced region is straight-line code: per action a stage call, an
``autograd.grad`` on that stage's private graph (detached leaves, as fpipe does), and the
gradient sum in microbatch order. No .grad, no GradientEdge, no is_inference/is_conj reads.

W modes:  'fused'  I = one autograd.grad wrt inputs+params, W only adds the params' part (deferred)
          'twice'  I = autograd.grad wrt inputs (retain_graph), W = autograd.grad wrt params
"""
import torch
from fpipe.schedules import execution_order


def make_flat_step(stages, loss_fn, program, *, w_mode="fused"):
    order = tuple((a.stage, a.kind, a.microbatch) for _, a in execution_order(program))
    S, M = program.num_stages, program.num_microbatches
    last = S - 1

    def step(params, batch):
        # leaves of our own: the caller's tensors are never part of the graph
        P = [{k: v.detach().requires_grad_() for k, v in p.items()} for p in params]
        keys = [list(p) for p in P]
        mbs = [dict(zip(batch, vs)) for vs in zip(*(torch.tensor_split(v, M) for v in batch.values()))]
        n = sum(mb["x"].shape[0] for mb in mbs)
        weights = [mb["x"].shape[0] / n for mb in mbs]
        acts, cots, pulls, deferred = {}, {}, {}, {}
        losses = [None] * M
        sums = [[None] * len(k) for k in keys]
        nxt, pending = [0] * S, [dict() for _ in range(S)]

        def add(s, i, grads):                     # fixed accumulation order (microbatch order)
            pending[s][i] = grads
            while nxt[s] in pending[s]:
                for k, g in enumerate(pending[s].pop(nxt[s])):
                    if g is not None:
                        sums[s][k] = g.clone() if sums[s][k] is None else sums[s][k].add_(g)
                nxt[s] += 1

        seeds = torch.full((M,), weights[0]).unbind() if len(set(weights)) == 1 else None
        for s, kind, i in order:
            if kind == "F":
                x = mbs[i]["x"] if s == 0 else acts.pop((s, i)).detach().requires_grad_()
                y = stages[s](P[s], x if s > 0 else mbs[i])
                if s == last:
                    y = loss_fn(y, mbs[i])
                    losses[i] = y.detach()
                else:
                    acts[s + 1, i] = y
                pulls[s, i] = (y, x if s > 0 else None)
            else:
                out, x = pulls[s, i] if kind == "I" else pulls.pop((s, i))
                if kind == "W":
                    if w_mode == "fused":
                        add(s, i, deferred.pop((s, i)))
                    else:
                        g = deferred.pop((s, i))
                        add(s, i, torch.autograd.grad([out], [P[s][k] for k in keys[s]], [g]))
                    continue
                g = (seeds[i] if seeds is not None else torch.full((), weights[i])) if s == last else cots.pop((s, i))
                wrt = ([x] if x is not None else []) + [P[s][k] for k in keys[s]]
                if kind == "B":
                    grads = torch.autograd.grad([out], wrt, [g])
                    add(s, i, grads[1 if x is not None else 0:])
                elif w_mode == "fused":            # I: everything now, W: only the sum
                    grads = torch.autograd.grad([out], wrt, [g])
                    deferred[s, i] = grads[1 if x is not None else 0:]
                else:                              # I: inputs only, keep the graph for W
                    grads = torch.autograd.grad([out], [x], [g], retain_graph=True) if x is not None else (None,)
                    deferred[s, i] = g
                if x is not None:
                    cots[s - 1, i] = grads[0].contiguous()
        loss = torch.stack(losses).mul_(weights[0]).sum() if seeds is not None else \
            torch.stack(torch._foreach_mul(losses, weights)).sum()
        return loss, [dict(zip(k, g)) for k, g in zip(keys, sums)]

    return step
