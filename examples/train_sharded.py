"""Train a 4-stage MLP on 4 processes: 2 data-parallel replicas x 2 pipeline ranks, parameters sharded.

    torchrun --standalone --nproc-per-node 4 examples/train_sharded.py
    torchrun --standalone --nproc-per-node 4 examples/train_sharded.py --no-shard   # to compare

The 4 processes form a 2 x 2 ``DeviceMesh``: 2 data-parallel replicas (``"dp"``), each a
2-rank pipeline (``"pp"``) that holds 2 of the 4 stages (1F1B on 4 stages and 2 ranks runs as
interleaved 1F1B). Each replica trains on its own batches, and the step averages the gradients
over the replicas.

With ``fpipe.pipeline(..., parallel=fpipe.Parallelism(mesh=mesh, shard_params=True))`` (ZeRO-3,
FSDP) each rank keeps only its shard of its stages' parameters: ``step.shard(params)`` cuts every
tensor into 1-D pieces, one per replica (zero-padded when it does not divide). A step all-gathers a stage's parameters
before the stage's first forward and reduce-scatters its gradients after its last backward, so
``grads`` come back as shards too, and the AdamW update (``fpipe.optim.adamw``, torch.optim's own
kernel) runs on shards only: parameters, gradients and both moments take half the memory on
every rank (``1 / dp`` in general). The update is elementwise, so sharded and unsharded training
take the same steps; gradient clipping (``fpipe.optim.clip_by_global_norm``) uses
``step.global_norm(grads)``, which sums the squares of every shard over the whole mesh.

The task is synthetic: regress a fixed random two-layer "teacher" from 16 inputs to 8 outputs.
"""

import argparse
import os
import sys
import time

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

try:
    from tqdm import tqdm
except ImportError:
    sys.exit("examples/train_sharded.py needs tqdm, which the examples extra installs: pip install -e '.[examples]'")

import fpipe
import fpipe.optim
from fpipe.schedules import OneFOneB

IN, OUT = 16, 8

# -----------------------------------------------------------------------------
# data: each replica draws its own batches of a fixed teacher function


def teacher(generator):
    return {"a": torch.randn(IN, 32, generator=generator) / IN**0.5, "b": torch.randn(32, OUT, generator=generator) / 4}


def get_batch(teacher_params, batch_size, generator):
    x = torch.randn(batch_size, IN, generator=generator)
    return {"x": x, "y": torch.sin(x @ teacher_params["a"]) @ teacher_params["b"]}


# -----------------------------------------------------------------------------
# the model: 4 stages, pure functions of parameter dicts


def block(p, h):
    return h + torch.tanh(h @ p["w1"] + p["b1"]) @ p["w2"]  # a residual MLP block


def first_stage(p, batch):
    return block(p, batch["x"] @ p["embed"])


def middle_stage(p, h):
    return block(p, h)


def last_stage(p, h):
    return block(p, h) @ p["head"]


STAGES = [first_stage, middle_stage, middle_stage, last_stage]


def loss_fn(y, batch):
    return ((y - batch["y"]) ** 2).mean()


def init_params(dim, hidden, generator):
    def normal(*shape, std):
        return torch.randn(*shape, generator=generator) * std

    params = [
        {"w1": normal(dim, hidden, std=dim**-0.5), "b1": torch.zeros(hidden), "w2": normal(hidden, dim, std=0.02)}
        for _ in STAGES
    ]
    params[0]["embed"] = normal(IN, dim, std=IN**-0.5)
    params[-1]["head"] = normal(dim, OUT, std=dim**-0.5)
    return params


# -----------------------------------------------------------------------------
# the optimizer: AdamW over pytrees of shards (or of full tensors: the update is elementwise)


def optimizer(full_params, lr):
    """Weight decay on matrices only, decided on the full shapes: a shard is 1-D."""
    decay = [{k: v.dim() >= 2 for k, v in p.items()} for p in full_params]
    return fpipe.optim.adamw(lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, weight_decay_mask=decay)


