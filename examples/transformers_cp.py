"""Context parallelism for Hugging Face transformers Mamba2 models and hybrids, through mamba_cp.

Copy this file next to mamba_cp.py in a trainer. examples/README.md is the guide: the models and
transformers releases, what each layer does on a shard, packed documents, what is refused, the
tests and the benchmark. A training step, every rank holding its share of the same sequences
(load_balancing: "virtual", zigzag shards, two half-shards per rank, the layout ring attention
balances; "none", contiguous; the batch must be sharded in the same one):

    model = enable_cp(model, cp_group, load_balancing="virtual")         # once, after loading
    batch = shard_batch(input_ids, labels, rank, world, "virtual",       # per step, every rank
                        position_ids=position_ids)                       # packed documents: optional
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], seq_idx=batch["seq_idx"],
                labels=batch["shift_labels"], shift_labels=batch["shift_labels"],
                num_items_in_batch=batch["num_items"])
    out.loss.backward()
    all_reduce_grads(model, cp_group)                                    # without FSDP (below)

Mamba2 mixers run mamba_cp's mamba_split_conv1d_scan_combined (Falcon-H1's muP multipliers
folded into the projection before it, its gated norm before the gate as its config says, or
none); attention layers (registered through transformers' attention interface) all-gather K and
V and run one fused flex_attention call under a block mask made once per forward from global
positions and document ids; MLP and MoE layers, and everything else token by token (Zamba2's
shared blocks and their adapters), need nothing. Supported: Mamba2ForCausalLM,
BambaForCausalLM, GraniteMoeHybridForCausalLM, NemotronHForCausalLM, FalconH1ForCausalLM and
Zamba2ForCausalLM, found by the layer kinds their configs declare ("linear_attention" for
Mamba2, "full_attention", "hybrid" for a layer holding both, "mlp", "moe"); another kind raises
ValueError naming it, and so does sliding-window attention. enable_mamba_cp patches the mixers
alone. transformers 5.17 to 5.25: the mixers' cache keyword (cache_params to 5.23, cache from
5.24) is mapped, and 5.17 to 5.22's gated RMSNorm, which normalises all channels at once, runs
in torch after the gate when a mixer has more than one B/C group.

No mixer is patched on trust: before patching, each distinct mixer configuration (class,
forward, attributes, shapes) is run once per process both ways, its own forward on
transformers' torch path and this file's in a world of one, on random float32 hidden states of
2 * chunk_size + d_conv tokens, and a relative RMS difference above CHECK_BOUND (1e-4) raises
ValueError naming the class and the difference, with nothing patched. So call enable_cp once
the weights are loaded and before fully_shard: where the parameters are on the meta device or
sharded the check cannot run, and only a mixer of a class the file knows (KNOWN_MIXERS) passes.

A world of one (cp_group None, or a group of one rank) runs the same path on the whole sequence
with no collective. To keep transformers' own path, do not call enable_cp.

The loss: each rank's loss is the sum of its tokens' cross-entropy divided by the global count of
predicted tokens (num_items_in_batch), so the ranks' losses add up to the unsharded model's mean.
Packed documents: pass seq_idx from shard_batch; without it nothing is separated.
Mamba2ForCausalLM hands its mixers no keywords before transformers 5.25: there a seq_idx given to
it is dropped with no error (its backbone, Mamba2Model, does hand it on).

FSDP2 with CP: the decoder layers and the model are sharded over all dp x cp ranks, CP runs over
the cp sub-mesh's group, and FSDP's reduce-scatter, which averages over those dp x cp ranks, also
sums the CP shares of each gradient once the loss is scaled back up:

    mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))
    model = enable_cp(model, mesh.get_group("cp"), "virtual")
    shards = init_device_mesh(device, (dp * cp,))                       # every rank
    for layer in model.model.layers:
        fully_shard(layer, mesh=shards)
    fully_shard(model, mesh=shards)
    ...   # each dp rank shards its own batch over cp; num_items counts every dp rank's batch
    loss = model(...).loss * (dp * cp)      # FSDP divides the summed gradients by dp * cp
    loss.backward(); optimizer.step()       # no all_reduce_grads

Refused (ValueError): a padding mask, attention dropout in training, sliding-window attention,
keywords that describe documents some other way (cu_seq_lens_q, ...), a mixer that fails the
check or whose conv activation is not silu, and a cache in evaluation in a model with attention
(by the model's forward, before any layer runs). In a training forward a cache is harmless: the
mixers leave their entries empty, the attention layers store only this rank's K and V. In
evaluation with a cache the mixers run transformers' own forward on whatever they are given, so
evaluate shards with use_cache=False (a Mamba2ForCausalLM, which has no attention layer to
refuse it, would run each shard alone), and generate with a model that has not been through
enable_cp.
"""

