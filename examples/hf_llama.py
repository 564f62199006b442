"""Train a Hugging Face ``transformers`` Llama as a 3-stage pipeline, cut by ``fpipe.split_module``.

    pip install -e ".[hf]"          # transformers>=4.48
    python examples/hf_llama.py
    python examples/hf_llama.py --schedule gpipe --microbatches 8 --steps 200

The model is ``LlamaForCausalLM`` built from a small ``LlamaConfig`` with random weights (nothing
is downloaded), with tied input and output embeddings. ``fpipe.split_module`` cuts it by module
name into three stage functions, keeping the model's parameter names:

    stage 0: model.embed_tokens + model.rotary_emb + model.layers[0:k]
    stage 1: model.layers[k:]
    stage 2: model.norm + lm_head            (lm_head.weight is model.embed_tokens.weight)

``LlamaModel.forward`` computes the rotary table (cos, sin) once and calls every decoder layer as
``layer(h, attention_mask=causal_mask, position_embeddings=(cos, sin), position_ids=...)``. So
the activation between stages is a dict: the hidden states, the position ids, the (cos, sin)
table computed by stage 0 (from buffers: it carries no graph, so no cotangent comes back), and
the (B, T) padding mask, from which each layer's adapter rebuilds the (B, 1, T, T) additive causal
mask rather than sending it. The adapters in ``CALL`` say how each module is called.

The tied embedding is in stage 0 and stage 2, so each gets a partial gradient; ``fpipe.sum_tied``
adds them. The gradients are then written into the parameters' ``.grad`` and a plain
``torch.optim.AdamW`` steps the model: the stage parameters are detached aliases of the model's
own, so the next step sees the update. The task is the copy task of ``train_llama.py``: ``K``
random digits, a separator, the same digits again; the loss is scored on the copy.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F

try:
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as missing:
    sys.exit(f"examples/hf_llama.py needs {missing.name}, which the hf extra installs: pip install -e '.[hf]'")

import fpipe
from fpipe.schedules import GPipe, OneFOneB

NUM_DIGITS = 16  # tokens 0..15 are digits
SEP = NUM_DIGITS  # token 16 separates the digits from their copy
VOCAB = NUM_DIGITS + 1
IGNORE = -100  # labels that the loss skips


def get_batch(batch_size, k, generator):
    """``digits SEP digits`` with Hugging Face labels: aligned with the inputs, shifted in the loss."""
    digits = torch.randint(NUM_DIGITS, (batch_size, k), generator=generator)
    input_ids = torch.cat([digits, torch.full((batch_size, 1), SEP), digits], dim=1)  # (B, 2K+1)
    labels = input_ids.clone()
    labels[:, : k + 1] = IGNORE  # only the copy is scored
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def build_model(layers=4, hidden=32, heads=4, seed=0, dtype=torch.float32, tied=True):
    """A small random Llama. ``eager`` attention: plain matmuls, the same in every dtype."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,  # grouped-query attention, as in Llama 2/3
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).to(dtype)


# -----------------------------------------------------------------------------
# how each module is called: the activation is {"hidden", "position_ids", "cos_sin", "attention_mask"}


def causal_mask(attention_mask, dtype):
    """The additive (B, 1, T, T) mask of ``LlamaModel``: 0 where query i may see key j <= i, else min."""
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
    return {**x, "hidden": out[0] if isinstance(out, tuple) else out}  # a tuple before transformers 4.54


CALL = {
    "model.embed_tokens": embed,
    "model.rotary_emb": rotary,
    "model.layers": decoder_layer,
    "model.norm": lambda norm, x: norm(x["hidden"]),
    # lm_head: the default, lm_head(x), on the normalized hidden states -> logits
}


def split(model, k):
    """Three stages: embeddings and layers [0, k), layers [k, n), final norm and output head."""
    spec = [
        f"model.embed_tokens + model.rotary_emb + model.layers[0:{k}]",
        f"model.layers[{k}:]",
        "model.norm + lm_head",
    ]
    return fpipe.split_module(model, spec, call=CALL)


def loss_fn(logits, microbatch):
    """Next-token cross-entropy, mean over scored tokens: Hugging Face's causal LM loss, in any dtype."""
    labels = microbatch["labels"]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE)


# -----------------------------------------------------------------------------
# training


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b", help="pipeline schedule")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--digits", type=int, default=6, help="K, the number of digits to copy")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (stages 0 and 1 get half each)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--quiet", action="store_true", help="print nothing but the final summary")
    return parser.parse_args(argv)


def main(argv=None):
    """Train; return the loss of every step."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    model = build_model(args.layers, args.hidden, seed=args.seed)
    stages, params = split(model, args.layers // 2)
    schedule = {"gpipe": GPipe(args.microbatches), "1f1b": OneFOneB(args.microbatches)}[args.schedule]
    step = fpipe.pipeline(loss_fn, stages, schedule)
    if not args.quiet:
        for stage, p in zip(stages, params):
            print(f"{stage!r}: {sum(t.numel() for t in p.values()):,} parameters")
        print(step.program)

    named = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    # A bar on a terminal; in a log file (not a terminal) a plain line every 10 steps instead.
    bar = tqdm(total=args.steps, unit="step", file=sys.stdout, disable=True if args.quiet else None)
    start = time.perf_counter()
    for it in range(args.steps):
        batch = get_batch(args.batch_size, args.digits, generator)
        loss, grads = step(params, batch)
        for stage_grads in fpipe.sum_tied(grads):  # the tied embedding: stage 0's part + stage 2's part
            for name, g in stage_grads.items():
                named[name].grad = g
        optimizer.step()  # in place: params[s][name] alias the model's parameters
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.4f}", refresh=False)
        bar.update()
        if not args.quiet and bar.disable and (it % 10 == 9 or it == args.steps - 1):
            print(f"step {it + 1}/{args.steps}: loss {losses[-1]:.4f}")
    bar.close()
    elapsed = time.perf_counter() - start

    # A validation loss through the forward-only pipeline, then the unsplit model itself: the
    # pipeline trained its parameters.
    val_loss = step.evaluate(params, get_batch(args.batch_size, args.digits, generator))
    batch = get_batch(256, args.digits, generator)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scored = batch["labels"][:, 1:] != IGNORE
    accuracy = (logits[:, :-1].argmax(-1)[scored] == batch["labels"][:, 1:][scored]).float().mean().item()
    print(
        f"{args.steps} steps in {elapsed:.1f}s: loss {losses[0]:.4f} -> {losses[-1]:.4f}, validation "
        f"{val_loss.item():.4f}, copy accuracy {accuracy:.1%} ({args.schedule}, {args.microbatches} microbatches)"
    )
    return losses


if __name__ == "__main__":
    main()
