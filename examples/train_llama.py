"""Train a small Llama-style decoder as a 4-stage pipeline, in one process or on several.

    python examples/train_llama.py
    python examples/train_llama.py --schedule interleaved --microbatches 8
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --tp 2

The same script runs unchanged under ``torchrun``: it then joins a gloo process group, and
``fpipe.pipeline(..., parallel=fpipe.Parallelism(group=...))`` puts the 4 stages on 2 processes
(looped placement, so 1F1B becomes interleaved 1F1B). Each rank builds only the parameters of
``step.local_stages``, only the rank of stage 0 is given the batch, and every rank gets the loss.

With ``--tp 2`` the processes form a 2-D ``DeviceMesh`` with dimensions ``("pp", "tp")``: 4
processes are 2 pipeline ranks of 2 tensor-parallel ranks each (``fpipe.Parallelism(mesh=mesh)``),
and every stage is tensor-parallel as in Megatron-LM: each tp rank holds half of the heads (the
columns of ``wq``, ``wk``, ``wv`` and the rows of ``wo``) and half of the MLP's hidden units (the
columns of ``w1``, ``w3`` and the rows of ``w2``) as DTensors
(``torch.distributed.tensor``, ``Shard`` placements), and sums its products with its partner's
in one all-reduce per attention and per MLP (``row_output``); norms, the embedding and the
head stay whole, a copy on each tp rank. The losses equal the one-process run's to float32
rounding (the row-parallel sums are added in two halves): measured at most 2.4e-7 apart over
the 150 default steps, and bitwise over the first 10. ``--tp`` must divide the heads and the
MLP's width, and the number of processes.

The model is written as pure functions of parameter pytrees (dicts of tensors): RMSNorm, causal
self-attention with rotary position embeddings (RoPE), and a SwiGLU MLP. It is cut into four
stage functions ``stage(stage_params, x) -> y``:

    stage 0: token embedding, block 0
    stage 1: block 1
    stage 2: block 2
    stage 3: block 3, final RMSNorm, output head -> logits

What travels from stage to stage is a dict: the hidden states ``h``, the integer ``positions`` of
the tokens, and the complex RoPE table ``freqs_cis``, so every stage rotates queries and keys the
same way without holding any state of its own. The table enters with the batch and is not split
into microbatches (``batch_dims`` is ``None`` for it).

The task is synthetic and learnable in well under a minute: each sequence is ``K`` random digits,
a separator, then the same digits again; the loss is the cross-entropy on the copied digits (a
per-token mean). It starts near ``ln(17) = 2.83`` and falls towards 0 once attention learns to
look ``K`` tokens back, which RoPE makes easy.

``fpipe.pipeline(loss_fn, stages, schedule)`` returns ``step``, and the training loop is
``loss, grads = step(params, batch)`` followed by a functional AdamW update (``fpipe.optim``, on
torch.optim's own kernel): new tensors each step, nothing mutated. ``step`` runs every stage
here, on virtual ranks, in the schedule's order; the schedule's rank x time grid is printed at
start.

After training, ``step.evaluate(params, batch)`` runs the same pipeline forward only (no graph,
no gradients) for a validation loss, and ``step.evaluate(..., outputs=True)``, which also returns
the logits of the whole batch on every rank, drives greedy sampling: a few prompts ``digits SEP``
are continued one token at a time (recomputing the prefix each time) and printed.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

try:
    from tqdm import tqdm
except ImportError:
    sys.exit("examples/train_llama.py needs tqdm, which the examples extra installs: pip install -e '.[examples]'")

import fpipe
from fpipe.schedules import GPipe, Interleaved1F1B, OneFOneB, chrome_trace

# -----------------------------------------------------------------------------
# data: copy K random digits after a separator

NUM_DIGITS = 16  # tokens 0..15 are digits
SEP = NUM_DIGITS  # token 16 separates the digits from their copy
VOCAB = NUM_DIGITS + 1
IGNORE = -100  # targets that cross_entropy skips: the first K digits cannot be predicted


def get_batch(batch_size, k, freqs_cis, generator):
    """One batch of ``digits SEP digits``, shifted by one for next-token prediction."""
    digits = torch.randint(NUM_DIGITS, (batch_size, k), generator=generator)
    seq = torch.cat([digits, torch.full((batch_size, 1), SEP), digits], dim=1)  # (B, 2K+1)
    tokens, targets = seq[:, :-1], seq[:, 1:].clone()  # (B, T) with T = 2K
    targets[:, :k] = IGNORE  # only the copy is scored
    # Positions per token (not just arange(T)), so packed or shifted sequences would work unchanged.
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return {"tokens": tokens, "positions": positions, "targets": targets, "freqs_cis": freqs_cis}


# Split tokens, positions and targets into microbatches along dim 0; give every microbatch the
# whole RoPE table.
BATCH_DIMS = {"tokens": 0, "positions": 0, "targets": 0, "freqs_cis": None}

# -----------------------------------------------------------------------------
# tensor parallel (--tp): each rank of a tensor-parallel group holds some of the heads and some
# of the MLP's hidden units (Megatron-LM's split, Shoeybi et al. 2019), as DTensors
#
#   x (a copy on every rank) --column_input--> x @ wq[:, my heads] ... y @ wo[my heads, :] --row_output--> sum
#        forward: unchanged                     (Shard(1) weights)       (Shard(0) weights)     forward: all-reduce
#        backward: all-reduce of the gradient                                                   backward: unchanged
#
# The helpers do nothing to plain tensors, so the same functions are the one-process model. torch's
# parallelize_module (ColwiseParallel, RowwiseParallel) does the same to nn.Linear modules (see
# tests/saving/_tensor_parallel_saves.py); this model has no modules, so its weights are placed by hand.


def local(w):
    """This rank's piece of a weight: the weight itself, or a DTensor's local shard (gradients flow back to it)."""
    return w.to_local() if isinstance(w, DTensor) else w


def column_input(x, weight):
    """``x`` before its product with a column-parallel ``weight``: the same values, but the gradient
    of ``x``, of which each rank computes its heads' part, is summed over the tensor-parallel ranks."""
    if not isinstance(weight, DTensor):
        return x
    copy = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)  # no check: no communication
    return copy.to_local(grad_placements=[Partial()])


