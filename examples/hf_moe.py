"""Train a Hugging Face Mixtral (a mixture of experts) as pipeline stages, its experts spread over ranks.

    pip install -e ".[hf]"                                        # transformers>=5
    python examples/hf_moe.py                                     # one process: 2 stages, all 4 experts
    torchrun --standalone --nproc-per-node 4 examples/hf_moe.py   # pp 2 x ep 2: each rank 2 of the experts
    python examples/hf_moe.py --checkpoint DIR --export OUT       # a checkpoint of your own, trained, written back

The model is ``MixtralForCausalLM`` from a small ``MixtralConfig`` with random weights (nothing is
downloaded), written by ``save_pretrained(..., save_original_format=False)`` into a temporary
directory (or read from ``--checkpoint``): transformers 5 holds each layer's experts as two 3-D
tensors, ``mlp.experts.gate_up_proj`` ``[E, 2 I, d]`` and ``mlp.experts.down_proj`` ``[E, d, I]``,
and that flag writes them so. (Its default, the "original format" of Hub checkpoints, writes one
``block_sparse_moe.experts.{e}.w1/w2/w3.weight`` per expert instead; convert such a checkpoint once
with ``from_pretrained(path).save_pretrained(new_path, save_original_format=False)``.)

``fpipe.split_module`` cuts the model by module name into two stages, keeping its parameter names:

    stage 0: model.embed_tokens + model.rotary_emb + model.layers[0:k]
    stage 1: model.layers[k:] + model.norm + lm_head

The adapters are examples/hf_llama.py's (a Mixtral decoder layer is called as a Llama one). Each
layer's ``MixtralSparseMoeBlock`` keeps its module and parameters, but its ``forward`` is replaced
by ``sparse_moe_block``: Hugging Face's routing (softmax in float32, top-k, renormalized) through
``fpipe.moe.route``, its SwiGLU experts, and the tokens sent to their experts and back by
``fpipe.moe.dispatch`` and ``combine``. When the expert tensors are DTensors ``Shard(0)`` on
``mesh["ep"]``, a rank runs only its block of experts, on the rows every rank of its expert group
sends it; otherwise all experts run here.

Under ``torchrun`` the processes form a ``("pp", "ep")`` mesh (WORLD_SIZE / ``--ep`` pipeline ranks
of ``--ep`` expert ranks). The template of ``fpipe.load_hf`` is built on the meta device, its expert
tensors DTensors on ``mesh["ep"]``, so each rank reads from the checkpoint only its stage's names,
and of their expert tensors only its own experts' rows. Each expert rank trains on its own share
of every global batch (the expert ranks are data-parallel for the other weights, notes/experts.md).
At the end ``fpipe.save_hf`` writes the trained model back as a Hugging Face checkpoint (each
expert tensor gathered whole), which ``MixtralForCausalLM.from_pretrained`` loads.

tests/test_hf_moe.py checks that the loss and every gradient equal those of the Hugging Face
model's own ``loss.backward()`` (1e-10 in float64), in one process and on pp 2 x ep 2.
"""

import argparse
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

try:
    from transformers import MixtralConfig, MixtralForCausalLM
except ImportError as missing:
    sys.exit(f"examples/hf_moe.py needs {missing.name}, which the hf extra installs: pip install -e '.[hf]'")

import fpipe
from fpipe.schedules import OneFOneB

NUM_DIGITS = 16  # tokens 0..15 are digits
SEP = NUM_DIGITS  # token 16 separates the digits from their copy
VOCAB = NUM_DIGITS + 1
IGNORE = -100  # labels that the loss skips
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # [E, ...]: split over mesh["ep"]


def get_batch(batch_size, k, generator):
    """``digits SEP digits`` with Hugging Face labels: aligned with the inputs, shifted in the loss."""
    digits = torch.randint(NUM_DIGITS, (batch_size, k), generator=generator)
    input_ids = torch.cat([digits, torch.full((batch_size, 1), SEP), digits], dim=1)  # (B, 2K+1)
    labels = input_ids.clone()
    labels[:, : k + 1] = IGNORE  # only the copy is scored
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def build_config(layers=2, hidden=32, experts=4, top_k=2, dtype=torch.float32):
    """A small Mixtral. ``eager`` attention and experts: plain matmuls and Hugging Face's loop over
    the experts, the same in every dtype (its ``grouped_mm`` takes no float64)."""
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden,  # each expert's
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
        sliding_window=None,
        attn_implementation="eager",
        experts_implementation="eager",
        dtype=dtype,
    )


def read_config(directory):
    """The config of the checkpoint in ``directory``, with ``eager`` attention as ``build_config``'s
    (the implementation is not saved: ``from_pretrained`` would choose ``sdpa``, whose softmax is not
    Hugging Face's eager float32 one)."""
    return MixtralConfig.from_pretrained(directory, attn_implementation="eager")