import contextlib
import inspect
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

import mamba_cp

MIXER_PARTS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION = "mamba_cp_flex"               # the name this file registers with transformers
MAMBA_KIND, ATTENTION_KIND, TOKENWISE_KINDS = "linear_attention", "full_attention", ("mlp", "moe")
HYBRID_KIND = "hybrid"   # a Mamba2 mixer and an attention in one layer: Falcon-H1's side by side, Zamba2's in turn
# keywords that reach the mixers and attention layers from the CausalLM forward and say nothing
# about which tokens may see which: the loss's, the router's, the cache switch, and the positions
# (the rotary embeddings have taken them before attention runs; Zamba2's layers hand their
# mixers the embeddings themselves, which the mixers ignore)
INERT_KEYWORDS = {"num_items_in_batch", "shift_labels", "output_router_logits", "use_cache", "output_attentions",
                  "output_hidden_states", "position_ids", "position_embeddings"}
CACHE_KEYWORDS = ("cache", "cache_params")   # the mixers' cache: 5.24 on, and 5.17 to 5.23


def _check_layout(load_balancing):
    if load_balancing not in mamba_cp.LAYOUTS:
        raise ValueError(f"load_balancing must be one of {mamba_cp.LAYOUTS}, not {load_balancing!r}")


def _group_or_none(cp_group):
    """The CP group, or None for a world of one (no group, or a group of one rank)."""
    return None if cp_group is None or dist.get_world_size(cp_group) == 1 else cp_group


def _refuse_unknown(keywords, where):
    unknown = sorted(set(keywords) - INERT_KEYWORDS)
    if unknown:
        raise ValueError(f"{where}: cannot honour {unknown} under context parallelism (documents reach it as "
                         f"seq_idx, from shard_batch)")


# ---------------------------------------------------------------------------------------------
# Mamba2 mixers
# ---------------------------------------------------------------------------------------------

def _mamba2_mixers(model):
    return [m for m in model.modules() if all(hasattr(m, part) for part in MIXER_PARTS)]


def _norm_before_gate(mixer):
    """Falcon-H1's gated norm normalises y and then gates it when its config says so
    (mamba_norm_before_gate, on by default); transformers' other gated norms gate first."""
    return bool(getattr(mixer.norm, "norm_before_gate", False))


def _mixer_sizes(mixer):
    """(headdim, ngroups, norm_width) of a transformers Mamba2 mixer; norm_width is how many
    channels its gated RMSNorm normalises together: the norm's group_size where it has one
    (transformers 5.23 on; Zamba2's and NemotronH's in every release: dim / n_groups, one B/C
    group, as mamba_ssm's kernel does), dim / the norm's n_groups (Falcon-H1's), all dim
    channels where it has neither (5.17 to 5.22); None where the mixer has no norm (Falcon-H1
    with mamba_rms_norm off: y * silu(z) alone). Raises ValueError for what mamba_cp cannot run."""
    name, dim, nheads = type(mixer).__name__, mixer.out_proj.in_features, mixer.dt_bias.shape[0]
    ngroups = getattr(mixer, "n_groups", None)
    if ngroups is None:
        raise ValueError(f"enable_mamba_cp: {name} has no n_groups (the number of B/C groups)")
    activation = getattr(mixer, "activation", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"enable_mamba_cp: {name} applies {activation!r} after its conv (Falcon-H1: the config's "
                         f"hidden_act); mamba_cp's conv applies silu")
    if isinstance(mixer.norm, torch.nn.Identity):
        return dim // nheads, ngroups, None
    norm_width = getattr(mixer.norm, "group_size", None) or dim // getattr(mixer.norm, "n_groups", 1)
    if dim % norm_width:
        raise ValueError(f"enable_mamba_cp: {name}'s gated RMSNorm has groups of {norm_width}, "
                         f"which do not divide its {dim} channels")
    if _norm_before_gate(mixer) and norm_width * ngroups != dim:
        raise ValueError(f"enable_mamba_cp: {name}'s gated RMSNorm normalises before its gate in groups of "
                         f"{norm_width} channels; mamba_cp does that only per B/C group ({dim // ngroups})")
    return dim // nheads, ngroups, norm_width


