"""
Merging at the cut (prune.py --experts-keep N --expert-merge): the experts the cut drops are folded
into the ones it keeps instead of thrown away, then the fine-tune recovers the rest (AKD), and the
export is the same plain N-expert model.

For each MoE layer the cut keeps, over the calibration tokens (--calib-data, the importance's):

    f_j          expert j's routing share: the tokens whose top-k holds j (importance.frequency)
    sim(i, j)    the cosine between the router's logits for i and for j across the tokens, the
                 columns of the [tokens, E] logit matrix (M-SMoE's routing similarity, Li et al.,
                 arXiv 2310.01334): experts the router treats alike serve alike tokens
    assignment   each dropped expert d joins the kept expert k most similar to it (within its
                 routing group for DeepSeek's n_group: a merge never crosses a group)
    merge        every tensor of the experts module with the expert dimension (the fused
                 gate_up_proj, down_proj and their biases), row k <- (f_k W_k + sum_d f_d W_d) /
                 (f_k + sum_d f_d), the routing-share-weighted mean of HC-SMoE (Chen et al., arXiv
                 2410.08589) and M-SMoE, without M-SMoE's neuron alignment (a kept expert no
                 calibration token reached becomes its merged experts' mean); the router's row,
                 bias and score correction stay the kept expert's; AdamW's moments of a merged row
                 start again from 0 (after a search: they were the old row's)

on the model the layer cut left (the statistics of the layers it keeps, in the model they will
serve in), then the cut (experts/cut.py) slices the kept rows as without merging. One process: under
FSDP2 an expert's rows sit on one rank and a merge would cross ranks, so check_args refuses it there.
"""
import torch

from experts.importance import frequency_importance
from experts.routing import expert_tensors, moe_layers
from runtime import E3Error, print0


def check_args(args):
    """One line before any work where a merge cannot run: under torchrun (any number of ranks: FSDP2
    shards the weights) or planned for more than one rank."""
    import os
    if "RANK" in os.environ or (args.plan or 1) > 1:
        raise E3Error("--expert-merge averages experts' rows that FSDP2 keeps on different ranks: run "
                      "it in one process (the fine-tune after it may then resume under torchrun)")


@torch.no_grad()
def router_similarity(model, batches):
    """Per MoE layer, the cosine similarity [E, E] of the router's logit columns over the tokens of
    `batches` (in eval mode: no router jitter), float64."""
    moes, grams, training = moe_layers(model), {}, model.training

    def hook(m):
        def on_call(module, inputs, output):  # the logits from the router's input and weight
            x = inputs[0].detach().double().reshape(-1, module.weight.shape[-1])
            bias = getattr(module, "bias", None)
            z = x @ module.weight.detach().double().T + (0 if bias is None else bias.detach().double())
            grams[m] = grams.get(m, 0) + z.T @ z  # sum over tokens of z_i z_j
        return on_call
    handles = [moe.linear.register_forward_hook(hook(m)) for m, moe in enumerate(moes)]
    model.eval()
    dev = next(model.parameters()).device
    try:
        for ids, attn in batches:
            model(input_ids=ids.to(dev), attention_mask=None if attn is None else attn.to(dev), use_cache=False)
    finally:
        model.train(training)
        for h in handles:
            h.remove()
    out = []
    for m in range(len(moes)):
        g = grams[m].cpu()
        norm = g.diagonal().clamp_min(1e-300).sqrt()
        out.append(g / norm[:, None] / norm[None, :])
    return out


@torch.no_grad()
def merge_experts(model, kept, batches, groups=1, log=None, layers=None, moments=None):
    """In place, before the cut: in each MoE layer, every expert outside kept[its original index]
    ({layer (str): the experts kept}; layers: each model layer's original index, None: its own)
    averaged into its most similar kept expert's rows, weighted by routing share; moments (an
    optimizer's state): the merged rows' zeroed. Returns {layer: {dropped: kept}}."""
    share, here = frequency_importance(model, batches)
    sims = router_similarity(model, batches)
    done = {}
    for m, moe in enumerate(moe_layers(model)):
        layer = here[m] if layers is None else layers[here[m]]  # its original index
        keep = sorted(kept[str(layer)])
        E, f = moe.E, share[m]
        size = E // groups
        into = {}
        for d in (j for j in range(E) if j not in keep):
            same = [k for k in keep if k // size == d // size]  # its routing group's kept experts
            into[d] = max(same, key=lambda k: (sims[m][d, k].item(), -k))
        tensors = [(o, n) for o, n, dim in expert_tensors(moe) if any(o is x for x in moe.experts.modules())]
        for k in keep:
            members = [k] + [d for d, t in into.items() if t == k]
            w = torch.stack([f[j] for j in members])
            if w.sum() <= 0:
                continue  # no calibration token reached any of them: the kept expert as it is
            w = w / w.sum()
            for owner, name in tensors:
                t = getattr(owner, name)
                t.data[k] = sum(wj.to(t.dtype) * t.data[j] for wj, j in zip(w, members))
                for v in (moments or {}).get(t, {}).values():  # AdamW's exp_avg, exp_avg_sq
                    if torch.is_tensor(v) and v.shape == t.shape and len(members) > 1:
                        v[k] = 0
        done[str(layer)] = {str(d): k for d, k in into.items()}
        print0(f"expert merge, layer {layer}: " + " ".join(f"{d}->{k}" for d, k in into.items()))
    if log is not None:
        log(event="expert_merge", merged=done)
    return done
