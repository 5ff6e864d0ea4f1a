"""State-passing context parallelism for a Hugging Face transformers Mamba2 model, through mamba_cp.

Copy this file next to mamba_cp.py in a trainer. A training step:

    model = enable_mamba_cp(model, cp_group, load_balancing="virtual")   # once, after loading
    batch = shard_batch(input_ids, labels, rank, world)                  # per step, on every rank
    out = model(input_ids=batch["input_ids"], labels=batch["shift_labels"],
                shift_labels=batch["shift_labels"], num_items_in_batch=batch["num_items"])
    out.loss.backward()

What the trainer must do besides:
  - the loss: each rank's loss is the sum of its tokens' cross-entropy divided by the global
    count of predicted tokens (`num_items_in_batch`, which transformers' causal-LM loss takes),
    so the ranks' losses add up to the unsharded model's mean loss; the labels are shifted on
    the whole sequence before sharding (`shift_labels`), because a shard's last token predicts
    the first token of the next shard;
  - the gradients: every rank holds its own contribution to each parameter's gradient, so sum
    them over the CP group before the optimizer step (`all_reduce_grads` below); with data
    parallelism too, sum over DP x CP (or average over DP after summing over CP);
  - the layout: `load_balancing` must be the one the batch was sharded in ("virtual": zigzag
    shards, two half-shards per rank, the layout ring attention balances; "none": contiguous).

The mixers are found by what they hold (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj) rather
than by class name. Trained under CP in the tests (transformers 5.24): Mamba2ForCausalLM. Found,
but not trained under CP (their attention layers need PyTorch's context parallelism, which does
not run on CPUs): the mixers of BambaForCausalLM, GraniteMoeHybridForCausalLM and
NemotronHForCausalLM. The module tree and the parameter names stay transformers' own:
checkpoints load and save unchanged.

Limits: packed documents are not separated (transformers' Mamba2 model hands no document ids
to its mixers; mamba_cp's `seq_idx` would take them); a padding mask (an attention_mask with
zeros) is refused under CP; with a cache (generation) the mixers run transformers' own forward,
on whatever they are given.
"""

import torch
import torch.distributed as dist

import mamba_cp

MIXER_PARTS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj")


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

    def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is not None:            # generation: transformers' own path, unsharded
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None:   # transformers passes None for an all-ones mask
            raise ValueError("enable_mamba_cp: a padding mask (attention_mask with zeros) is not supported under "
                             "context parallelism; pack the documents into full sequences instead")
        zxbcdt = mixer.in_proj(hidden_states)                                       # (b, l_local, width)
        return mamba_cp.mamba_split_conv1d_scan_combined(
            zxbcdt, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
            -torch.exp(mixer.A_log.float()), mixer.D, mixer.chunk_size,
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
    if load_balancing not in mamba_cp.LAYOUTS:
        raise ValueError(f"enable_mamba_cp: load_balancing={load_balancing!r}, expected one of {mamba_cp.LAYOUTS}")
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return model
    mixers = _mamba2_mixers(model)
    if not mixers:
        raise ValueError(f"enable_mamba_cp: no Mamba2 mixer (a module holding {', '.join(MIXER_PARTS)}) "
                         f"in {type(model).__name__}")
    for mixer in mixers:
        mixer.forward = _cp_forward(mixer, cp_group, load_balancing)
    return model


def shard_batch(input_ids, labels, rank, world, load_balancing="virtual"):
    """This rank's share of a batch of whole sequences (b, L): input_ids and position_ids
    (global positions), shift_labels (the labels shifted on the whole sequence, -100 after its
    last token), and num_items, the global count of predicted tokens (the loss's divisor)."""
    b, L = input_ids.shape
    shift_labels = torch.full_like(labels, -100)
    shift_labels[:, :-1] = labels[:, 1:]
    position_ids = torch.arange(L, device=input_ids.device).expand(b, L)
    share = {name: mamba_cp.shard(t, rank, world, load_balancing)
             for name, t in (("input_ids", input_ids), ("position_ids", position_ids), ("shift_labels", shift_labels))}
    share["num_items"] = int((shift_labels != -100).sum())
    return share


def all_reduce_grads(model, cp_group):
    """Sum every parameter's gradient over the CP group (each rank holds its own contribution)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp_group)
