"""Train a small DeepSeek-style mixture of experts on real text, as a 4-stage pipeline in one process
or on pp 2 x ep 2 under torchrun, with both of DeepSeek-V3's load balancers.

    python examples/train_moe.py                       # 150 steps, about a minute on 2 CPU cores (45-66 s measured)
    python examples/train_moe.py --overwrite           # again from scratch, deleting runs/moe's run
    python examples/train_moe.py --steps 300 --resume  # go on from the save in runs/moe, to step 300
    torchrun --standalone --nproc-per-node 4 examples/train_moe.py --out runs/moe-ep           # pp 2 x ep 2
    torchrun --standalone --nproc-per-node 4 examples/train_moe.py --out runs/moe-ep --resume  # each rank its save
    python examples/train_moe.py --precision fp64 --out runs/moe64  # float64: to compare with a torchrun run

The data are train_gpt.py's: the bytes of the Python standard library's source, read from this
Python's installation (no download, no tokenizer), the last 10% held out for validation. The
script is self-contained (its few data and bookkeeping functions are train_gpt.py's, copied) so
that it reads top to bottom alone.

The model is a byte-level decoder in the shape of DeepSeek-V3 (arXiv:2412.19437), made small:

- the first ``--dense-blocks`` blocks have a dense SwiGLU MLP, the others an ``fpipe.moe.moe``
  layer: ``--experts`` fine-grained routed experts, each token going to its ``--top-k`` best, plus
  one shared expert that every token goes through;
- sigmoid router scores (``--score``), the chosen ones normalized to sum to 1;
- the sequence-wise balance loss, scaled by a small ``--balance-coef`` (DeepSeek-V3's alpha);
- the auxiliary-loss-free balancing: each MoE layer's selection bias (a parameter with no
  gradient: the selection is not differentiable) is moved between steps against the step's token
  counts, ``bias += rate * sign(mean(counts) - counts)``, the counts summed over microbatches by the
  pipeline and over the expert-parallel ranks by ``step.replica_sum``.

The 4 stages hold one block each (stage 0 the embeddings too, stage 3 the head). The activation
that goes from stage to stage carries, beside the hidden states, the sum of the balance losses of
the layers so far and their token counts, so that the loss function (on the last stage) adds the
balance term and returns the counts (``has_aux``): under every schedule, this is the unsplit
model's loss (tests/moe/test_in_a_pipeline.py).

Under ``torchrun`` the processes form a ``("pp", "ep")`` ``DeviceMesh`` (WORLD_SIZE / ``--ep``
pipeline ranks of ``--ep`` expert ranks: 4 processes are pp 2 x ep 2). Each expert rank holds
``1 / ep`` of every MoE layer's experts (``fpipe.moe.distribute_experts``) and reads its own share
of each global batch of ``--batch-size`` sequences: the expert ranks are data-parallel for every
weight but the experts (notes/experts.md). The 4 stages go 2 per pipeline rank (1F1B becomes
interleaved 1F1B). The same seed gives both runs the same initial parameters and the same global
batches. Their losses are not bit for bit the same (the expert matmuls see other shapes): they
agree to rounding until the rounding flips a token's choice of expert, in float32 from step 5 on,
after which the runs drift apart; in float64 (``--precision fp64``) no choice flips in the 150
steps and every loss is within 4e-15 (notes/experts.md, "A real run", has the numbers).

Like train_gpt.py: AdamW with warm-up + cosine and clipping by the pipeline's global norm, a
validation loss every ``--eval-every`` steps (``step.evaluate``), saves every ``--save-every``
steps (parameters with the selection biases, optimizer state, step; the data position is the
step), ``--resume`` (bitwise the losses of an uninterrupted run), ``--overwrite``, a tqdm bar on a
terminal (plain lines otherwise), and one JSON line per step in ``<out>/metrics.jsonl``: the loss,
its cross-entropy part, the balance loss and the experts' load, as DeepSeek's papers measure it
(``max_violation``: the most loaded expert's excess over the mean, per MoE layer, averaged).
``--precision bf16`` computes in bfloat16 on float32 master weights (5 times slower on CPU); the
default is float32: the expert choice is discrete, and bfloat16 rounding flips more of them.
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

try:
    from tqdm import tqdm
except ImportError:
    sys.exit("examples/train_moe.py needs tqdm, which the examples extra installs: pip install -e '.[examples]'")

import fpipe
from fpipe.schedules import OneFOneB

# -----------------------------------------------------------------------------
# data: the bytes of the standard library's Python files (as in train_gpt.py)


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
    """Global batch ``index`` of a stream: random windows drawn from a generator seeded by ``(seed,
    index)``, so a resumed run, or one on more processes, draws exactly the same batches."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    starts = torch.randint(len(data) - context - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
    return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