def row_output(y, weight):
    """The sum over the tensor-parallel ranks of ``y``, each rank's part of a product with the
    row-parallel ``weight`` (an all-reduce); a copy of the sum on every rank."""
    if not isinstance(weight, DTensor):
        return y
    parts = DTensor.from_local(y, weight.device_mesh, [Partial()], run_check=False)
    return parts.redistribute(placements=[Replicate()]).to_local()


# Which dimension of each block weight is split over the tensor-parallel ranks: the columns of the
# products that make heads and hidden units, the rows of those that sum them. Norms, the embedding
# and the head stay whole, a copy on every rank: the gradient that reaches them has been summed by
# column_input, so they get the same gradient, and stay the same, on every rank.
TP_SPLIT = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w1": 1, "w3": 1, "w2": 0}


def distribute_block_weights(stage_params, tp_mesh):
    """One stage's parameters with its blocks' weights as DTensors sharded over ``tp_mesh``.

    Every rank drew the same full weights, so each keeps its own shard without communication
    (``src_data_rank=None``).
    """

    def place(path, t):
        dim = TP_SPLIT.get(path[-1])
        return t if dim is None else distribute_tensor(t, tp_mesh, [Shard(dim)], src_data_rank=None)

    return optree.tree_map_with_path(place, stage_params)


# -----------------------------------------------------------------------------
# the model, as pure functions of parameter pytrees


def precompute_freqs_cis(head_dim, max_len, theta=10000.0):
    """The RoPE table: ``freqs_cis[t, j] = exp(i * t * theta^(-2j / head_dim))``, complex64."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), freqs)  # (max_len, head_dim/2)
    return torch.polar(torch.ones_like(angles), angles)


def rms_norm(weight, x, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def apply_rope(x, freqs):
    """Rotate pairs of features of ``x`` (B, T, H, D) by the complex ``freqs`` (B, T, D/2)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)


def attention(p, x, freqs_cis, positions):
    B, T, _ = x.shape
    head_dim = 2 * freqs_cis.shape[-1]  # the table fixes the head size
    wq, wk, wv, wo = (local(p[name]) for name in ("wq", "wk", "wv", "wo"))
    n_heads = wq.shape[1] // head_dim  # all the heads, or this rank's share of them with --tp
    x = column_input(x, p["wq"])
    q = (x @ wq).view(B, T, n_heads, head_dim)
    k = (x @ wk).view(B, T, n_heads, head_dim)
    v = (x @ wv).view(B, T, n_heads, head_dim)
    freqs = freqs_cis[positions]  # (B, T, head_dim/2): each token's rotation
    q, k = apply_rope(q, freqs), apply_rope(k, freqs)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return row_output(y.transpose(1, 2).reshape(B, T, n_heads * head_dim) @ wo, p["wo"])


def mlp(p, x):
    x = column_input(x, p["w1"])
    return row_output((F.silu(x @ local(p["w1"])) * (x @ local(p["w3"]))) @ local(p["w2"]), p["w2"])  # SwiGLU


def block(p, x):
    """One pre-norm transformer block on the activation dict; returns the dict with ``h`` updated."""
    h = x["h"]
    h = h + attention(p["attn"], rms_norm(p["attn_norm"], h), x["freqs_cis"], x["positions"])
    h = h + mlp(p["mlp"], rms_norm(p["mlp_norm"], h))
    return {**x, "h": h}


