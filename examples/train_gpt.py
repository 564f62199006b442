"""Train a small byte-level GPT on real text as a 4-stage pipeline: bf16, AdamW, saves and resume.

    python examples/train_gpt.py                       # about a minute on 2 CPU cores (41-64 s measured)
    python examples/train_gpt.py --overwrite           # again from scratch, deleting runs/gpt's run
    python examples/train_gpt.py --steps 400 --resume  # continue the run saved in runs/gpt
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --out runs/gpt2
    torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --tp 2 --out runs/gpt-tp

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
  losses as an uninterrupted run); ``metrics.jsonl`` is cut back to the saved step first, so the
  steps a killed run ran after its last save, run again, are listed once;
- a run's directory is never written over by mistake: when ``--out`` already holds a save or a
  ``metrics.jsonl``, the script stops with an error unless given ``--resume`` (go on) or
  ``--overwrite`` (delete both and start afresh);
- progress on a terminal (tqdm: loss, tokens per second, ETA), plain lines in a log file, and one
  JSON line of metrics per step in ``<out>/metrics.jsonl``.

Under ``torchrun`` the 4 stages go 2 per rank (1F1B becomes interleaved 1F1B), each rank holds and
saves only its stages, only the first stage's rank reads the data, and every rank gets the loss.

With ``--tp 2`` the processes form a ``("pp", "tp")`` ``DeviceMesh``: 4 processes are 2 pipeline
ranks of 2 tensor-parallel ranks each, and every block is split as in Megatron-LM (the same helpers
as examples/train_llama.py): each tp rank holds half of the heads (their columns of ``qkv``, their
rows of ``proj``) and half of the MLP (columns of ``fc``, rows of ``out``) as DTensors (float32
master weights, computed in bfloat16 by default). Each rank saves its own pieces of its stages'
DTensors under their global names, and ``--resume`` under tp is bitwise the uninterrupted tp run.
The losses are not the one-process run's, though they start within rounding of them: the
row-parallel products are summed in bfloat16 in two halves plus an all-reduce, rounded otherwise
than in one product, so no step's loss is bitwise the same, and the two runs then drift apart as
any two bfloat16 runs do. Measured over the 200 default steps (metrics.jsonl of both runs): step
1's loss within 2.3e-5 (relative), the first 10 steps within 7e-5; then 0.021 apart by step 20
and at most 0.066 (2.6%, step 119); final losses 2.400 (one process) and 2.415 (tp), validation
losses within 0.022 at every evaluation (2.318 and 2.330 at step 200). ``--tp`` must divide the
heads and the number of processes.
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

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


# tensor parallel (--tp), as in examples/train_llama.py: column_input is Megatron-LM's f (identity
# forward, all-reduce of the gradient), row_output its g (all-reduce forward); plain tensors pass.


def local(w):
    """This rank's piece of a weight: the weight itself, or a DTensor's local shard (gradients flow back to it)."""
    return w.to_local() if isinstance(w, DTensor) else w


def column_input(x, weight):
    """``x`` before its product with a column-parallel ``weight``; its gradient summed over the tp ranks."""
    if not isinstance(weight, DTensor):
        return x
    copy = DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)  # no check: no communication
    return copy.to_local(grad_placements=[Partial()])


def row_output(y, weight):
    """The sum over the tp ranks of ``y``, each rank's part of a product with the row-parallel ``weight``."""
    if not isinstance(weight, DTensor):
        return y
    parts = DTensor.from_local(y, weight.device_mesh, [Partial()], run_check=False)
    return parts.redistribute(placements=[Replicate()]).to_local()


# The dimension of each block weight split over the tp ranks: qkv is (dim, 3, dim), so its last
# dimension holds the heads' q, k and v columns alike; norms, embeddings and head stay whole.
TP_SPLIT = {"qkv": 2, "proj": 0, "fc": 1, "out": 0}


def distribute_block_weights(stage_params, tp_mesh):
    """One stage's parameters with its blocks' weights as DTensors sharded over ``tp_mesh`` (every
    rank drew the same full weights: each keeps its shard, without communication)."""

    def place(path, t):
        dim = TP_SPLIT.get(path[-1])
        return t if dim is None else distribute_tensor(t, tp_mesh, [Shard(dim)], src_data_rank=None)

    return optree.tree_map_with_path(place, stage_params)


