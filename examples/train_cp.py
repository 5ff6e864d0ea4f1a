"""Train a transformers Mamba2 hybrid on packed documents under FSDP2 x context parallelism.

    torchrun --nproc_per_node=8 examples/train_cp.py --config granite-4.0-h-tiny --cp 8 --seq-len 65536 \\
        --batch 1 --steps 100 --checkpoint-dir ckpt --save-every 50             # GPUs: NCCL, bf16 compute
    torchrun --nproc_per_node=2 examples/train_cp.py --config tiny --cp 2 --steps 3 --parity   # CPUs: gloo

The W ranks form a (dp, cp) mesh, dp = W / cp. Each dp rank takes its rows of every step's
global batch (--batch rows of --seq-len tokens, in --accum micro-batches); its cp group holds
each row sharded (transformers_cp.enable_cp, shard_batch); FSDP2 shards the decoder layers and
the model over all W ranks (the recipe in transformers_cp's docstring). Per step, rank 0 prints
the global mean loss, tokens/s per rank and peak memory. --checkpoint-dir with --save-every
saves model, optimizer, step and data position with torch.distributed.checkpoint; --resume
continues from the latest (or a given) save. --parity trains the same steps twice on the same
data, at cp = --cp and then at cp 1 (dp = W), and prints the two runs' losses side by side.

Models: --config tiny (tests) or granite-4.0-h-tiny (its widths written out; --layers N keeps
the first N of its 40 layers), random init from --seed; or a local directory, loaded with
from_pretrained (a config.json alone: random init). Data (--data): "synthetic" (seeded
documents of random lengths), token files (.npy or .pt, 1-D token ids, documents ended by
--eos) or text files (.txt, documents separated by blank lines; --tokenizer DIR). Device: cuda
with NCCL where there is one, else cpu with gloo (mamba_cp's kernels then run in the Triton
interpreter, which computes bf16 wrongly: fp32 there).
"""

import argparse
import functools
import glob
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # mamba_cp.py
from transformers_cp import enable_cp, shard_batch   # noqa: E402  (before transformers' models import triton)
import transformers                                  # noqa: E402

# granite-4.0-h-tiny's widths (as examples/hybrid_bench.py has them): 40 layers, attention at 5,
# 15, 25 and 35, no position embedding, 64 experts (6 per token) beside a shared MLP
SIZES = {
    "granite-4.0-h-tiny": dict(
        vocab_size=100352, hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
        shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256,
        position_embedding_type="nope", tie_word_embeddings=True, rms_norm_eps=1e-5,
        layer_types=["full_attention" if i in (5, 15, 25, 35) else "linear_attention" for i in range(40)]),
    "tiny": dict(   # the tests' size: a Mamba2 layer (2 heads of 32), a rotary attention layer, 4 experts
        vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=2, mamba_d_head=32,
        mamba_n_groups=1, mamba_d_state=8, mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
        tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"]),
}


def build_model(args, device):
    """A CausalLM in float32 (FSDP2 keeps these as the master weights), the same on every rank."""
    torch.manual_seed(args.seed)
    if os.path.isdir(args.config):
        if glob.glob(os.path.join(args.config, "*.safetensors")) or glob.glob(os.path.join(args.config, "*.bin")):
            model = transformers.AutoModelForCausalLM.from_pretrained(args.config, dtype=torch.float32).to(device)
        else:                                                      # a config.json alone: random init
            with torch.device(device):
                model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(
                    args.config), dtype=torch.float32)
    else:
        options = dict(SIZES[args.config])
        if args.layers:
            options["layer_types"] = options["layer_types"][:args.layers]
        options.update(num_hidden_layers=len(options["layer_types"]), use_cache=False)
        with torch.device(device):
            model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**options))
    if not hasattr(model, "model"):      # Mamba2ForCausalLM: its mixers see no seq_idx before transformers 5.25
        sys.exit(f"{type(model).__name__}: train_cp.py packs documents, which need a hybrid (examples/README.md)")
    return model


