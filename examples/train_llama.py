"""Train a small Llama-style decoder as a 4-stage pipeline, in one process or on several.

    python examples/train_llama.py
    python examples/train_llama.py --schedule interleaved --microbatches 8
    torchrun --standalone --nproc-per-node 2 examples/train_llama.py

The same script runs unchanged under ``torchrun``: it then joins a gloo process group, and
``fpipe.pipeline(..., group=...)`` puts the 4 stages on 2 processes (looped placement, so 1F1B
becomes interleaved 1F1B). Each rank builds only the parameters of ``step.local_stages``, only
the rank of stage 0 is given the batch, and every rank gets the loss.

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
    B, T, D = x.shape
    head_dim = 2 * freqs_cis.shape[-1]  # the table fixes the head size
    n_heads = D // head_dim
    q = (x @ p["wq"]).view(B, T, n_heads, head_dim)
    k = (x @ p["wk"]).view(B, T, n_heads, head_dim)
    v = (x @ p["wv"]).view(B, T, n_heads, head_dim)
    freqs = freqs_cis[positions]  # (B, T, head_dim/2): each token's rotation
    q, k = apply_rope(q, freqs), apply_rope(k, freqs)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2).reshape(B, T, D) @ p["wo"]


def mlp(p, x):
    return (F.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]  # SwiGLU


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


def init_params(dim, generator):
    """One parameter dict per stage, float32, Llama-like init (output projections scaled down)."""
    hidden = 8 * ((8 * dim // 3 + 7) // 8)  # SwiGLU width: 2/3 of 4 * dim, rounded up to 8
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
    args = parser.parse_args(argv)
    if args.dim % args.head_dim or args.head_dim % 2:
        parser.error(f"--dim ({args.dim}) must be a multiple of --head-dim ({args.head_dim}), which must be even")
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
    # Under torchrun (which sets RANK and WORLD_SIZE) the pipeline spans the processes.
    group = None
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        group = dist.group.WORLD
    step = fpipe.pipeline(loss_fn, STAGES, schedule, batch_dims=BATCH_DIMS, group=group)
    chatty = not args.quiet and step.rank in (None, 0)
    if chatty:
        print(f"{step!r}, schedule {schedule}:")
        print(step.program)

    # Every rank draws the same parameters and batches (same seed) but keeps only what it uses.
    params = init_params(args.dim, generator)
    num_params = sum(t.numel() for t in optree.tree_leaves(params))
    params = [p if s in step.local_stages else None for s, p in enumerate(params)]
    # AdamW (torch.optim's own kernel) with decay on matrices only, warm-up then cosine decay to lr / 10.
    decay = [None if p is None else optree.tree_map(lambda t: t.dim() >= 2, p) for p in params]
    warmup = min(10, args.steps)
    schedule = fpipe.optim.warmup_cosine(args.lr, warmup_steps=warmup, total_steps=args.steps, min_lr=args.lr / 10)
    opt = fpipe.optim.adamw(schedule, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=decay)
    opt_state = opt.init(params)
    freqs_cis = precompute_freqs_cis(args.head_dim, 2 * args.digits)
    first_rank = step.program.placement()[0]
    if chatty:
        print(f"{num_params:,} parameters, copy {args.digits} digits, batch {args.batch_size}")

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
    if step.rank in (None, 0):
        print(f"{summary} ({args.schedule}, {args.microbatches} microbatches)")
        if args.trace and recording is not None:
            # measured next to predicted: open both in https://ui.perfetto.dev or chrome://tracing
            with open(args.trace, "w") as f:
                json.dump(chrome_trace(recording.timeline, microseconds_per_unit=1e6), f)
            print(f"measured timeline of the last step written to {args.trace}")
    if group is not None and "RANK" in os.environ:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