def block(p, h, n_heads):
    B, T, D = h.shape
    qkv = local(p["qkv"])  # (D, 3, D), or with --tp this rank's heads' columns: (D, 3, D / tp)
    width = qkv.shape[-1]
    x = column_input(layer_norm(p["ln1"], h), p["qkv"])
    q, k, v = (x @ qkv.flatten(1)).split(width, dim=-1)
    q, k, v = (t.view(B, T, -1, D // n_heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, width)
    h = h + row_output(y @ local(p["proj"]), p["proj"])
    x = column_input(layer_norm(p["ln2"], h), p["fc"])
    return h + row_output(F.gelu(x @ local(p["fc"])) @ local(p["out"]), p["out"])


def make_stages(n_heads, blocks_per_stage):
    def run_blocks(p, h):
        for index in sorted(p["blocks"], key=int):  # "4", "5": the model's block numbers
            h = block(p["blocks"][index], h, n_heads)
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
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    def norm():
        return {"w": torch.ones(dim, dtype=torch.float32), "b": torch.zeros(dim, dtype=torch.float32)}

    def new_block():
        return {
            "ln1": norm(),
            "qkv": normal(dim, 3 * dim).view(dim, 3, dim),  # q, k, v side by side
            "proj": normal(dim, dim, std=out_std),
            "ln2": norm(),
            "fc": normal(dim, 4 * dim),
            "out": normal(4 * dim, dim, std=out_std),
        }

    # Blocks keyed by their number in the whole model: a save names each by its key path
    # ("blocks.5.qkv"), the same whichever stage holds it.
    per_stage = num_blocks // 4
    params = [{"blocks": {str(s * per_stage + j): new_block() for j in range(per_stage)}} for s in range(4)]
    params[0]["wte"] = normal(256, dim)
    params[0]["wpe"] = normal(context, dim, std=0.01)
    params[3]["ln_f"] = norm()
    params[3]["head"] = normal(dim, 256)
    return params


# -----------------------------------------------------------------------------
# training


def keep_metrics_until(path, step):
    """Keep the lines of ``path`` (metrics.jsonl) up to ``step``, the step resumed from: the steps a
    killed run ran after its last save are run again, and must not be listed twice. The new file is
    written next to the old one and replaces it in one ``os.replace``: a kill leaves one or the other."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if row["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)


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
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true", help="continue from the last save in --out")
    existing.add_argument(
        "--overwrite", action="store_true", help="start afresh in --out, deleting its save and metrics.jsonl"
    )
    parser.add_argument(
        "--stop-at", type=int, default=None, help="stop after this step, saved (a job's time is up); --resume goes on"
    )
    parser.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of text to read")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the data")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quiet", action="store_true", help="print nothing but the final summary")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel ranks per pipeline rank (under torchrun: WORLD_SIZE / tp)"
    )
    args = parser.parse_args(argv)
    if args.blocks % 4 or args.dim % args.heads:
        parser.error("--blocks must be a multiple of 4 and --dim a multiple of --heads")
    if args.tp < 1 or args.heads % args.tp:
        parser.error(f"--tp ({args.tp}) must divide --heads ({args.heads}): each tp rank holds as many heads")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.tp > 1 and ("RANK" not in os.environ or world % args.tp):
        parser.error(
            f"--tp ({args.tp}) needs torchrun with a multiple of {args.tp} processes (WORLD_SIZE: {world}): "
            f"torchrun --standalone --nproc-per-node {2 * args.tp} examples/train_gpt.py --tp {args.tp}"
        )
    # Checked before main() joins the process group: joining waits for every rank, so no rank has
    # written to --out yet when any rank looks at it, and all of them see the same.
    out = Path(args.out)
    held = [name for name in ("save", "metrics.jsonl") if (out / name).exists()]
    if held and not (args.resume or args.overwrite):
        parser.error(
            f"--out {out} already holds a run ({', '.join(held)}): pass --resume to go on from its save, "
            f"or --overwrite to start afresh (deleting {' and '.join(held)}), or choose another --out"
        )
    if args.resume and "save" not in held:
        parser.error(f"--resume: --out {out} holds no save ({out / 'save'}) to go on from")
    return args


def main(argv=None):
    """Train (or go on training); return the training loss of every step run."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parallel = fpipe.Parallelism()  # one process
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun: one pipeline rank each
        dist.init_process_group("gloo")
    if dist.is_initialized() and args.tp > 1:  # a pp x tp mesh: global rank = tp * pipeline rank + tp rank
        mesh = init_device_mesh("cpu", (dist.get_world_size() // args.tp, args.tp), mesh_dim_names=("pp", "tp"))
        parallel = fpipe.Parallelism(mesh=mesh)
    elif dist.is_initialized():
        parallel = fpipe.Parallelism(group=dist.group.WORLD)
    precision = fpipe.Precision(compute=torch.bfloat16) if args.precision == "bf16" else None
    stages = make_stages(args.heads, args.blocks // 4)
    step = fpipe.pipeline(loss_fn, stages, OneFOneB(args.microbatches), parallel=parallel, precision=precision)
    lead = not dist.is_initialized() or dist.get_rank() == 0  # the one process that prints and writes metrics
    chatty = not args.quiet and lead

    def mine(tree):  # what this rank holds: its stages, None for the others
        return [t if s in step.local_stages else None for s, t in enumerate(tree)]

    params = mine(init_params(args.dim, args.context, args.blocks, torch.Generator().manual_seed(args.seed)))
    if parallel.mesh is not None:
        params = [None if p is None else distribute_block_weights(p, parallel.mesh["tp"]) for p in params]
    decay = [None if p is None else optree.tree_map(lambda t: t.dim() >= 2, p) for p in params]
    warmup = min(args.warmup, args.steps)
    schedule = fpipe.optim.warmup_cosine(args.lr, warmup_steps=warmup, total_steps=args.steps, min_lr=args.lr / 10)
    opt = fpipe.optim.adamw(schedule, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=decay)
    opt_state = opt.init(params)
    out = Path(args.out)
    first = 0
    if args.resume:
        state = fpipe.load_state(out / "save", params, optimizer_state=opt_state, parallel=step)
        params, opt_state, first = list(state.params), list(state.optimizer_state), state.step
        if state.metadata.get("seed") != args.seed:
            sys.exit(f"--resume: the save in {out} was made with --seed {state.metadata.get('seed')}, not {args.seed}")

    data = read_corpus(args.corpus_bytes)
    train, val = data[: len(data) * 9 // 10], data[len(data) * 9 // 10 :]
    holds_data = step.rank in (None, step.program.placement()[0])  # only the first stage's rank reads data

    def batch_at(source, index):
        return get_batch(source, args.batch_size, args.context, args.seed, index) if holds_data else None

    def validation_loss():
        losses = [step.evaluate(params, batch_at(val, -1 - k)) for k in range(4)]  # fixed held-out batches
        return sum(float(loss) for loss in losses) / len(losses)

    if chatty:
        num_params = sum(local(t).numel() for p in params if p is not None for t in optree.tree_leaves(p))
        tp = f", {args.tp}-way tensor parallel" if parallel.mesh is not None else ""
        print(f"{step!r}{tp}, {args.precision}, {len(data):,} bytes of text; rank 0 holds {num_params:,} parameters")
        if first:
            print(f"resuming at step {first} from {out / 'save'}")
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        if args.overwrite:
            shutil.rmtree(out / "save", ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
        if first:
            keep_metrics_until(out / "metrics.jsonl", first)

    losses = []
    tokens = args.batch_size * args.context
    bar = tqdm(total=args.steps, initial=first, unit="step", file=sys.stdout, disable=None if chatty else True)
    start = time.perf_counter()
    with (
        open(out / "metrics.jsonl", "a") if lead else contextlib.nullcontext() as metrics,
        fpipe.AsyncSaver(parallel=step) as saver,  # saves: this rank's stages
    ):
        last = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
        for it in range(first, last):
            tick = time.perf_counter()
            loss, grads = step(params, batch_at(train, it))
            norm = step.global_norm(grads)
            grads = fpipe.optim.clip_by_global_norm(grads, norm, max_norm=1.0)
            opt.update_(params, grads, opt_state)
            losses.append(float(loss))
            row = {"step": it + 1, "loss": losses[-1], "lr": schedule(it), "grad_norm": float(norm)}
            if args.save_every and (it + 1) % args.save_every == 0 and it + 1 < last:
                # The next batch's index is the data position; the saver copies the tensors now.
                state = fpipe.TrainState(params, opt_state, step=it + 1, metadata={"seed": args.seed})
                saver.save_state(out / "save", state)
            if (it + 1) % args.eval_every == 0 or it + 1 == last:
                row["val_loss"] = validation_loss()
            row["tokens_per_s"] = tokens / (time.perf_counter() - tick)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            bar.set_postfix_str(f"loss {losses[-1]:.3f}, {row['tokens_per_s']:,.0f} tok/s", refresh=False)
            bar.update()
            if chatty and bar.disable and ((it + 1) % 10 == 0 or "val_loss" in row):
                shown = f", val {row['val_loss']:.3f}" if "val_loss" in row else ""
                print(f"step {it + 1}/{args.steps}: loss {losses[-1]:.3f}{shown}, {row['tokens_per_s']:,.0f} tok/s")
        state = fpipe.TrainState(params, opt_state, step=last, metadata={"seed": args.seed})
        saver.save_state(out / "save", state)
    bar.close()
    if lead and losses:
        elapsed = time.perf_counter() - start
        print(
            f"steps {first + 1}-{last} in {elapsed:.1f}s: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
            f"validation {row['val_loss']:.3f}; saved to {out / 'save'}"
        )
    if dist.is_initialized() and "RANK" in os.environ:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
