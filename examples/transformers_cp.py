"""Context parallelism for Hugging Face transformers Mamba2 models and hybrids, through mamba_cp.

Copy this file next to mamba_cp.py in a trainer. A training step, every rank holding its share
of the same sequences (load_balancing: "virtual", zigzag shards, two half-shards per rank, the
layout ring attention balances; "none", contiguous; the batch must be sharded in the same one):

    model = enable_cp(model, cp_group, load_balancing="virtual")         # once, after loading
    batch = shard_batch(input_ids, labels, rank, world, "virtual",       # per step, every rank
                        position_ids=position_ids)                       # packed documents: optional
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], seq_idx=batch["seq_idx"],
                labels=batch["shift_labels"], shift_labels=batch["shift_labels"],
                num_items_in_batch=batch["num_items"])
    out.loss.backward()
    all_reduce_grads(model, cp_group)                                    # without FSDP (below)

What each layer kind does on a shard:
  - Mamba2 mixers run mamba_cp's mamba_split_conv1d_scan_combined (state passing: a conv halo
    and one state summary per rank), from the mixer's own parameters;
  - attention layers (registered through transformers' attention interface, no model code
    edited) all-gather K and V over the CP group and mask by global position, the method Llama 3
    was trained with; in backward each rank gets back the gradient of its own K and V, summed
    over the ranks that used them (a reduce-scatter);
  - MLP and MoE layers work token by token: nothing to do.
Supported: Mamba2ForCausalLM, BambaForCausalLM, GraniteMoeHybridForCausalLM and
NemotronHForCausalLM (transformers 5.24), found by the layer kinds their configs declare
(layer_types / layers_block_type: "linear_attention" for Mamba2, "full_attention", "mlp",
"moe"); another kind raises ValueError naming it. `enable_mamba_cp` patches the mixers alone, for
trainers whose attention is parallelised already (torch's context_parallel, say).

The loss: each rank's loss is the sum of its tokens' cross-entropy divided by the global count of
predicted tokens (`num_items_in_batch`, which transformers' causal-LM loss takes), so the ranks'
losses add up to the unsharded model's mean loss. The labels are shifted on the whole sequence
before sharding (`shift_labels`): a shard's last token predicts the first of the next shard.

Packed documents: `shard_batch` reads document starts from `position_ids` (restarting at 0, as
transformers' DataCollatorWithFlattening writes them) and returns `seq_idx`, global document ids
per token; passed to the model, it reaches every mixer and attention layer (transformers forwards
the CausalLM's keywords to them), which keep documents apart; the last token of a document
predicts nothing. Without `seq_idx` nothing is separated: transformers' own mixers never derive it
from `position_ids`. Mamba2ForCausalLM hands its mixers no keywords at all, so it cannot take
packed documents here (nor in transformers).

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

Limits: a padding mask (an attention_mask with zeros) is refused under CP (pack instead). A cache:
transformers makes one whenever use_cache is on, training too; a training forward runs on the
shard and leaves it empty. In evaluation a cache means generation: the Mamba2 mixers then run
transformers' own forward, on whatever they are given (a Mamba2ForCausalLM generates unsharded),
and enable_cp's attention refuses it (evaluate shards with use_cache=False, and generate with a
model that has not been through enable_cp). Keywords that describe
documents some other way (cu_seq_lens_q, max_length_k, ...) are refused: pass seq_idx. Losses a
model adds per rank as a mean over its own tokens (Bamba's z-loss, GraniteMoeHybrid's router
auxiliary loss, both off by default) are not renormalised across ranks.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mamba_cp

MIXER_PARTS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION = "mamba_cp_gathered_kv"        # the name this file registers with transformers
MAMBA_KIND, ATTENTION_KIND, TOKENWISE_KINDS = "linear_attention", "full_attention", ("mlp", "moe")
# keywords that reach the mixers and attention layers from the CausalLM forward and say nothing
# about which tokens may see which: the loss's, the router's, the cache switch, and the positions
# (the rotary embeddings have taken them before attention runs)
INERT_KEYWORDS = {"num_items_in_batch", "shift_labels", "output_router_logits", "use_cache", "output_attentions",
                  "position_ids"}


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


def _mixer_sizes(mixer):
    """(headdim, ngroups) of a transformers Mamba2 mixer. mamba_cp's gated RMSNorm, like
    mamba_ssm's, normalises groups of dim / ngroups channels, the width of one B/C group.
    transformers 5.24 does the same (its norm's `group_size`); 5.17 normalises all dim channels
    at once, which agrees only when the mixer has one group: other mixers are refused."""
    dim, nheads = mixer.out_proj.in_features, mixer.dt_bias.shape[0]
    ngroups = getattr(mixer, "n_groups", None)
    if ngroups is None:
        raise ValueError(f"enable_mamba_cp: {type(mixer).__name__} has no n_groups (the number of B/C groups)")
    norm_width = getattr(mixer.norm, "group_size", dim)
    if norm_width * ngroups != dim:
        raise ValueError(f"enable_mamba_cp: {type(mixer).__name__}'s gated RMSNorm normalises groups of {norm_width} "
                         f"of its {dim} channels, but mamba_cp normalises groups of dim / n_groups = "
                         f"{dim // ngroups} (its n_groups is {ngroups}); this transformers version's norm "
                         f"is not supported with more than one group")
    return dim // nheads, ngroups


def _cp_forward(mixer, cp_group, load_balancing):
    """The mixer's forward on this rank's shard: in_proj, then conv, SSD, gated RMSNorm and out
    projection in one mamba_cp call, from the mixer's own parameters."""
    original = mixer.forward
    headdim, ngroups = _mixer_sizes(mixer)         # checked here, when enable_mamba_cp patches the mixer

    def forward(hidden_states, cache=None, attention_mask=None, seq_idx=None, **kwargs):
        # transformers makes a cache whenever use_cache is on, training too: a training forward
        # runs on the shard and leaves it empty; in evaluation a cache means generation, which
        # runs transformers' own path on whatever it is given
        if cache is not None and not mixer.training:
            if seq_idx is not None:
                kwargs["seq_idx"] = seq_idx
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None:   # transformers passes None for an all-ones mask
            raise ValueError("enable_mamba_cp: a padding mask (attention_mask with zeros) is not supported under "
                             "context parallelism; pack the documents into full sequences instead")
        _refuse_unknown(kwargs, f"enable_mamba_cp: {type(mixer).__name__}")
        zxbcdt = mixer.in_proj(hidden_states)                                       # (b, l_local, width)
        return mamba_cp.mamba_split_conv1d_scan_combined(
            zxbcdt, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
            -torch.exp(mixer.A_log.float()), mixer.D, mixer.chunk_size, seq_idx=seq_idx,
            dt_limit=tuple(mixer.time_step_limit), activation=mixer.activation,
            rmsnorm_weight=mixer.norm.weight, rmsnorm_eps=mixer.norm.variance_epsilon,
            outproj_weight=mixer.out_proj.weight, outproj_bias=mixer.out_proj.bias,
            headdim=headdim, ngroups=ngroups,
            norm_before_gate=False,      # transformers' gated norm: norm(y * silu(z))
            cp_group=cp_group, load_balancing=load_balancing)

    return forward


def enable_mamba_cp(model, cp_group, load_balancing="virtual"):
    """Patch, in place, every Mamba2 mixer of `model` so that (without a cache) it takes this
    rank's shard of the hidden states, in the layout `load_balancing`, and returns this rank's
    shard of its output. cp_group None, or a group of one, leaves the model as it was. Returns
    the model."""
    mamba_cp._check_layout(load_balancing)
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return model
    mixers = _mamba2_mixers(model)
    if not mixers:
        raise ValueError(f"enable_mamba_cp: no Mamba2 mixer (a module holding {', '.join(MIXER_PARTS)}) "
                         f"in {type(model).__name__}")
    for mixer in mixers:
        mixer.forward = _cp_forward(mixer, cp_group, load_balancing)
    return model


# ---------------------------------------------------------------------------------------------
# Attention: K and V all-gathered over the CP group, the causal mask from global positions
# ---------------------------------------------------------------------------------------------

def _gathered(t, group, dim):
    """Every rank's t, concatenated in rank order along its token axis `dim`."""
    world = dist.get_world_size(group)
    out = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)                 # (W * b, ...)
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
        dist.reduce_scatter_tensor(own, per_rank.contiguous(), group=ctx.group)
        return own, None