# -----------------------------------------------------------------------------
# the model: pure functions of parameter pytrees


def rms_norm(w, x):
    return F.rms_norm(x, x.shape[-1:], w)


def swiglu(p, x):
    return (F.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def attention(p, x, n_heads):
    B, T, D = x.shape
    q, k, v = (x @ p["qkv"]).split(D, dim=-1)
    q, k, v = (t.view(B, T, n_heads, D // n_heads).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
    return y @ p["proj"]


def block(p, act, index, args):
    """One block on the carried activation ``{"h", "balance", "counts"}``: attention, then the dense
    MLP or the MoE layer, whose balance loss and token counts (row ``index``) are added to the carried ones."""
    h = act["h"]
    h = h + attention(p, rms_norm(p["norm1"], h), args.heads)
    x = rms_norm(p["norm2"], h)
    if "mlp" in p:
        return {**act, "h": h + swiglu(p["mlp"], x)}
    y, stats = fpipe.moe.moe(
        p["moe"], x, top_k=args.top_k, score=args.score, bias=p["bias"], sequence_length=x.shape[1]
    )
    counts = act["counts"].clone()
    counts[index] += stats.counts
    return {"h": h + y, "balance": act["balance"] + stats.balance_loss, "counts": counts}


def make_stages(args):
    def run_blocks(p, act):
        for index in sorted(p["blocks"], key=int):  # "2": the model's block number
            act = block(p["blocks"][index], act, int(index), args)
        return act

    def first(p, batch):
        tokens = batch["tokens"]
        h = p["wte"][tokens] + p["wpe"][: tokens.shape[1]]
        start = {
            "h": h,
            "balance": torch.zeros((), dtype=h.dtype),
            "counts": torch.zeros(args.blocks, args.experts, dtype=torch.int64),  # a row per block
        }
        return run_blocks(p, start)

    def middle(p, act):
        return run_blocks(p, act)

    def last(p, act):
        act = run_blocks(p, act)
        return {**act, "logits": rms_norm(p["norm_f"], act["h"]) @ p["head"]}

    return [first, middle, middle, last]


def make_loss_fn(balance_coef):
    def loss_fn(act, batch):
        """Cross-entropy per byte plus the scaled balance loss; the counts and both parts as ``aux``."""
        at_least_32 = torch.promote_types(act["logits"].dtype, torch.float32)  # bf16 -> float32, float64 kept
        ce = F.cross_entropy(act["logits"].to(at_least_32).flatten(0, 1), batch["targets"].flatten())
        balance = act["balance"].to(at_least_32)
        aux = {"counts": act["counts"], "ce": ce.detach(), "balance": balance.detach()}
        return ce + balance_coef * balance, aux

    return loss_fn


def init_params(args, generator):
    """Four stages of float32 parameters (float64 with ``--precision fp64``): every rank draws all
    of them alike, and keeps its own."""
    dtype = torch.float64 if args.precision == "fp64" else torch.float32
    dim, std = args.dim, 0.02

    def normal(*shape, std=std):
        return torch.randn(*shape, generator=generator, dtype=dtype) * std

    def new_block(index):
        p = {
            "norm1": torch.ones(dim, dtype=dtype),
            "qkv": normal(dim, 3 * dim),
            "proj": normal(dim, dim, std=std / math.sqrt(2 * args.blocks)),
            "norm2": torch.ones(dim, dtype=dtype),
        }
        if index < args.dense_blocks:
            hidden = args.dense_hidden
            p["mlp"] = {"w1": normal(dim, hidden), "w3": normal(dim, hidden), "w2": normal(hidden, dim)}
        else:
            p["moe"] = fpipe.moe.init_moe(dim, args.expert_hidden, args.experts, generator=generator, dtype=dtype)
            p["bias"] = torch.zeros(args.experts, dtype=dtype)  # the selection bias: no gradient, moved by the counts
        return p

    per_stage = args.blocks // 4
    params = [
        {"blocks": {str(s * per_stage + j): new_block(s * per_stage + j) for j in range(per_stage)}} for s in range(4)
    ]
    params[0]["wte"] = normal(256, dim)
    params[0]["wpe"] = normal(args.context, dim, std=0.01)
    params[3]["norm_f"] = torch.ones(dim, dtype=dtype)
    params[3]["head"] = normal(dim, 256)
    return params


def moe_blocks(stage_params):
    """The MoE blocks of one stage's parameters (None: a stage held elsewhere), by block number."""
    blocks = {} if stage_params is None else stage_params["blocks"]
    return {int(i): b for i, b in blocks.items() if "moe" in b}


# -----------------------------------------------------------------------------
# training


def keep_metrics_until(path, step):
    """Keep the lines of ``path`` (metrics.jsonl) up to ``step``, the step resumed from (as in
    train_gpt.py): the steps a killed run ran after its last save run again, listed once."""
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
    parser.add_argument("--steps", type=int, default=150, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, over all expert ranks")
    parser.add_argument("--context", type=int, default=64, help="bytes per sequence")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step and expert rank")
    parser.add_argument("--dim", type=int, default=64, help="model width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (a multiple of 4: 4 stages)")
    parser.add_argument("--dense-blocks", type=int, default=1, help="the first blocks, with a dense MLP")
    parser.add_argument("--dense-hidden", type=int, default=192, help="the dense MLP's hidden size")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2, help="routed experts per token")
    parser.add_argument(
        "--expert-hidden", type=int, default=32, help="each expert's hidden size (the shared one's too)"
    )
    parser.add_argument("--score", choices=["sigmoid", "softmax"], default="sigmoid", help="router scores")
    parser.add_argument("--balance-coef", type=float, default=1e-3, help="the balance loss's coefficient")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="the selection bias's update speed")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, default=15, help="warm-up steps")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp64"], default="fp32", help="compute dtype")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation losses")
    parser.add_argument("--save-every", type=int, default=50, help="steps between saves (0: never)")
    parser.add_argument("--out", default="runs/moe", help="directory of the saves and metrics.jsonl")
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
        "--ep", type=int, default=2, help="under torchrun: expert-parallel ranks (pipeline ranks: WORLD_SIZE / ep)"
    )
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1
    args.ep = args.ep if "RANK" in os.environ else 1  # one process holds every expert
    if args.blocks % 4 or args.dim % args.heads or not 0 <= args.dense_blocks < args.blocks:
        parser.error("--blocks must be a multiple of 4, --dim a multiple of --heads, --dense-blocks below --blocks")
    if args.ep < 1 or world % args.ep or args.experts % args.ep:
        parser.error(
            f"--ep ({args.ep}) must divide the processes ({world}) and --experts ({args.experts}): "
            "torchrun --standalone --nproc-per-node 4 examples/train_moe.py --ep 2"
        )
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k ({args.top_k}) must be from 1 to --experts ({args.experts})")
    if args.batch_size % (args.ep * args.microbatches):
        parser.error(
            f"--batch-size ({args.batch_size}) must be a multiple of --microbatches ({args.microbatches}) "
            f"times the expert ranks ({args.ep}): equal microbatches make the loss the global batch's mean"
        )
    # Checked before main() joins the process group, as in train_gpt.py: every rank sees the same.
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
    parallel, mesh, ep_rank = fpipe.Parallelism(), None, 0  # one process
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():  # a pp x ep mesh: global rank = ep * pipeline rank + expert rank
        mesh = init_device_mesh("cpu", (dist.get_world_size() // args.ep, args.ep), mesh_dim_names=("pp", "ep"))
        parallel, ep_rank = fpipe.Parallelism(mesh=mesh), mesh["ep"].get_local_rank()
    precision = fpipe.Precision(compute=torch.bfloat16) if args.precision == "bf16" else None
    loss_fn = make_loss_fn(args.balance_coef)
    schedule = OneFOneB(args.microbatches)
    step = fpipe.pipeline(loss_fn, make_stages(args), schedule, has_aux=True, parallel=parallel, precision=precision)
    lead = not dist.is_initialized() or dist.get_rank() == 0  # the one process that prints and writes metrics
    chatty = not args.quiet and lead

    def mine(tree):  # what this rank holds: its stages, None for the others
        return [t if s in step.local_stages else None for s, t in enumerate(tree)]

    full = init_params(args, torch.Generator().manual_seed(args.seed))
    num_params = sum(t.numel() for p in full for t in optree.tree_leaves(p))
    params = mine(full)
    if mesh is not None:  # each expert rank keeps its block of every MoE layer's experts
        for p in params:
            for b in moe_blocks(p).values():
                b["moe"] = fpipe.moe.distribute_experts(b["moe"], mesh["ep"])
    # Decay on matrices only. The selection biases (1-D, zero gradients) are thus never moved by
    # AdamW, whose update of a zero gradient is zero: only the counts below move them.
    decay = [None if p is None else optree.tree_map(lambda t: t.dim() >= 2, p) for p in params]
    warmup = min(args.warmup, args.steps)
    lr = fpipe.optim.warmup_cosine(args.lr, warmup_steps=warmup, total_steps=args.steps, min_lr=args.lr / 10)
    opt = fpipe.optim.adamw(lr, betas=(0.9, 0.95), weight_decay=0.1, weight_decay_mask=decay)
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
    share = args.batch_size // args.ep  # this expert rank's rows of each global batch

    def batch_at(source, index):
        if 0 not in step.local_stages:  # only the first stage's ranks read data
            return None
        batch = get_batch(source, args.batch_size, args.context, args.seed, index)
        return {k: v[ep_rank * share : (ep_rank + 1) * share] for k, v in batch.items()}

    def replica_mean(x):  # a per-microbatch metric of this replica -> the global batch's mean
        return float(step.replica_sum(x.mean())) / args.ep

    def validation_loss():
        ces = [replica_mean(step.evaluate(params, batch_at(val, -1 - k))[1]["ce"]) for k in range(4)]
        return sum(ces) / len(ces)  # the cross-entropy of fixed held-out batches, without the balance term

    if chatty:
        ep = f", pp {dist.get_world_size() // args.ep} x ep {args.ep}" if mesh is not None else ""
        print(
            f"{step!r}{ep}, {args.precision}, {len(data):,} bytes of text; {num_params:,} parameters, "
            f"{args.blocks - args.dense_blocks} MoE layers of {args.experts} experts (top {args.top_k}) + a shared one"
        )
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
        fpipe.AsyncSaver(parallel=step) as saver,  # saves: this rank's stages, its experts
    ):
        last = args.steps if args.stop_at is None else min(args.stop_at, args.steps)
        for it in range(first, last):
            tick = time.perf_counter()
            (loss, aux), grads = step(params, batch_at(train, it))
            norm = step.global_norm(grads)
            grads = fpipe.optim.clip_by_global_norm(grads, norm, max_norm=1.0)
            opt.update_(params, grads, opt_state)
            # The auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): the global batch's
            # tokens per expert, summed over microbatches and expert ranks, move each MoE layer's
            # selection bias towards the under-loaded experts. Every rank sees the same counts.
            counts = step.replica_sum(aux["counts"].sum(0)).double()  # [blocks, experts]
            with torch.no_grad():
                for p in params:
                    for index, b in moe_blocks(p).items():
                        b["bias"] += args.bias_rate * torch.sign(counts[index].mean() - counts[index]).to(
                            b["bias"].dtype
                        )
            moe_counts = counts[args.dense_blocks :]
            mean_load = moe_counts.mean(dim=1)
            violation = ((moe_counts.max(dim=1).values - mean_load) / mean_load).mean()
            losses.append(float(loss))
            row = {
                "step": it + 1,
                "loss": losses[-1],
                "ce": replica_mean(aux["ce"]),
                "balance": replica_mean(aux["balance"]),
                "max_violation": float(violation),
                "lr": lr(it),
                "grad_norm": float(norm),
            }
            if args.save_every and (it + 1) % args.save_every == 0 and it + 1 < last:
                state = fpipe.TrainState(params, opt_state, step=it + 1, metadata={"seed": args.seed})
                saver.save_state(out / "save", state)
            if (it + 1) % args.eval_every == 0 or it + 1 == last:
                row["val_ce"] = validation_loss()
            row["tokens_per_s"] = tokens / (time.perf_counter() - tick)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            bar.set_postfix_str(
                f"loss {losses[-1]:.3f}, load {row['max_violation']:.2f}, {row['tokens_per_s']:,.0f} tok/s",
                refresh=False,
            )
            bar.update()
            if chatty and bar.disable and ((it + 1) % 10 == 0 or "val_ce" in row):
                shown = f", val {row['val_ce']:.3f}" if "val_ce" in row else ""
                print(
                    f"step {it + 1}/{args.steps}: loss {losses[-1]:.3f}{shown}, "
                    f"max violation {row['max_violation']:.2f}, {row['tokens_per_s']:,.0f} tok/s"
                )
        state = fpipe.TrainState(params, opt_state, step=last, metadata={"seed": args.seed})
        saver.save_state(out / "save", state)
    bar.close()
    if lead and losses:
        elapsed = time.perf_counter() - start
        print(
            f"steps {first + 1}-{last} in {elapsed:.1f}s: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"validation {row['val_ce']:.4f}; saved to {out / 'save'}"
        )
    if dist.is_initialized() and "RANK" in os.environ:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