def nbytes(tree):
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


# -----------------------------------------------------------------------------
# training


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Needs several processes: torchrun --standalone --nproc-per-node 4 examples/train_sharded.py",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    parser.add_argument("--batch-size", type=int, default=32, help="per replica")
    parser.add_argument("--dim", type=int, default=64, help="width between stages")
    parser.add_argument("--hidden", type=int, default=128, help="hidden width inside a stage")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm to this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks; the rest of the world is data parallel")
    parser.add_argument("--no-shard", action="store_true", help="replicate parameters instead (plain data parallel)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser.parse_args(argv)


def main(argv=None):
    """Train; return the loss of every step (averaged over the replicas)."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("Run me on several processes: torchrun --standalone --nproc-per-node 4 examples/train_sharded.py")
    torch.set_num_threads(1)  # small matrices, several processes per machine
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_coordinate()[0]

    step = fpipe.pipeline(
        loss_fn,
        STAGES,
        OneFOneB(args.microbatches),
        parallel=fpipe.Parallelism(mesh=mesh, shard_params=not args.no_shard),
    )
    # Every rank draws the same full parameters (same seed); step.shard keeps this rank's shards
    # of its stages (None for the stages held elsewhere).
    full = init_params(args.dim, args.hidden, torch.Generator().manual_seed(args.seed))
    opt = optimizer(full, args.lr)
    mine = [p if s in step.local_stages else None for s, p in enumerate(full)]
    params = mine if args.no_shard else step.shard(full)
    opt_state = opt.init(params)  # None for the stages held elsewhere
    del full, mine

    teacher_params = teacher(torch.Generator().manual_seed(1234))  # the same on every rank
    data = torch.Generator().manual_seed(args.seed + 1 + replica)  # each replica its own batches
    losses = []
    chatty = not args.quiet and dist.get_rank() == 0
    # A bar on a terminal; in a log file (not a terminal) a plain line every 10 steps instead.
    bar = tqdm(total=args.steps, unit="step", file=sys.stdout, disable=None if chatty else True)
    start = time.perf_counter()
    for it in range(args.steps):
        batch = get_batch(teacher_params, args.batch_size, data)
        loss, grads = step(params, batch if step.rank == 0 else None)  # loss: the replicas' mean
        grads = fpipe.optim.clip_by_global_norm(grads, step.global_norm, max_norm=args.max_norm)
        params, opt_state = opt.update(params, grads, opt_state)
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.6f}", refresh=False)
        bar.update()
        if chatty and bar.disable and (it % 10 == 9 or it == args.steps - 1):
            print(f"step {it + 1}/{args.steps}: loss {losses[-1]:.6f}")
        if it == 0:
            moments = [None if s is None else [s["exp_avg"], s["exp_avg_sq"]] for s in opt_state]
            memory = nbytes(params) + nbytes(grads) + nbytes(moments)
    bar.close()
    elapsed = time.perf_counter() - start
    # A validation loss through the forward-only pipeline, on the shards as the step takes them.
    val_loss = step.evaluate(params, get_batch(teacher_params, args.batch_size, data) if step.rank == 0 else None)

    # What each rank keeps between steps: parameters, gradients and the two AdamW moments.
    rows = [None] * world
    dist.all_gather_object(rows, (dist.get_rank(), replica, step.local_stages, memory))
    if dist.get_rank() == 0:
        kind = "replicated" if args.no_shard else "sharded"
        if not args.quiet:
            for rank, rep, stages, size in rows:
                print(f"rank {rank} (replica {rep}, stages {stages}): params + grads + AdamW state {size:,} bytes")
        print(
            f"{args.steps} steps in {elapsed:.1f}s ({kind}, dp {world // args.pp} x pp {args.pp}): "
            f"loss {losses[0]:.6f} -> {losses[-1]:.6f}, validation {val_loss.item():.6f}, "
            f"{rows[0][3]:,} bytes of state on rank 0"
        )
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