def _gated_rms_norm(gated, norm, width):
    """transformers' gated RMSNorm after its gate, gated = y * silu(z) (b, l, dim): each group of
    `width` channels over its own RMS, in float32, then the weight."""
    g = gated.float().unflatten(-1, (-1, width))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * g.flatten(-2).to(gated.dtype)


def _projected(mixer, hidden_states):
    """in_proj of the hidden states, with Falcon-H1's muP multipliers where the mixer has them:
    ssm_in_multiplier on its input, mup_vector (one factor per block of z, x, B, C and dt,
    from the config's ssm_multipliers) on the projection, both folded in before mamba_cp."""
    scale = getattr(mixer, "ssm_in_multiplier", None)
    zxbcdt = mixer.in_proj(hidden_states if scale is None else hidden_states * scale)     # (b, l_local, width)
    mup = getattr(mixer, "mup_vector", None)
    return zxbcdt if mup is None else zxbcdt * mup


def _own_forward(mixer):
    """The mixer's forward before this file patched it (enable_cp may run twice on a model)."""
    return getattr(mixer.forward, "mamba_cp_original", mixer.forward)


def _cp_forward(mixer, cp_group, load_balancing):
    """The mixer's forward on this rank's shard: in_proj (_projected), then conv, SSD, gated
    RMSNorm (or the gate alone) and out projection in one mamba_cp call, from the mixer's own
    parameters. Where the norm's groups
    are not mamba_cp's (dim / n_groups: transformers 5.17 to 5.22 with n_groups > 1) the call
    stops at the gate and the norm and out projection run in torch, as the mixer defines them
    (transformers' own mamba_ssm route normalises per B/C group there, unlike its torch path)."""
    original = _own_forward(mixer)
    cache_name = next((n for n in CACHE_KEYWORDS if n in inspect.signature(original).parameters), "cache")
    headdim, ngroups, norm_width = _mixer_sizes(mixer)      # checked here, when enable_mamba_cp patches
    fused_norm = norm_width is None or norm_width * ngroups == mixer.out_proj.in_features
    before = _norm_before_gate(mixer)

    def forward(hidden_states, attention_mask=None, seq_idx=None, **kwargs):
        caches = [kwargs.pop(n) for n in CACHE_KEYWORDS if n in kwargs]
        cache = next((c for c in caches if c is not None), None)
        # transformers makes a cache whenever use_cache is on, training too: a training forward
        # runs on the shard and leaves it empty; in evaluation a cache means generation, which
        # runs transformers' own path on whatever it is given
        if cache is not None and not mixer.training:
            if seq_idx is not None:
                kwargs["seq_idx"] = seq_idx
            return original(hidden_states, attention_mask=attention_mask, **{cache_name: cache}, **kwargs)
        if attention_mask is not None:   # transformers passes None for an all-ones mask
            raise ValueError("enable_mamba_cp: a padding mask (attention_mask with zeros) is not supported under "
                             "context parallelism; pack the documents into full sequences instead")
        _refuse_unknown(kwargs, f"enable_mamba_cp: {type(mixer).__name__}")
        norm = {} if norm_width is None or not fused_norm else dict(rmsnorm_weight=mixer.norm.weight,
                                                                     rmsnorm_eps=mixer.norm.variance_epsilon)
        out_proj = dict(outproj_weight=mixer.out_proj.weight, outproj_bias=mixer.out_proj.bias) if fused_norm else {}
        out = mamba_cp.mamba_split_conv1d_scan_combined(
            _projected(mixer, hidden_states), mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
            -torch.exp(mixer.A_log.float()), mixer.D, mixer.chunk_size, seq_idx=seq_idx,
            dt_limit=tuple(mixer.time_step_limit), activation=mixer.activation, headdim=headdim, ngroups=ngroups,
            norm_before_gate=before, cp_group=cp_group, load_balancing=load_balancing, **norm, **out_proj)
        return out if fused_norm else mixer.out_proj(_gated_rms_norm(out, mixer.norm, norm_width))

    forward.mamba_cp_original = original
    return forward


# ---------------------------------------------------------------------------------------------
# The mixer self-check: no mixer is replaced by something that computes otherwise
# ---------------------------------------------------------------------------------------------

