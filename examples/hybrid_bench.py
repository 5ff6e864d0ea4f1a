"""Benchmarks of examples/transformers_cp.py on one GPU: `python bench.py --hybrid ...` runs this.

    python examples/hybrid_bench.py attention [--lengths 32768,131072] [--world 8]
        The attention of one rank at W ranks (load_balancing "virtual"), forward+backward of one
        layer: transformers_cp's own arithmetic (cp_block_mask, masked_attention) on the queries
        of one rank and the K and V the all-gather would return, against flash attention on the
        same work (SDPA's flash backend per half-shard, against the keys up to its last
        position, causal_lower_right, grouped-query attention native). With and without packed
        documents (8 of random lengths, crossing rank boundaries). The all-gather itself is not
        timed (its bytes are the same for both).

    python examples/hybrid_bench.py step [--layers 10] [--lengths 4096,16384] [--paths ours,transformers]
                                         [--world 8 --global-length 131072]
                                         [--checkpointing none|layer|hf] [--optimizer none|adamw]
        One training step (forward+backward; with --optimizer adamw, AdamW's step too) of a
        GraniteMoeHybridForCausalLM of granite-4.0-h-tiny's size class (GRANITE_4_H_TINY: its
        widths, heads, experts and layer pattern, cut to the first --layers of its 40 layers; random
        init), bf16, batch 1, on one GPU: tokens/s, peak memory, and time per layer kind (Mamba2,
        attention, MoE with its shared MLP, the rest), each kind timed alone, forward+backward, on
        the inputs the model hands it, times its count; each also by its kernels' GPU time
        (torch.profiler, one call), and the step by the GPU's busy time: eager, a short call's wall
        time is its host's. Paths: "ours" (enable_cp in a world of one), "transformers" (the model
        as transformers builds it: mamba_ssm's kernels where importable, else its torch path; SDPA
        attention). Then, where --world > 1, the work of one rank at --world ranks of
        --global-length tokens ("ours_rank_of_W"): each attention layer's keys and values are what
        the all-gather returns (here the rank's own, repeated: the same arithmetic), the Mamba2
        mixers run in a world of one on the rank's tokens (the exchange of one state summary and
        conv halo per layer not run), and the communication is modelled (K and V all-gathered
        forward and reduce-scattered backward at --link-gbps). --checkpointing recomputes each
        decoder layer in the backward as examples/train_cp.py does ("layer": torch.utils.checkpoint
        around each layer's forward; "hf": transformers' switch, not reentrant); --optimizer adamw
        adds AdamW's step and zero_grad to every step (its states are in the parameters' dtype,
        bf16: a trainer with float32 master weights holds 8 bytes more per parameter, over its FSDP2
        shards). The step's time and peak memory include them; the layer kinds are timed without
        them, so "rest" holds the recompute and AdamW.

Prints one `RESULT {json}` line per case and a table last.
"""

import argparse
import functools
import gc
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mamba_cp               # noqa: E402
import transformers_cp        # noqa: E402


def time_ms(fn, iters, warmup):
    """Median of CUDA-event times of fn() over iters calls, after warmup calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gpu_ms(fn):
    """One fn() call under torch.profiler: its kernels' summed time and the GPU's busy time (the
    union of their spans), ms. Eager, a call's wall time can be the host's, not the GPU's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    total = busy = 0.0
    end = float("-inf")
    for s, e in spans:
        total += e - s
        if e > end:
            busy += e - max(s, end)
            end = e
    return total / 1e3, busy / 1e3