def first_stage(p, batch):
    x = {"h": p["embed"][batch["tokens"]], "positions": batch["positions"], "freqs_cis": batch["freqs_cis"]}
    return block(p["block"], x)


def middle_stage(p, x):
    return block(p["block"], x)


def last_stage(p, x):
    h = block(p["block"], x)["h"]
    return rms_norm(p["norm"], h) @ p["head"]  # logits (B, T, VOCAB)


STAGES = [first_stage, middle_stage, middle_stage, last_stage]


def loss_fn(logits, batch):
    """Cross-entropy per scored token, averaged: fpipe weights each microbatch by its size."""
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=IGNORE)


def swiglu_width(dim):
    return 8 * ((8 * dim // 3 + 7) // 8)  # 2/3 of 4 * dim, rounded up to 8


def init_params(dim, generator):
    """One parameter dict per stage, float32, Llama-like init (output projections scaled down)."""
    hidden = swiglu_width(dim)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * len(STAGES))

    def normal(*shape, std=std):
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    def block_params():
        return {
            "attn_norm": torch.ones(dim, dtype=torch.float32),
            "attn": {
                "wq": normal(dim, dim),
                "wk": normal(dim, dim),
                "wv": normal(dim, dim),
                "wo": normal(dim, dim, std=out_std),
            },
            "mlp_norm": torch.ones(dim, dtype=torch.float32),
            "mlp": {"w1": normal(dim, hidden), "w3": normal(dim, hidden), "w2": normal(hidden, dim, std=out_std)},
        }

    params = [{"block": block_params()} for _ in STAGES]
    params[0]["embed"] = normal(VOCAB, dim, std=1.0)
    params[-1]["norm"] = torch.ones(dim, dtype=torch.float32)
    params[-1]["head"] = normal(dim, VOCAB)
    return params


# -----------------------------------------------------------------------------
# training


def greedy(step, params, prompts, steps, freqs_cis, first_rank):
    """Continue ``prompts`` (B, T) greedily by ``steps`` tokens with forward-only pipeline calls.

    Each call runs the whole prefix again (no KV cache): simple, and the pipeline's logits come
    back on every rank, so every rank appends the same tokens and stays in step.
    """
    seq = prompts
    for _ in range(steps):
        batch = {
            "tokens": seq,
            "positions": torch.arange(seq.shape[1]).expand_as(seq),
            "targets": torch.zeros_like(seq),  # loss_fn needs targets; this loss is not used
            "freqs_cis": freqs_cis,
        }
        _, logits = step.evaluate(params, batch if step.rank in (None, first_rank) else None, outputs=True)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1] :]


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument(
        "--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b", help="pipeline schedule"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data")
    parser.add_argument("--quiet", action="store_true", help="print nothing but the final summary")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--head-dim", type=int, default=16, help="width of an attention head")
    parser.add_argument("--digits", type=int, default=8, help="K, the number of digits to copy")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine decay)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--samples", type=int, default=3, help="greedy continuations printed after training")
    parser.add_argument(
        "--trace", metavar="PATH", help="write the last step's measured timeline as a Chrome trace (Perfetto) JSON"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per pipeline rank (under torchrun; the pipeline gets WORLD_SIZE / tp ranks)",
    )
    args = parser.parse_args(argv)
    if args.dim % args.head_dim or args.head_dim % 2:
        parser.error(f"--dim ({args.dim}) must be a multiple of --head-dim ({args.head_dim}), which must be even")
    heads, hidden = args.dim // args.head_dim, swiglu_width(args.dim)
    if args.tp < 1 or heads % args.tp or hidden % args.tp:
        parser.error(
            f"--tp ({args.tp}) must divide the number of heads ({heads} = --dim / --head-dim) and the MLP's "
            f"width ({hidden}): each tensor-parallel rank holds as many heads and hidden units as the others"
        )
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.tp > 1 and ("RANK" not in os.environ or world % args.tp):
        parser.error(
            f"--tp ({args.tp}) needs torchrun with a multiple of {args.tp} processes (WORLD_SIZE: {world}): "
            f"torchrun --standalone --nproc-per-node {2 * args.tp} examples/train_llama.py --tp {args.tp}"
        )
    return args