CHECK_BOUND = 1e-4   # relative RMS, float32: the arithmetic agrees to about 1e-7
# the mixers this file is written for, trusted unchecked only where their parameters cannot be
# read when it runs (on the meta device, or sharded by FSDP); any other mixer is checked or refused
KNOWN_MIXERS = ("Mamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer",
                "Zamba2MambaMixer")
_CHECKED = set()     # the mixer configurations (_mixer_key) that passed, once per process


def _mixer_key(mixer, original):
    """What decides what a mixer computes, besides its parameters' values: its forward and, for
    it and every submodule, the class, a forward set on the instance, the plain attributes and
    the shapes of its parameters and buffers. Left out: where the mixer sits (layer_idx,
    layer_type), so that the layers of one model share one check."""
    parts = [getattr(original, "__func__", original)]
    for name, m in mixer.named_modules():
        plain = sorted((k, repr(v)) for k, v in vars(m).items() if k not in ("training", "layer_idx", "layer_type")
                       and isinstance(v, (bool, int, float, str, tuple, list, type(None))))
        shapes = [(n, tuple(t.shape)) for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
        parts.append((name, type(m), None if m is mixer else vars(m).get("forward"), tuple(plain), tuple(shapes)))
    return tuple(parts)


def _known(mixer, original):
    cls = type(mixer)
    return (cls.__name__ in KNOWN_MIXERS and cls.__module__.startswith("transformers.models.")
            and getattr(original, "__func__", None) is cls.forward and cls.forward.__module__ == cls.__module__)


@contextlib.contextmanager
def _swapped(changes):
    """Each (object, attribute, value) set for the while, then every one put back."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _exact_reference(mixer, device):
    """What the check sets so that the mixer's own forward is transformers' torch path in
    float32: where mamba_ssm or a hub kernel is installed transformers runs it instead, and its
    float32 products round in tf32, which the check would read as a difference. The kernel
    functions of the modules of the mixer's transformers classes (a wrapper round each torch
    function, 5.17 on) go back to what they wrap; on a GPU TF32 is off for torch's matmuls and
    cuDNN's convs, set and put back through torch's per-backend fp32_precision (2.9 on), which
    leaves a setting made through the older API (allow_tf32) readable as before."""
    modules = {sys.modules[c.__module__] for c in type(mixer).__mro__ if c.__module__.startswith("transformers.")}
    changes = [(module, name, fn.__wrapped__) for module in modules for name, fn in vars(module).items()
               if name.startswith(("mamba2_", "causal_conv1d")) and getattr(fn, "__wrapped__", None) is not None]
    if device.type == "cuda":
        backends = (torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None))
        changes += [(b, "fp32_precision", "ieee") for b in backends if hasattr(b, "fp32_precision")]
    return changes


def _check_mixer(mixer, original, load_balancing):
    """The mixer's own forward (transformers' torch path: evaluation, no cache, _exact_reference)
    against this file's in a world of one, on random float32 hidden states (1, 2 * chunk_size
    + d_conv, hidden), without gradients: a parameter or buffer in another dtype is read in
    float32 for the check and then put back as it was. ValueError, naming the class and the
    difference, above CHECK_BOUND. Where the parameters cannot be read (meta device, FSDP
    shards) a mixer of KNOWN_MIXERS passes unchecked (returns False) and any other is refused.
    True: checked."""
    name = type(mixer).__name__
    tensors = [t for t in (*mixer.parameters(), *mixer.buffers()) if t.is_floating_point()]
    if any(t.is_meta or hasattr(t, "full_tensor") for t in tensors):
        if _known(mixer, original):
            return False
        raise ValueError(f"enable_mamba_cp: cannot check {name} against its own forward: its parameters are on the "
                         f"meta device or sharded; call enable_cp once the weights are loaded, before fully_shard")
    device = tensors[0].device
    length = 2 * mixer.chunk_size + mixer.conv1d.weight.shape[-1]       # two chunk boundaries, past the conv
    x = torch.randn(1, length, mixer.in_proj.in_features, generator=torch.Generator().manual_seed(0)).to(device)
    mine = _cp_forward(mixer, None, load_balancing)
    changes = [(t, "data", t.data.float()) for t in tensors] + [(m, "training", False) for m in mixer.modules()]
    try:
        with _swapped(changes + _exact_reference(mixer, device)), torch.no_grad(), \
                torch.autocast(device.type, enabled=False):
            want, got = original(x), mine(x)
    except Exception as e:  # noqa: BLE001 - either forward failing on the check's input is a refusal
        raise ValueError(f"enable_mamba_cp: {name} could not be checked against its own forward: {e!r}") from e
    if not isinstance(want, torch.Tensor) or want.shape != got.shape:
        raise ValueError(f"enable_mamba_cp: {name}'s forward returns {type(want).__name__} "
                         f"{tuple(getattr(want, 'shape', ()))}, not hidden states {tuple(got.shape)}")
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    if not err <= CHECK_BOUND:
        raise ValueError(f"enable_mamba_cp: {name}'s own forward and this file's differ: relative RMS difference "
                         f"{err:.1e} (bound {CHECK_BOUND:.0e}) on float32 hidden states of {length} tokens; it "
                         f"computes something this file does not know, so it is not patched")
    return True


def _patched_mixers(model, cp_group, load_balancing):
    """Every Mamba2 mixer of the model with its CP forward, each distinct configuration checked
    (_check_mixer) first: nothing is patched unless all pass."""
    _check_layout(load_balancing)
    mixers = _mamba2_mixers(model)
    if not mixers:
        raise ValueError(f"enable_mamba_cp: no Mamba2 mixer (a module holding {', '.join(MIXER_PARTS)}) "
                         f"in {type(model).__name__}")
    patched = [(m, _cp_forward(m, _group_or_none(cp_group), load_balancing)) for m in mixers]
    for mixer, _ in patched:
        original = _own_forward(mixer)
        key = _mixer_key(mixer, original)
        if key not in _CHECKED and _check_mixer(mixer, original, load_balancing):
            _CHECKED.add(key)
    return patched


def enable_mamba_cp(model, cp_group, load_balancing="virtual"):
    """Patch, in place, every Mamba2 mixer of `model` so that (without a cache) it takes this
    rank's shard of the hidden states, in the layout `load_balancing`, and returns this rank's
    shard of its output, once each distinct mixer has matched its own forward (_check_mixer).
    cp_group None, or a group of one: the whole sequence on mamba_cp's kernels, no collective.
    Returns the model."""
    for mixer, forward in _patched_mixers(model, cp_group, load_balancing):
        mixer.forward = forward
    return model


# ---------------------------------------------------------------------------------------------
# Attention: K and V all-gathered over the CP group, then one fused flex_attention call under a
# block-sparse mask made from global positions and document ids
# ---------------------------------------------------------------------------------------------

# torch 2.13 renamed the single-tensor collectives; 2.11 (on the GPUs we measure) has the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gathered(t, group, dim):
    """Every rank's t, concatenated in rank order along its token axis `dim`."""
    world = dist.get_world_size(group)
    out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t.contiguous(), group=group)                          # (W * b, ...)
    return out.unflatten(0, (world, -1)).movedim(0, dim).flatten(dim, dim + 1)