def write_checkpoint(directory, config, seed=0):
    """A random ``MixtralForCausalLM`` of ``config``, written with its experts as 3-D tensors; returned."""
    torch.manual_seed(seed)
    model = MixtralForCausalLM(config).to(config.dtype)
    model.save_pretrained(directory, save_original_format=False)
    return model


# -----------------------------------------------------------------------------
# the MoE block through fpipe.moe


def sparse_moe_block(block, hidden_states):
    """``MixtralSparseMoeBlock.forward`` through ``fpipe.moe``, on the block's (stage's) parameters.

    Hugging Face's routing (``MixtralTopKRouter``): softmax of the router logits in float32, the
    top-k experts, their probabilities renormalized to sum to 1; each expert is
    ``down_proj[e] @ (silu(gate) * up)`` with ``gate, up = gate_up_proj[e] @ x`` halved; the outputs
    are summed weighted by the routing. ``route`` breaks ties by the lower expert index (random
    logits have none); ``dispatch`` and ``combine`` replace the loop over experts and its
    ``index_add_``, over the expert group when the expert tensors are DTensors.
    """
    if block.training and block.jitter_noise > 0:
        raise ValueError("examples/hf_moe.py: router_jitter_noise is not supported; set it to 0 in the config.")
    shape = hidden_states.shape
    tokens = hidden_states.reshape(-1, shape[-1])
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    num_experts, group = gate_up.shape[0], None
    if isinstance(gate_up, DTensor):  # this rank's experts, and the group of ranks holding the others
        group = gate_up.device_mesh.get_group()
        gate_up, down = gate_up.to_local(), down.to_local()
    logits = F.linear(tokens, block.gate.weight)
    routing = fpipe.moe.route(logits.float(), block.top_k, normalize=True)  # float32, as Hugging Face
    rows, handle = fpipe.moe.dispatch(tokens, routing, num_experts, group)
    outputs = []
    for e, x in enumerate(torch.split(rows, handle.tokens_per_expert.tolist())):  # local expert e
        gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
        outputs.append(F.linear(block.experts.act_fn(gate) * up, down[e]))
    return fpipe.moe.combine(torch.cat(outputs), handle).reshape(shape)


def expert_parallel(model):
    """``model`` with each layer's MoE block running ``sparse_moe_block`` (names and parameters kept)."""
    for layer in model.model.layers:
        layer.mlp.forward = functools.partial(sparse_moe_block, layer.mlp)
    return model


def meta_model(config, dtype):
    """The model of ``config`` on the meta device (nothing allocated), but for its rotary table (a
    buffer, not in checkpoints), with ``sparse_moe_block``s."""
    with torch.device("meta"):
        model = MixtralForCausalLM(config).to(dtype)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return expert_parallel(model)


def distribute_experts(params, ep_mesh):
    """``params`` (one stage's) with each expert tensor a DTensor ``Shard(0)`` on ``ep_mesh``:
    this rank's block of experts ``[r E/R, (r+1) E/R)``, rows of the tensor (no communication)."""
    rank, size = ep_mesh.get_local_rank(), ep_mesh.size()
    out = dict(params)
    for name, t in params.items():
        if name.endswith(EXPERT_TENSORS):
            block = t.shape[0] // size
            piece = t[rank * block : (rank + 1) * block]  # a meta tensor's rows are meta too
            out[name] = DTensor.from_local(
                piece, ep_mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
            )
    return out


# -----------------------------------------------------------------------------
# how each module is called: the activation is {"hidden", "position_ids", "cos_sin", "attention_mask"}


def causal_mask(attention_mask, dtype):
    """The additive (B, 1, T, T) mask of ``MixtralModel``: 0 where query i may see key j <= i, else min."""
    length = attention_mask.shape[-1]
    allowed = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = allowed & attention_mask[:, None, None, :].bool()
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def embed(embed_tokens, batch):
    input_ids = batch["input_ids"]
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return {"hidden": embed_tokens(input_ids), "position_ids": position_ids, "attention_mask": batch["attention_mask"]}


def rotary(rotary_emb, x):
    return {**x, "cos_sin": rotary_emb(x["hidden"], x["position_ids"])}


def decoder_layer(layer, x):
    out = layer(
        x["hidden"],
        attention_mask=causal_mask(x["attention_mask"], x["hidden"].dtype),
        position_ids=x["position_ids"],
        position_embeddings=x["cos_sin"],
    )
    return {**x, "hidden": out}


CALL = {
    "model.embed_tokens": embed,
    "model.rotary_emb": rotary,
    "model.layers": decoder_layer,
    "model.norm": lambda norm, x: norm(x["hidden"]),
    # lm_head: the default, lm_head(x), on the normalized hidden states -> logits
}