def peak_gib(fn):
    """Peak device memory of one fn() call over what was allocated before it, in GiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def packed_documents(L, count, generator, device):
    """Global document ids (1, L) of `count` documents of random lengths."""
    starts = torch.randperm(L - 1, generator=generator)[:count - 1] + 1
    doc = torch.zeros(L, dtype=torch.int32)
    doc[starts] = 1
    return torch.cumsum(doc, 0).to(torch.int32)[None].to(device)


def attention_case(L, world, rank, heads, kv_heads, dim, documents, iters, warmup, device="cuda"):
    g = torch.Generator().manual_seed(L + documents)
    l = L // world
    dtype = torch.bfloat16
    scale = dim ** -0.5
    keys = transformers_cp.key_positions(l, world, "virtual", device)           # (L,) gathered order
    queries = keys[rank * l:(rank + 1) * l]
    # the whole sequence's q, k, v in global order; each side takes what it reads
    q_all = torch.randn(1, heads, L, dim, generator=g).to(device, dtype)
    k_all, v_all = (torch.randn(1, kv_heads, L, dim, generator=g).to(device, dtype) for _ in range(2))
    q = q_all[:, :, queries].clone().requires_grad_()                           # (1, hq, l, d)
    k, v = (t[:, :, keys].clone().requires_grad_() for t in (k_all, v_all))    # gathered order
    dout = torch.randn(1, l, heads, dim, generator=g).to(device, dtype)
    docs = ()
    if documents:
        doc = packed_documents(L, documents, g, device)                        # (1, L) global
        docs = (doc[:, queries], doc[:, keys])

    def ours_out():
        mask = transformers_cp.cp_block_mask(queries, keys, *docs)
        return transformers_cp.masked_attention(q, k, v, mask, scale)               # (1, l, hq, d)

    def ours():
        torch.autograd.grad(ours_out(), (q, k, v), dout)

    # flash: each of the rank's half-shards against the prefix of keys up to its last position
    half = l // 2
    pieces = [(int(queries[0]), int(queries[0]) + half), (int(queries[half]), int(queries[half]) + half)]
    fq = [q_all[:, :, a:b].clone().requires_grad_() for a, b in pieces]
    fk, fv = k_all.clone().requires_grad_(), v_all.clone().requires_grad_()
    fdout = [dout[:, i * half:(i + 1) * half].transpose(1, 2) for i in range(2)]

    def flash_outs():                                                               # [(1, hq, l / 2, d)] * 2
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return [F.scaled_dot_product_attention(qi, fk[:, :, :b], fv[:, :, :b], attn_mask=causal_lower_right(b - a, b),
                                                   scale=scale, enable_gqa=True) for qi, (a, b) in zip(fq, pieces)]

    def flash():
        torch.autograd.grad(flash_outs(), (*fq, fk, fv), fdout)

    # the same function: ours against flash on the same work (no documents)
    check = None
    if not documents:
        with torch.no_grad():
            out, ref = ours_out().float(), torch.cat([o.transpose(1, 2) for o in flash_outs()], 1).float()
        check = float((out - ref).norm() / ref.norm())
    r = dict(bench="cp_attention", L=L, world=world, rank=rank, l=l, heads=heads, kv_heads=kv_heads, dim=dim,
             documents=documents, ours_ms=time_ms(ours, iters, warmup), ours_peak_gib=peak_gib(ours),
             rel_diff_vs_flash=check)
    if not documents:
        r.update(flash_ms=time_ms(flash, iters, warmup), flash_peak_gib=peak_gib(flash))
        r.update(time_ratio=r["ours_ms"] / r["flash_ms"], peak_ratio=r["ours_peak_gib"] / r["flash_peak_gib"])
    return r


def main_attention(args):
    rows = []
    for L in args.lengths:
        plain = attention_case(L, args.world, args.rank, args.heads, args.kv_heads, args.dim, 0, args.iters,
                               args.warmup)
        packed = attention_case(L, args.world, args.rank, args.heads, args.kv_heads, args.dim, 8, args.iters,
                                args.warmup)
        packed["packed_over_plain"] = packed["ours_ms"] / plain["ours_ms"]
        for r in (plain, packed):
            print("RESULT " + json.dumps(r), flush=True)
        rows.append((plain, packed))
    print(f"\nattention of one rank at W = {args.world} (virtual), fwd+bwd, bf16, {args.heads} query heads, "
          f"{args.kv_heads} KV heads, head dim {args.dim}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| global tokens | flex (ours) ms | flash ms | ours / flash | peak ours / flash GiB | ratio | "
          "packed (8 docs) ms | packed / plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for plain, packed in rows:
        print(f"| {plain['L']:,} | {plain['ours_ms']:.2f} | {plain['flash_ms']:.2f} | {plain['time_ratio']:.3f} | "
              f"{plain['ours_peak_gib']:.2f} / {plain['flash_peak_gib']:.2f} | {plain['peak_ratio']:.3f} | "
              f"{packed['ours_ms']:.2f} | {packed['packed_over_plain']:.3f} |")


# granite-4.0-h-tiny as published (40 layers: attention at 5, 15, 25 and 35; the position
# embedding is taken as none ("nope"), which its release notes describe; the published
# config.json could not be read where this was written, so these figures come from two
# descriptions of the checkpoint that agree)
GRANITE_4_H_TINY = dict(
    vocab_size=100352, hidden_size=1536, num_attention_heads=12, num_key_value_heads=4, intermediate_size=512,
    shared_intermediate_size=1024, num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64,
    mamba_n_groups=1, mamba_d_state=128, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256,
    position_embedding_type="nope", tie_word_embeddings=True, rms_norm_eps=1e-5, use_cache=False,
    layer_types=["full_attention" if i in (5, 15, 25, 35) else "linear_attention" for i in range(40)])


def granite_tiny(layers, device, dtype=torch.bfloat16, seed=0):
    """GRANITE_4_H_TINY's first `layers` layers, random init (seeded), in training mode."""
    import transformers
    options = dict(GRANITE_4_H_TINY, layer_types=GRANITE_4_H_TINY["layer_types"][:layers], num_hidden_layers=layers)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**options))
    return model.to(dtype).train()