class _GatherTokens(torch.autograd.Function):
    """(b, h, l, d) on every rank -> (b, h, W * l, d), the ranks' shards one after another. Its
    backward sums the gradient every rank's copy received and returns each rank its own part."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _gathered(t, group, 2)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        b, h, L, d = grad.shape
        per_rank = grad.unflatten(2, (world, L // world)).movedim(2, 0).flatten(0, 1)  # (W * b, h, l, d)
        own = torch.empty((b, h, L // world, d), dtype=grad.dtype, device=grad.device)
        _reduce_scatter_single(own, per_rank.contiguous(), group=ctx.group)
        return own, None


def key_positions(l_local, world, load_balancing, device):
    """Where every rank's l_local tokens sit in the whole sequence, the ranks' shards one after
    another (W * l_local,), in the layout: the global position of each gathered key."""
    positions = torch.arange(l_local * world, device=device)[None]
    return torch.cat([mamba_cp.shard(positions, r, world, load_balancing)[0] for r in range(world)])


BLOCK = 128   # flex_attention's tile, queries by keys: the mask says per tile whether to skip it


def _tile_ranges(t):
    """Smallest and largest value of each run of BLOCK along the last axis of an integer tensor
    (..., n) -> two (..., ceil(n / BLOCK)); the last run may be short."""
    pad = (-t.shape[-1]) % BLOCK
    edge = t[..., -1:].expand(*t.shape[:-1], pad)              # repeats a real value: min/max unchanged
    tiles = torch.cat([t, edge], dim=-1).unflatten(-1, (-1, BLOCK))
    return tiles.amin(-1), tiles.amax(-1)


def _ordered(tiles):
    """(B, 1, Q, K) bool -> flex's layout of it: per query tile the count of its key tiles
    (B, 1, Q) and their indices first, in key order (B, 1, Q, K)."""
    return (tiles.sum(-1, dtype=torch.int32),
            torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32))


def cp_block_mask(query_pos, key_pos, query_doc=None, key_doc=None):
    """The attention mask of one rank as a flex_attention BlockMask: query i sees key j when
    key_pos[j] <= query_pos[i] (global positions, (l,) and (L,)) and, with documents (global
    ids, (b, l) and (b, L), non-decreasing along the sequence), both lie in one document.
    Built per tile of BLOCK x BLOCK from each tile's smallest and largest position and
    document, never per element: a tile is skipped when no pair in it can be visible, run
    without the mask when every pair is, and masked element by element (the function
    `visible`) otherwise. Tensors of (l / BLOCK) x (L / BLOCK) tiles, no l x L one."""
    q_lo, q_hi = _tile_ranges(query_pos)                                  # (Q,)
    k_lo, k_hi = _tile_ranges(key_pos)                                    # (K,)
    some = (k_lo[None, :] <= q_hi[:, None])[None, None]                   # (1, 1, Q, K)
    every = (k_hi[None, :] <= q_lo[:, None])[None, None]
    if query_doc is not None:
        (qd_lo, qd_hi), (kd_lo, kd_hi) = _tile_ranges(query_doc), _tile_ranges(key_doc)   # (b, Q), (b, K)
        overlap = (kd_lo[:, None, :] <= qd_hi[:, :, None]) & (kd_hi[:, None, :] >= qd_lo[:, :, None])
        one_doc = (qd_lo == qd_hi)[:, :, None] & (kd_lo == kd_hi)[:, None, :] & (qd_lo[:, :, None] == kd_lo[:, None, :])
        some, every = some & overlap[:, None], every & one_doc[:, None]   # (b, 1, Q, K)

    def visible(b, h, q, k):
        seen = key_pos[k] <= query_pos[q]
        return seen if query_doc is None else seen & (query_doc[b, q] == key_doc[b, k])

    return BlockMask.from_kv_blocks(*_ordered(some & ~every), *_ordered(every), BLOCK_SIZE=BLOCK, mask_mod=visible,
                                    seq_lengths=(query_pos.shape[0], key_pos.shape[0]))


def _listed_tiles(count, indices):
    """flex's layout of a tile list, (B, 1, Q) counts and (B, 1, Q, K) indices, back to (B, 1, Q, K) bool."""
    K = indices.shape[-1]
    listed = torch.arange(K, device=indices.device) < count[..., None]
    spare = torch.zeros(*indices.shape[:-1], K + 1, dtype=torch.bool, device=indices.device)  # column K: unlisted
    return spare.scatter_(-1, torch.where(listed, indices.long(), K), True)[..., :K]