def main(argv=None):
    """Train; return the loss of every step."""
    args = parse_args(argv)
    # The matrices are tiny: one thread is as fast as several, and stays fast on a busy machine.
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)

    schedule = {
        "gpipe": GPipe(args.microbatches),
        "1f1b": OneFOneB(args.microbatches),
        "interleaved": Interleaved1F1B(args.microbatches, stages_per_rank=2),  # 4 stages on 2 ranks
    }[args.schedule]
    # Under torchrun (which sets RANK and WORLD_SIZE) the pipeline spans the processes; with --tp
    # they form a pp x tp mesh, each pipeline rank a group of tp processes (global rank = tp * pp + tp index).
    parallel = fpipe.Parallelism()  # one process
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized() and args.tp > 1:
        mesh = init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("pp", "tp"))
        parallel = fpipe.Parallelism(mesh=mesh)
    elif dist.is_initialized():
        parallel = fpipe.Parallelism(group=dist.group.WORLD)
    step = fpipe.pipeline(loss_fn, STAGES, schedule, batch_dims=BATCH_DIMS, parallel=parallel)
    lead = not dist.is_initialized() or dist.get_rank() == 0  # the one process that prints
    chatty = not args.quiet and lead
    if chatty:
        print(f"{step!r}, schedule {schedule}:")
        print(step.program)

    # Every rank draws the same parameters and batches (same seed) but keeps only what it uses.
    params = init_params(args.dim, generator)
    num_params = sum(t.numel() for t in optree.tree_leaves(params))
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    if parallel.mesh is not None:
        params = [None if p is None else distribute_block_weights(p, parallel.mesh["tp"]) for p in params]
    # AdamW (torch.optim's own kernel) with decay on matrices only, warm-up then cosine decay to lr / 10.
    decay = [None if p is None else optree.tree_map(lambda t: t.dim() >= 2, p) for p in params]
    warmup = min(10, args.steps)
    schedule = fpipe.optim.warmup_cosine(args.lr, warmup_steps=warmup, total_steps=args.steps, min_lr=args.lr / 10)
    opt = fpipe.optim.adamw(schedule, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=decay)
    opt_state = opt.init(params)
    freqs_cis = precompute_freqs_cis(args.head_dim, 2 * args.digits)
    first_rank = step.program.placement()[0]
    if chatty:
        tensor_parallel = f", {args.tp}-way tensor parallel" if parallel.mesh is not None else ""
        print(f"{num_params:,} parameters{tensor_parallel}, copy {args.digits} digits, batch {args.batch_size}")

    losses = []
    # A bar on a terminal; in a log file (not a terminal) a plain line every 10 steps instead.
    bar = tqdm(total=args.steps, unit="step", file=sys.stdout, disable=None if chatty else True)
    start = time.perf_counter()
    for it in range(args.steps):
        batch = get_batch(args.batch_size, args.digits, freqs_cis, generator)
        if step.rank not in (None, first_rank):
            batch = None  # data only where it is used: the first stage's rank
        with fpipe.record() if args.trace and it == args.steps - 1 else contextlib.nullcontext() as recording:
            loss, grads = step(params, batch)  # the per-rank part: forwards and backwards of the pipeline
        params, opt_state = opt.update(params, grads, opt_state)
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.4f}", refresh=False)
        bar.update()
        if chatty and bar.disable and (it % 10 == 9 or it == args.steps - 1):
            print(f"step {it + 1}/{args.steps}: loss {losses[-1]:.4f}")
    bar.close()
    elapsed = time.perf_counter() - start

    summary = f"{args.steps} steps in {elapsed:.1f}s: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    # A validation loss: the same pipeline, forward only, on a batch it was not trained on.
    validation = get_batch(args.batch_size, args.digits, freqs_cis, generator)
    val_loss = step.evaluate(params, validation if step.rank in (None, first_rank) else None)
    summary += f", validation loss {val_loss.item():.4f}"
    if args.samples > 0:
        digits = torch.randint(NUM_DIGITS, (max(args.samples, args.microbatches), args.digits), generator=generator)
        prompts = torch.cat([digits, torch.full((digits.shape[0], 1), SEP)], dim=1)
        copies = greedy(step, params, prompts, args.digits, freqs_cis, first_rank)
        for row, copy in list(zip(digits, copies))[: args.samples] if chatty else []:
            print(f"greedy: {' '.join(map(str, row.tolist()))} | -> {' '.join(map(str, copy.tolist()))}")
    if step.rank is None:
        # Evaluate without the pipeline: composing the stage functions is the unsplit model.
        batch = get_batch(256, args.digits, freqs_cis, generator)
        with torch.no_grad():
            x = batch
            for stage, p in zip(STAGES, params):
                x = stage(p, x)
            scored = batch["targets"] != IGNORE
            accuracy = (x.argmax(-1)[scored] == batch["targets"][scored]).float().mean().item()
        summary += f", copy accuracy {accuracy:.1%}"
    if lead:
        print(f"{summary} ({args.schedule}, {args.microbatches} microbatches)")
        if args.trace and recording is not None:
            # measured next to predicted: open both in https://ui.perfetto.dev or chrome://tracing
            with open(args.trace, "w") as f:
                json.dump(chrome_trace(recording.timeline, microseconds_per_unit=1e6), f)
            print(f"measured timeline of the last step written to {args.trace}")
    if dist.is_initialized() and "RANK" in os.environ:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