class Corpus:
    """Documents as one token stream that repeats: take(start, n) gives tokens start .. start + n
    and where documents begin. Synthetic: blocks of BLOCK tokens, each drawn from its own seed,
    documents of random lengths in [doc_min, doc_max] (a block's first token starts one)."""
    BLOCK = 1 << 16

    def __init__(self, args, vocab_size):
        self.args, self.vocab, self.blocks = args, vocab_size, {}
        if args.data == "synthetic":
            return
        docs = []
        for path in args.data.split(","):
            if path.endswith(".txt"):
                tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
                eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
                text = open(path, encoding="utf-8").read()
                docs += [torch.tensor(tok(d)["input_ids"] + eos) for d in text.split("\n\n") if d.strip()]
            else:
                import numpy
                ids = torch.load(path) if path.endswith(".pt") else torch.from_numpy(numpy.load(path))
                docs.append(ids.flatten().long())
        self.tokens = torch.cat(docs)
        self.starts = torch.zeros_like(self.tokens, dtype=torch.bool)
        self.starts[torch.cumsum(torch.tensor([0] + [len(d) for d in docs[:-1]]), 0)] = True   # each file, text doc
        if args.eos is not None:                                   # token files: after each --eos
            self.starts[1:] |= self.tokens[:-1] == args.eos

    def _block(self, k):
        if k not in self.blocks:
            g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + k)
            tokens = torch.randint(0, self.vocab, (self.BLOCK,), generator=g)
            lengths = torch.randint(self.args.doc_min, self.args.doc_max + 1, (self.BLOCK // self.args.doc_min,),
                                    generator=g)
            ends = torch.cumsum(lengths, 0)
            starts = torch.zeros(self.BLOCK, dtype=torch.bool)
            starts[ends[ends < self.BLOCK]] = True
            starts[0] = True
            self.blocks = {k: (tokens, starts)}                    # steps read forward: keep one
        return self.blocks[k]

    def take(self, start, n):
        if self.args.data == "synthetic":
            parts = [self._block(k) for k in range(start // self.BLOCK, (start + n - 1) // self.BLOCK + 1)]
            off = start % self.BLOCK
            return tuple(torch.cat([p[i] for p in parts])[off:off + n] for i in (0, 1))
        idx = torch.arange(start, start + n) % len(self.tokens)
        return self.tokens[idx], self.starts[idx]


def step_rows(corpus, position, args):
    """The global batch of the step that starts at token `position`: ids and position_ids
    (batch, seq_len), positions restarting at every document start and at every row's start."""
    ids, starts = corpus.take(position, args.batch * args.seq_len)
    ids, starts = ids.view(args.batch, args.seq_len), starts.view(args.batch, args.seq_len).clone()
    starts[:, 0] = True
    idx = torch.arange(args.seq_len).expand_as(ids)
    return ids, idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values


def train(args, cp, device, save=True):
    """One run of args.steps steps at this cp; returns the losses. Prints each step on rank 0."""
    world = dist.get_world_size()
    dp = world // cp
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    model = build_model(args, device)
    name = type(model).__name__
    model = enable_cp(model, mesh.get_group("cp"), args.layout)
    if args.checkpointing == "hf":                                # transformers' switch
        if hasattr(model, "activation_checkpointing_enable"):   # the switch's newer name (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif args.checkpointing == "layer":                           # torch.utils.checkpoint per decoder layer
        for layer in model.model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.dtype == "bf16" else None,
                                  reduce_dtype=torch.float32)
    everyone = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=everyone, mp_policy=policy)
    fully_shard(model, mesh=everyone, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    corpus = Corpus(args, model.config.vocab_size)
    step, position = 0, 0
    if args.resume and save:
        path = (max(glob.glob(os.path.join(args.checkpoint_dir or ".", "step-*")), default=None)
                if args.resume == "latest" else args.resume)
        if path is None or not os.path.isdir(path):
            sys.exit(f"--resume: no save at {path or os.path.join(args.checkpoint_dir or '.', 'step-*')}")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": 0, "data": 0}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step, position = state["step"], state["data"]
        say(f"resumed from {path}: step {step}, data position {position}")
    per_micro = args.batch // (dp * args.accum)               # rows of one micro-batch on one dp rank
    dp_rank, cp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    say(f"{name} ({args.config}): {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {world} "
        f"ranks = dp {dp} x cp {cp} ({args.layout}), {device.type}; per step {args.batch} x {args.seq_len} tokens "
        f"in {args.accum} micro-batch(es); checkpointing {args.checkpointing}; {args.dtype}")
    losses = []
    while step < args.steps:
        started = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ids, positions = step_rows(corpus, position, args)
        items = shard_batch(ids, ids, 0, 1, args.layout, position_ids=positions)["num_items"]   # the whole step's
        total = torch.zeros((), device=device)
        for m in range(args.accum):
            rows = slice((dp_rank * args.accum + m) * per_micro, (dp_rank * args.accum + m + 1) * per_micro)
            batch = shard_batch(ids[rows].to(device), ids[rows].to(device), cp_rank, cp, args.layout,
                                position_ids=positions[rows].to(device))
            model.set_requires_gradient_sync(m == args.accum - 1)      # reduce-scatter on the last only
            loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], seq_idx=batch["seq_idx"],
                         labels=batch["shift_labels"], shift_labels=batch["shift_labels"], num_items_in_batch=items,
                         use_cache=False).loss
            (loss * world).backward()                                  # FSDP2 averages over the W ranks
            total += loss.detach().float()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)                                         # the shares of every rank: the mean
        step, position = step + 1, position + args.batch * args.seq_len
        losses.append(total.item())
        seconds = time.perf_counter() - started
        peak = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device.type == "cuda" else
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS")
        say(f"step {step}/{args.steps} | loss {losses[-1]:.9g} | "
            f"{args.batch * args.seq_len / world / seconds:,.0f} tokens/s per rank | peak {peak} | {seconds:.2f} s")
        if save and args.checkpoint_dir and args.save_every and step % args.save_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            path = os.path.join(args.checkpoint_dir, f"step-{step:06d}")
            dcp.save({"model": model_state, "optim": optim_state, "step": step, "data": position}, checkpoint_id=path)
            say(f"saved {path}")
    return losses