def split(model, k):
    """Two stages: embeddings and layers [0, k); layers [k, n), final norm and output head."""
    spec = [
        f"model.embed_tokens + model.rotary_emb + model.layers[0:{k}]",
        f"model.layers[{k}:] + model.norm + lm_head",
    ]
    return fpipe.split_module(model, spec, call=CALL)


def loss_fn(logits, microbatch):
    """Next-token cross-entropy, mean over scored tokens: Hugging Face's causal LM loss, in any dtype."""
    labels = microbatch["labels"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)


def load(directory, template, step, mesh, dtype=None):
    """This rank's stages of the checkpoint in ``directory``: its expert tensors' own rows only."""
    if mesh is not None:
        template = [distribute_experts(p, mesh["ep"]) for p in template]
    mine = [p if s in step.local_stages else None for s, p in enumerate(template)]
    return fpipe.load_hf(directory, mine, dtype=dtype, parallel=step)


# -----------------------------------------------------------------------------
# training


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step (and expert rank)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step, over all expert ranks")
    parser.add_argument("--digits", type=int, default=4, help="K, the number of digits to copy")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (each stage gets half)")
    parser.add_argument("--hidden", type=int, default=32, help="hidden size")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random checkpoint and the data")
    parser.add_argument(
        "--ep", type=int, default=2, help="under torchrun: expert ranks (pipeline ranks: WORLD_SIZE / ep)"
    )
    parser.add_argument("--checkpoint", help="a Mixtral checkpoint, experts fused (None: a random one)")
    parser.add_argument("--export", help="write the trained model here as a Hugging Face checkpoint")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quiet", action="store_true", help="print nothing but the final summary")
    return parser.parse_args(argv)


def main(argv=None):
    """Train; return the loss of every step."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    parallel, mesh, ep_rank, ep = fpipe.Parallelism(), None, 0, 1  # one process
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():  # a pp x ep mesh: global rank = ep * pipeline rank + expert rank
        ep = args.ep
        mesh = init_device_mesh("cpu", (dist.get_world_size() // ep, ep), mesh_dim_names=("pp", "ep"))
        parallel, ep_rank = fpipe.Parallelism(mesh=mesh), mesh["ep"].get_local_rank()
    lead = not dist.is_initialized() or dist.get_rank() == 0  # the one process that prints
    with tempfile.TemporaryDirectory(prefix="hf_moe_") as scratch:
        checkpoint = args.checkpoint
        if checkpoint is None:  # a random model, written by one process into a directory all can read
            config = build_config(args.layers, args.hidden, args.experts, args.top_k)
            names = [str(Path(scratch) / "random")]
            if lead:
                write_checkpoint(names[0], config, args.seed)
            if dist.is_initialized():
                dist.broadcast_object_list(names, src=0)
                dist.barrier()
            checkpoint = names[0]
        config = read_config(checkpoint)
        model = meta_model(config, torch.float32)
        stages, template = split(model, config.num_hidden_layers // 2)
        step = fpipe.pipeline(loss_fn, stages, OneFOneB(args.microbatches), parallel=parallel)
        params = load(checkpoint, template, step, mesh, dtype=torch.float32)
        if not args.quiet and lead:
            where = f"pp {dist.get_world_size() // ep} x ep {ep}" if mesh is not None else "one process"
            print(
                f"{checkpoint}: {config.num_local_experts} experts per layer, top {config.num_experts_per_tok}; {where}"
            )
            print(step.program)

        opt = fpipe.optim.adamw(args.lr, weight_decay=0.0)
        opt_state = opt.init(params)
        generator = torch.Generator().manual_seed(args.seed)
        share = args.batch_size // ep  # this expert rank's rows of each global batch
        losses = []
        start = time.perf_counter()
        for it in range(args.steps):
            batch = get_batch(args.batch_size, args.digits, generator)  # every rank draws it: same data
            mine = {k: v[ep_rank * share : (ep_rank + 1) * share] for k, v in batch.items()}
            loss, grads = step(params, mine if 0 in step.local_stages else None)
            opt.update_(params, grads, opt_state)
            losses.append(float(loss))  # the mean over the expert ranks' batches
            if not args.quiet and lead and (it % 10 == 9 or it == args.steps - 1):
                print(f"step {it + 1}/{args.steps}: loss {losses[-1]:.4f}")
        elapsed = time.perf_counter() - start
        if args.export:  # each expert tensor gathered whole; one rank per stage writes
            fpipe.save_hf(args.export, params, config=checkpoint, parallel=step)
    if lead:
        print(
            f"{args.steps} steps in {elapsed:.1f}s: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f"; exported to {args.export}" if args.export else "")
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