def dense_mask(block_mask):
    """The (B, 1, l, L) boolean mask flex_attention's kernel applies, written out: unlisted
    tiles hidden, full tiles whole, the other listed tiles by the mask function."""
    l, L = block_mask.seq_lengths
    grow = lambda tiles: tiles.repeat_interleave(BLOCK, 2).repeat_interleave(BLOCK, 3)[:, :, :l, :L]   # noqa: E731
    full = grow(_listed_tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    masked = grow(_listed_tiles(block_mask.kv_num_blocks, block_mask.kv_indices))
    device = masked.device
    b = torch.arange(masked.shape[0], device=device)[:, None, None, None]
    q, k = torch.arange(l, device=device)[:, None], torch.arange(L, device=device)[None, :]
    return full | (masked & block_mask.mask_mod(b, 0, q, k))


_compiled_flex = []


def masked_attention(query, key, value, block_mask, scaling=None):
    """query (b, hq, l, d), key and value (b, hkv, L, d) with hq a multiple of hkv (grouped-query
    attention read in place, no copy per query head) -> (b, l, hq, d). On a GPU the fused
    flex_attention kernel, compiled once per shape, which reads only the tiles the mask lists;
    on a CPU (flex_attention has no CPU backward) SDPA under dense_mask, the same function
    with the l x L mask written out (for tests; the GPU tests check the kernel against it)."""
    gqa = key.shape[1] != query.shape[1]
    if query.device.type == "cpu":
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=dense_mask(block_mask), scale=scaling,
                                             enable_gqa=gqa)
    else:
        if not _compiled_flex:
            _compiled_flex.append(torch.compile(flex_attention, dynamic=False))
        out = _compiled_flex[0](query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


CACHE_REFUSAL = ("enable_cp: a cache (generation, use_cache on in evaluation, or layers recomputed by activation "
                 "checkpointing of your own, which refill it) is not supported under context parallelism: evaluate "
                 "and train shards with use_cache=False, and generate with a model that has not been through enable_cp")


class CPAttention:
    """What the attention layers of one CP model share: the group, the layout, and the mask of
    the forward under way, made once per forward by a hook on the model (every rank runs it, so
    the documents' all-gather in it is one collective every rank makes) and read by every layer."""

    def __init__(self, cp_group, load_balancing):
        self.cp_group, self.load_balancing = cp_group, load_balancing
        self.world = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.seq_idx, self.l, self.block_mask = None, None, None

    def make_mask(self, l, device, seq_idx=None):
        """The mask for l local tokens per row (and seq_idx (b, l), this rank's documents)."""
        keys = key_positions(l, self.world, self.load_balancing, device)          # (W * l,)
        queries = keys[self.rank * l:(self.rank + 1) * l]                          # (l,)
        docs = ()
        if seq_idx is not None:
            seq_idx = seq_idx.to(device=device, dtype=torch.int32).contiguous()
            docs = (seq_idx, seq_idx if self.world == 1 else _gathered(seq_idx, self.cp_group, 1))
        return cp_block_mask(queries, keys, *docs)

    def before_forward(self, model, args, kwargs):
        # a cache in evaluation is refused here, before the mixers would hand a shard to
        # transformers' own forward, and for models (Zamba2) whose layers keep use_cache from
        # their attention
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(model.config, "use_cache", False)
        cache = any(kwargs.get(n) is not None for n in ("cache", "past_key_values", "cache_params"))
        if not model.training and (use_cache or cache):
            raise ValueError(CACHE_REFUSAL)
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        self.seq_idx, self.l = kwargs.get("seq_idx"), tokens.shape[1]
        self.block_mask = self.make_mask(self.l, tokens.device, self.seq_idx)

    def mask_for(self, seq_idx, l):
        if seq_idx is not self.seq_idx or l != self.l:
            raise ValueError("enable_cp: this attention call's tokens (or seq_idx) are not those of the model's "
                             "forward under way; call the model enable_cp was given, with seq_idx as a keyword")
        return self.block_mask


def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, seq_idx=None, **kwargs):
    """transformers' attention-interface signature: query (b, hq, l, d) and key, value (b, hkv,
    l, d) of this rank's tokens (rotary embeddings applied, from global positions); returns
    (b, l, hq, d) and no weights. Token i sees token j where j's global position is not after
    i's and, with seq_idx (b, l), both lie in one document."""
    cp = module.mamba_cp
    if key.shape[2] != query.shape[2] or (kwargs.get("use_cache") and not module.training):
        raise ValueError(CACHE_REFUSAL)
    if attention_mask is not None:
        raise ValueError("enable_cp: the attention layers build their own mask under context parallelism; "
                         "a padding mask is not supported (pack the documents instead)")
    if not module.is_causal:
        raise ValueError(f"enable_cp: {type(module).__name__} is not causal")
    if dropout and module.training:
        raise ValueError(f"enable_cp: {type(module).__name__} has attention dropout {dropout}, which the fused "
                         f"attention kernel does not apply")
    if kwargs.pop("sliding_window", None) is not None:
        raise ValueError(f"enable_cp: {type(module).__name__} uses sliding-window attention, which this file "
                         f"does not run on a shard")
    _refuse_unknown(kwargs, f"enable_cp: {type(module).__name__}")
    block_mask = cp.mask_for(seq_idx, query.shape[2])
    if cp.world > 1:
        key, value = (_GatherTokens.apply(t, cp.cp_group) for t in (key, value))   # (b, hkv, W * l, d)
    return masked_attention(query, key, value, block_mask, scaling), None


