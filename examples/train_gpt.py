"""Train a small byte-level GPT on real text as a 4-stage pipeline: bf16, AdamW, saves and resume.

    python examples/train_gpt.py                       # ~1 minute on 2 CPU cores
    python examples/train_gpt.py --steps 400 --resume  # continue the run saved in runs/gpt
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py

The text is the Python standard library's own source code, read at run time from this Python's
installation (no download): every machine with Python has it. Tokens are bytes (a vocabulary of
256), so there is no tokenizer to install either. The last 10% of the text is held out for the
validation loss.

What a real run needs, each one line here:

- precision: parameters kept in float32 (master weights), stages computing in bfloat16, gradients
  summed over microbatches in float32 (``fpipe.Precision(compute=torch.bfloat16)``);
- an optimizer over the per-stage parameter pytrees: ``fpipe.optim.adamw`` (torch.optim's own
  kernel) with a warm-up + cosine learning rate, weight decay on matrices only, and gradient
  clipping by the global norm of the whole pipeline (``step.global_norm``);
- a validation loss every ``--eval-every`` steps through the forward-only pipeline
  (``step.evaluate``: no graph, no gradients);
- saves every ``--save-every`` steps that do not stop training (``asynchronous=True``: a host
  copy, written by a background thread), holding everything a resume needs: parameters,
  optimizer state, step, every rank's random state, and the data position as metadata;
- ``--resume``: continue from the last save as if the run had never stopped (bitwise the same
  losses as an uninterrupted run);
- progress on a terminal (tqdm: loss, tokens per second, ETA), plain lines in a log file, and one
  JSON line of metrics per step in ``<out>/metrics.jsonl``.

Under ``torchrun`` the 4 stages go 2 per rank (1F1B becomes interleaved 1F1B), each rank holds and
saves only its stages, only the first stage's rank reads the data, and every rank gets the loss.
"""

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    from tqdm import tqdm
except ImportError:
    sys.exit("examples/train_gpt.py needs tqdm, which the examples extra installs: pip install -e '.[examples]'")

import fpipe
from fpipe.schedules import OneFOneB

# -----------------------------------------------------------------------------
# data: the bytes of the standard library's Python files


def read_corpus(max_bytes):
    """Up to ``max_bytes`` of Python source from the standard library, in a fixed file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def get_batch(data, batch_size, context, seed, index):
    """Batch ``index`` of a stream: random windows drawn from a generator seeded by ``(seed,
    index)``, so a resumed run draws exactly the batches the uninterrupted one would have."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    starts = torch.randint(len(data) - context - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
    return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


# -----------------------------------------------------------------------------
# the model: pure functions of parameter pytrees


def layer_norm(p, x):
    return F.layer_norm(x, x.shape[-1:], p["w"], p["b"])


def block(p, h, n_heads):
    B, T, D = h.shape
    q, k, v = (layer_norm(p["ln1"], h) @ p["qkv"]).split(D, dim=-1)
    q, k, v = (t.view(B, T, n_heads, D // n_heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
    h = h + y @ p["proj"]
    return h + F.gelu(layer_norm(p["ln2"], h) @ p["fc"]) @ p["out"]


def make_stages(n_heads, blocks_per_stage):
    def run_blocks(p, h):
        for b in p["blocks"]:
            h = block(b, h, n_heads)
        return h

    def first(p, batch):
        tokens = batch["tokens"]
        h = p["wte"][tokens] + p["wpe"][: tokens.shape[1]]
        return run_blocks(p, h)

    def middle(p, h):
        return run_blocks(p, h)

    def last(p, h):
        return layer_norm(p["ln_f"], run_blocks(p, h)) @ p["head"]  # logits

    return [first, middle, middle, last]


def loss_fn(logits, batch):
    """Cross-entropy per byte, averaged over the microbatch (in float32 whatever the compute dtype)."""
    return F.cross_entropy(logits.float().flatten(0, 1), batch["targets"].flatten())


def init_params(dim, context, num_blocks, generator):
    """Four stages of float32 parameters, GPT-2 style init."""
    std, out_std = 0.02, 0.02 / math.sqrt(2 * num_blocks)

    def normal(*shape, std=std):
        return torch.randn(*shape, generator=generator) * std

    def norm():
        return {"w": torch.ones(dim), "b": torch.zeros(dim)}

    def new_block():
        return {
            "ln1": norm(),
            "qkv": normal(dim, 3 * dim),
            "proj": normal(dim, dim, std=out_std),
            "ln2": norm(),
            "fc": normal(dim, 4 * dim),
            "out": normal(4 * dim, dim, std=out_std),
        }

    per_stage = num_blocks // 4
    params = [{"blocks": [new_block() for _ in range(per_stage)]} for _ in range(4)]
    params[0]["wte"] = normal(256, dim)
    params[0]["wpe"] = normal(context, dim, std=0.01)
    params[3]["ln_f"] = norm()
    params[3]["head"] = normal(dim, 256)
    return params


# -----------------------------------------------------------------------------
# training


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (a multiple of 4: 4 stages)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="compute dtype")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation losses")
    parser.add_argument("--save-every", type=int, default=50, help="steps between saves (0: never)")
    parser.add_argument("--out", default="runs/gpt", help="directory of the saves and metrics.jsonl")
    parser.add_argument("--resume", action="store_true", help="continue from the last save in --out")
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of text to read")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quiet", action="store_true", help="print nothing but the final summary")
    args = parser.parse_args(argv)
    if args.blocks % 4 or args.dim % args.heads:
        parser.error("--blocks must be a multiple of 4 and --dim a multiple of --heads")
    return args