def say(line):
    if dist.get_rank() == 0:
        print(line, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help=f"one of {', '.join(SIZES)}, or a local model directory")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers of a named size")
    ap.add_argument("--cp", type=int, default=None, help="ranks per CP group (default: all)")
    ap.add_argument("--layout", default="virtual", choices=("virtual", "none"))
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="rows per optimizer step, over all dp ranks")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--checkpointing", default="layer", choices=("layer", "hf", "none"),
                    help="activation checkpointing: torch.utils.checkpoint per decoder layer, transformers' switch")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="compute dtype (default: bf16 on GPUs)")
    ap.add_argument("--data", default="synthetic", help="synthetic, or comma-separated .npy/.pt/.txt files")
    ap.add_argument("--eos", type=int, default=None, help="token files: the token that ends a document")
    ap.add_argument("--tokenizer", default=None, help="text files: a local tokenizer directory")
    ap.add_argument("--doc-min", type=int, default=8, help="synthetic documents' shortest length")
    ap.add_argument("--doc-max", type=int, default=48, help="synthetic documents' longest length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", nargs="?", const="latest", default=None, help="the latest save, or this one")
    ap.add_argument("--parity", action="store_true", help="train twice, at --cp and at cp 1; print both losses")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    args.cp = args.cp or world
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if not cuda and args.dtype == "bf16":
        sys.exit("bf16 on CPUs: the Triton interpreter computes bf16 arithmetic wrongly; use --dtype fp32")
    if world % args.cp or args.batch % (world // args.cp * args.accum):
        sys.exit(f"--cp {args.cp} must divide the {world} ranks, and --batch {args.batch} into dp x --accum")
    if args.parity and (args.resume or args.batch % (world * args.accum)):
        sys.exit("--parity: no --resume, and --batch must divide into W x --accum (the cp 1 run has dp = W)")
    losses = train(args, args.cp, device)
    if args.parity:
        single = train(args, 1, device, save=False)
        say(f"parity: step | cp {args.cp} loss | cp 1 loss | relative difference")
        for i, (a, b) in enumerate(zip(losses, single)):
            say(f"parity: {i + 1} | {a:.9g} | {b:.9g} | {abs(a - b) / abs(b):.2e}")
        say(f"parity: largest relative difference {max(abs(a - b) / abs(b) for a, b in zip(losses, single)):.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