def _attention_layers(model):
    return [m for m in model.modules() if all(hasattr(m, part) for part in ATTENTION_PARTS)]


def _layers_to_patch(model):
    """The model's Mamba2 mixers and attention layers, once its declared layer kinds are all
    kinds this file runs on a shard, the modules found match them in number, and no attention
    has a sliding window."""
    config = model.config
    kinds = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if kinds is None:
        raise ValueError(f"enable_cp: {type(model).__name__}'s config declares no layer kinds "
                         f"(layer_types or layers_block_type)")
    kinds = list(kinds)
    unknown = sorted(set(kinds) - {MAMBA_KIND, ATTENTION_KIND, HYBRID_KIND, *TOKENWISE_KINDS})
    if unknown:
        raise ValueError(f"enable_cp: {type(model).__name__} has layers of kind {unknown}, which this file does not "
                         f"know how to run on a shard (it knows {MAMBA_KIND!r}, {ATTENTION_KIND!r}, {HYBRID_KIND!r} "
                         f"and {', '.join(map(repr, TOKENWISE_KINDS))})")
    mixers, attentions = _mamba2_mixers(model), _attention_layers(model)
    windows = {getattr(config, "sliding_window", None)} | {getattr(m, "sliding_window", None) for m in attentions}
    if windows - {None}:
        raise ValueError(f"enable_cp: {type(model).__name__} uses sliding-window attention (sliding_window="
                         f"{sorted(windows - {None})}), which this file does not run on a shard")
    hybrids = kinds.count(HYBRID_KIND)          # one mixer and one attention each
    for kind, found in ((MAMBA_KIND, mixers), (ATTENTION_KIND, attentions)):
        declared = kinds.count(kind) + hybrids
        if declared != len(found):
            kind = repr(kind) + (f" or {HYBRID_KIND!r}" if hybrids else "")
            raise ValueError(f"enable_cp: {type(model).__name__} declares {declared} layers of kind {kind} but holds "
                             f"{len(found)} such modules; its layout is not one this file knows")
    return mixers, attentions