def _global_positions(l_local, world, load_balancing, device):
    """Where every rank's l_local tokens sit in the whole sequence, the ranks' shards one after
    another (W * l_local,), in the layout."""
    positions = torch.arange(l_local * world, device=device)[None]
    return torch.cat([mamba_cp.shard(positions, r, world, load_balancing)[0] for r in range(world)])


def gathered_kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, seq_idx=None,
                          **kwargs):
    """transformers' attention-interface signature: query (b, hq, l, d) and key, value (b, hkv,
    l, d) of this rank's tokens (rotary embeddings applied, from global positions); returns
    (b, l, hq, d) and no weights. Token i sees token j where j's global position is not after
    i's and, with seq_idx (b, l), both lie in one document."""
    cp_group, load_balancing = module.mamba_cp
    if key.shape[2] != query.shape[2] or (kwargs.get("use_cache") and not module.training):
        raise ValueError("enable_cp: a cache (generation, or use_cache on in evaluation) is not supported under "
                         "context parallelism: evaluate shards with use_cache=False, and generate with a model "
                         "that has not been through enable_cp")
    if attention_mask is not None:
        raise ValueError("enable_cp: the attention layers build their own mask under context parallelism; "
                         "a padding mask is not supported (pack the documents instead)")
    if not module.is_causal:
        raise ValueError(f"enable_cp: {type(module).__name__} is not causal")
    _refuse_unknown(kwargs, f"enable_cp: {type(module).__name__}")
    world, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    b, hq, l, _ = query.shape
    key, value = (_GatherTokens.apply(t, cp_group) for t in (key, value))      # (b, hkv, W * l, d)
    if key.shape[1] != hq:                                                      # grouped-query attention
        key, value = (t.repeat_interleave(hq // t.shape[1], dim=1) for t in (key, value))
    keys = _global_positions(l, world, load_balancing, query.device)           # (W * l,)
    queries = keys[rank * l:(rank + 1) * l]                                    # (l,)
    visible = (keys[None, :] <= queries[:, None])[None]                        # (1, l, W * l)
    if seq_idx is not None:
        visible = visible & (seq_idx[:, :, None] == _gathered(seq_idx, cp_group, 1)[:, None, :])   # (b, l, W * l)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible[:, None], dropout_p=dropout,
                                         scale=scaling)                         # (b, hq, l, d)
    return out.transpose(1, 2).contiguous(), None


def _attention_layers(model):
    return [m for m in model.modules() if all(hasattr(m, part) for part in ATTENTION_PARTS)]


def _layers_to_patch(model):
    """The model's Mamba2 mixers and attention layers, once its declared layer kinds are all
    kinds this file runs on a shard and the modules found match them in number."""
    config = model.config
    kinds = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if kinds is None:
        raise ValueError(f"enable_cp: {type(model).__name__}'s config declares no layer kinds "
                         f"(layer_types or layers_block_type)")
    kinds = list(kinds)
    unknown = sorted(set(kinds) - {MAMBA_KIND, ATTENTION_KIND, *TOKENWISE_KINDS})
    if unknown:
        raise ValueError(f"enable_cp: {type(model).__name__} has layers of kind {unknown}, which this file does not "
                         f"know how to run on a shard (it knows {MAMBA_KIND!r}, {ATTENTION_KIND!r} and "
                         f"{', '.join(map(repr, TOKENWISE_KINDS))})")
    mixers, attentions = _mamba2_mixers(model), _attention_layers(model)
    for kind, found in ((MAMBA_KIND, mixers), (ATTENTION_KIND, attentions)):
        if kinds.count(kind) != len(found):
            raise ValueError(f"enable_cp: {type(model).__name__} declares {kinds.count(kind)} layers of kind "
                             f"{kind!r} but holds {len(found)} such modules; its layout is not one this file knows")
    return mixers, attentions


def enable_cp(model, cp_group, load_balancing="virtual"):
    """Make every layer of a supported transformers model (module docstring) correct on this
    rank's shard of the sequence, in the layout `load_balancing`: the Mamba2 mixers as
    enable_mamba_cp does, the attention layers through this file's attention function. cp_group
    None, or a group of one, leaves the model as it was. Returns the model."""
    mamba_cp._check_layout(load_balancing)
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return model
    mixers, attentions = _layers_to_patch(model)
    if attentions:
        from transformers import AttentionInterface
        AttentionInterface.register(ATTENTION, gathered_kv_attention)
        for module in attentions:
            module.mamba_cp = (cp_group, load_balancing)
        model.set_attn_implementation(ATTENTION)
    if mixers:
        enable_mamba_cp(model, cp_group, load_balancing)
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
    Not with FSDP: its reduce-scatter does this (module docstring)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp_group)