def layer_kinds(model):
    """{kind: (modules of that kind, the callable timed for one)}: the MoE kind is a layer's
    experts and shared MLP, which read the same input."""
    layers = model.model.layers
    moe = lambda layer: lambda x: layer.block_sparse_moe(x) + layer.shared_mlp(x)    # noqa: E731
    return {"mamba2": [(l.mamba, l.mamba) for l in layers if l.mamba is not None],
            "attention": [(l.self_attn, l.self_attn) for l in layers if l.self_attn is not None],
            "moe": [(l.block_sparse_moe, moe(l)) for l in layers]}


def captured_inputs(model, ids, kinds):
    """What the model hands the first module of each kind in one forward: (args, kwargs)."""
    seen, hooks = {}, []
    for kind, found in kinds.items():
        def keep(module, args, kwargs, kind=kind):
            seen.setdefault(kind, (args, kwargs))
        hooks.append(found[0][0].register_forward_pre_hook(keep, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


def kind_step(call, args, kwargs):
    """forward+backward of one module on its captured input, as the model runs it."""
    leaf = lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa
    args = tuple(leaf(a) for a in args)
    kwargs = {k: leaf(v) for k, v in kwargs.items()}

    def run():
        out = call(*args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return run


def prepare_training(model, checkpointing, optimizer):
    """What a trainer adds (examples/train_cp.py): activation checkpointing of every decoder
    layer ("layer": torch.utils.checkpoint around its forward; "hf": transformers' switch), and
    AdamW (returned; None for "none")."""
    if checkpointing == "layer":
        for layer in model.model.layers:
            layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    elif checkpointing == "hf":
        if hasattr(model, "activation_checkpointing_enable"):   # the switch's newer name (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return torch.optim.AdamW(model.parameters(), lr=1e-5) if optimizer == "adamw" else None


def step_case(model, ids, iters, warmup, label, optim=None, **extra):
    """One step's time, tokens/s, peak memory, and each kind's time; an out-of-memory is reported.
    With an optimizer, the step ends with its step and zero_grad."""
    r = dict(bench="hybrid_step", path=label, tokens=ids.shape[1], layers=len(model.model.layers), **extra)
    try:
        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            if optim is not None:
                optim.step()
                optim.zero_grad(set_to_none=True)
        r["step_ms"] = time_ms(step, iters, warmup)
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        r["tokens_per_s"] = ids.shape[1] / r["step_ms"] * 1e3
        r["step_gpu_ms"], r["step_busy_ms"] = gpu_ms(step)
        model.zero_grad(set_to_none=True)
        kinds = layer_kinds(model)
        inputs = captured_inputs(model, ids, kinds)
        layers_ms = layers_gpu_ms = 0.0
        for kind, found in kinds.items():
            if not found:
                continue
            run = kind_step(found[0][1], *inputs[kind])
            one = time_ms(run, iters, warmup)
            r[f"{kind}_ms"], r[f"{kind}_count"] = one * len(found), len(found)
            r[f"{kind}_gpu_ms"] = gpu_ms(run)[0] * len(found)
            layers_ms += one * len(found)
            layers_gpu_ms += r[f"{kind}_gpu_ms"]
        r["rest_ms"] = r["step_ms"] - layers_ms
        r["rest_gpu_ms"] = r["step_gpu_ms"] - layers_gpu_ms
    except torch.OutOfMemoryError as e:
        r["error"] = "out of memory: " + str(e).split("\n")[0][:160]
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    return r


class _RepeatedKV(torch.autograd.Function):
    """Stands in for transformers_cp._GatherTokens (the all-gather of one rank's K or V) at W
    ranks, called as it is with W in the group's place: W copies of its own (b, h, l, d), the
    shape and bytes the gather returns; backward sums them back."""

    @staticmethod
    def forward(ctx, t, world):
        ctx.world = world
        return t.repeat(1, 1, world, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad.unflatten(2, (ctx.world, -1)).sum(2), None


def main_step(args):
    import transformers
    import transformers_cp as cp
    device = args.device
    rows = []
    training = dict(checkpointing=args.checkpointing, optimizer=args.optimizer)
    for L in args.lengths:
        ids = torch.randint(0, GRANITE_4_H_TINY["vocab_size"], (1, L), generator=torch.Generator().manual_seed(L))
        ids = ids.to(device)
        for path in args.paths:
            model = granite_tiny(args.layers, device)
            if path == "ours":
                cp.enable_cp(model, None)
            optimizer = prepare_training(model, args.checkpointing, args.optimizer)
            r = step_case(model, ids, args.iters, args.warmup, path, optimizer, transformers=transformers.__version__,
                          mamba_ssm=importlib.util.find_spec("mamba_ssm") is not None,
                          experts=getattr(model.config, "_experts_implementation", None), **training)
            print("RESULT " + json.dumps(r), flush=True)
            rows.append(r)
            del model, optimizer
            gc.collect()
            torch.cuda.empty_cache()
    if args.world > 1:
        l = args.global_length // args.world
        model = cp.enable_cp(granite_tiny(args.layers, device), None, "virtual")
        shared = next(m.mamba_cp for m in model.modules() if hasattr(m, "mamba_cp"))
        # this rank's mask at W ranks; the gather's stand-in takes W where the group would be
        shared.world, shared.rank, shared.cp_group = args.world, args.rank, args.world
        cp._GatherTokens = _RepeatedKV
        ids = torch.randint(0, GRANITE_4_H_TINY["vocab_size"], (1, l), generator=torch.Generator().manual_seed(l))
        ids = ids.to(device)
        cfg = model.config
        kv_bytes = 2 * (args.world - 1) * l * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
        comm_ms = 2 * kv_bytes / (args.link_gbps * 1e9) * 1e3 * len(layer_kinds(model)["attention"])
        optimizer = prepare_training(model, args.checkpointing, args.optimizer)
        r = step_case(model, ids, args.iters, args.warmup, f"ours_rank_of_{args.world}", optimizer,
                      global_tokens=args.global_length, rank=args.rank, modelled_comm_ms=comm_ms,
                      link_gbps=args.link_gbps, **training)
        if "step_ms" in r:
            r["tokens_per_s_per_gpu_with_comm"] = l / (r["step_ms"] + comm_ms) * 1e3
        print("RESULT " + json.dumps(r), flush=True)
        rows.append(r)
    step = "fwd+bwd" + ("+AdamW" if args.optimizer == "adamw" else "")
    print(f"\nGraniteMoeHybrid of granite-4.0-h-tiny's size class, first {args.layers} of 40 layers, bf16, batch 1, "
          f"one step ({step}; activation checkpointing: {args.checkpointing}); {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("(each cell: eager wall time, then in brackets the GPU's: kernel time; for the step, the GPU's busy time "
          "and its kernel time. A kind timed alone, eager, waits on its own host work, which the step overlaps "
          "with other layers' kernels: where the GPU is busy for most of the step, the kinds' GPU times are what "
          "moves it. rest: the step less the kinds. A rank of W: its tokens, modelled K/V communication added "
          "to tokens/s)")
    print("| path | tokens | step ms (GPU busy, kernels) | comm ms (modelled) | tokens/s | peak GiB | Mamba2 ms | "
          "attention ms | MoE ms | rest ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['path']} | {r['tokens']:,} | {r['error']} | | | | | | | |")
            continue
        comm = r.get("modelled_comm_ms")
        rate = r.get("tokens_per_s_per_gpu_with_comm", r["tokens_per_s"])
        print(f"| {r['path']} | {r['tokens']:,} | {r['step_ms']:.1f} ({r['step_busy_ms']:.1f}, {r['step_gpu_ms']:.1f}) "
              f"| {'' if comm is None else f'{comm:.1f}'} | {rate:,.0f} | {r['peak_gib']:.1f} | "
              + " | ".join(f"{r.get(k + '_ms', 0):.1f} ({r.get(k + '_gpu_ms', 0):.1f})"
                           for k in ("mamba2", "attention", "moe", "rest")) + " |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    att = sub.add_parser("attention", help="one rank's attention at W ranks against flash")
    att.add_argument("--lengths", default="32768,131072", type=lambda s: [int(x) for x in s.split(",")])
    att.add_argument("--world", type=int, default=8)
    att.add_argument("--rank", type=int, default=0)
    att.add_argument("--heads", type=int, default=32)
    att.add_argument("--kv-heads", dest="kv_heads", type=int, default=8)
    att.add_argument("--dim", type=int, default=128)
    att.add_argument("--iters", type=int, default=10)
    att.add_argument("--warmup", type=int, default=3)
    st = sub.add_parser("step", help="one training step of a granite-4.0-h-tiny-sized hybrid")
    st.add_argument("--layers", type=int, default=10)
    st.add_argument("--lengths", default="4096,16384", type=lambda s: [int(x) for x in s.split(",")])
    st.add_argument("--world", type=int, default=8)
    st.add_argument("--rank", type=int, default=0)
    st.add_argument("--global-length", dest="global_length", type=int, default=131072)
    st.add_argument("--link-gbps", dest="link_gbps", type=float, default=300.0,
                    help="modelled all-gather / reduce-scatter bandwidth per GPU, GB/s")
    st.add_argument("--paths", default="ours,transformers", type=lambda s: s.split(","),
                    help="of ours, transformers: the paths timed at each of --lengths")
    st.add_argument("--checkpointing", default="none", choices=("none", "layer", "hf"),
                    help="activation checkpointing of every decoder layer: torch.utils.checkpoint around its "
                         "forward (layer, as examples/train_cp.py), or transformers' switch (hf), not reentrant")
    st.add_argument("--optimizer", default="none", choices=("none", "adamw"),
                    help="adamw: AdamW's step and zero_grad end every timed step (states in bf16)")
    st.add_argument("--device", default="cuda")
    st.add_argument("--iters", type=int, default=5)
    st.add_argument("--warmup", type=int, default=2)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("hybrid_bench.py times GPU kernels: it needs CUDA")
    {"attention": main_attention, "step": main_step}[args.what](args)


if __name__ == "__main__":
    main()