def enable_cp(model, cp_group, load_balancing="virtual"):
    """Make every layer of a supported transformers model (module docstring) correct on this
    rank's shard of the sequence, in the layout `load_balancing`: the Mamba2 mixers as
    enable_mamba_cp does, the attention layers through cp_attention (flex_attention under a
    mask made once per forward). cp_group None, or a group of one, is a world of one: the same
    code on the whole sequence, no collective (module docstring). Returns the model."""
    _check_layout(load_balancing)
    mixers, attentions = _layers_to_patch(model)
    patched = _patched_mixers(model, cp_group, load_balancing) if mixers else []   # refusals before any patch
    if attentions:
        from transformers import AttentionInterface
        AttentionInterface.register(ATTENTION, cp_attention)
        shared = CPAttention(_group_or_none(cp_group), load_balancing)
        for module in attentions:
            module.mamba_cp = shared
        model.set_attn_implementation(ATTENTION)
        if hasattr(model, "_mamba_cp_hook"):
            model._mamba_cp_hook.remove()
        model._mamba_cp_hook = model.register_forward_pre_hook(shared.before_forward, with_kwargs=True)
    for mixer, forward in patched:
        mixer.forward = forward
    return model


# ---------------------------------------------------------------------------------------------
# What each rank is handed, and the gradients without FSDP
# ---------------------------------------------------------------------------------------------

def shard_batch(input_ids, labels, rank, world, load_balancing="virtual", position_ids=None):
    """This rank's share of a batch of whole sequences (b, L): input_ids; position_ids (global
    positions, or the given ones: packed documents restart at 0); seq_idx, the global document
    of each token (int32; all 0 without packing); shift_labels (the labels shifted on the whole
    sequence, -100 after a document's last token); and num_items, the global count of predicted
    tokens (the loss's divisor)."""
    b, L = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(L, device=input_ids.device)
    position_ids = position_ids.expand(b, L)                   # (L,) or (1, L) serve every row
    starts = position_ids == 0
    starts[:, 0] = True
    seq_idx = (torch.cumsum(starts.int(), dim=1) - 1).to(torch.int32)              # (b, L)
    shift_labels = torch.full_like(labels, -100)
    shift_labels[:, :-1] = torch.where(starts[:, 1:], -100, labels[:, 1:])
    share = {name: mamba_cp.shard(t, rank, world, load_balancing)
             for name, t in (("input_ids", input_ids), ("position_ids", position_ids), ("seq_idx", seq_idx),
                             ("shift_labels", shift_labels))}
    share["num_items"] = int((shift_labels != -100).sum())
    return share


def all_reduce_grads(model, cp_group):
    """Sum every parameter's gradient over the CP group (each rank holds its own contribution).
    Not with FSDP: its reduce-scatter does this (module docstring). Nothing in a world of one."""
    if _group_or_none(cp_group) is None:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp_group)
