"""
Data parallelism with FSDP2 (torchtitan's parallelize.py, gpt-fast's `apply_tp` idea): everything that
knows the model is sharded lives here, applied with one call, so the training step never asks.

  parallelize(model, device)         fully_shard each decoder layer, then the root
  load_from_rank0(model, state, ..)  rank 0 read the checkpoint; every rank receives its shards
"""
import torch

from surgery import decoder_layers


def parallelize(model, device):
    """FSDP2: each decoder layer its own unit, then the root (embeddings, final norm, LM head; tied
    embeddings stay together). bf16 compute with fp32 master weights and fp32 gradient reduction on
    GPU; plain fp32 on CPU (gloo)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # Per-layer units let FSDP all-gather one layer while the previous one computes, and let the pruned
    # layers' units simply disappear from the module tree after the search (remove_layers).
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def load_from_rank0(model, full_state, rank, device):
    """Give every rank its shards of rank 0's weights: the other ranks built the model on the meta device,
    so the host holds one full copy of the checkpoint instead of one per rank (8 x 27 GB for a 7B model in
    fp32 under the headline command). Buffers (e.g. rotary inv_freq) are not sharded and, when not
    persistent, not in the state dict: they are broadcast whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    if rank > 0:
        model.to_empty(device=device)  # real (uninitialised) shards and buffers; FSDP keeps tied weights tied
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():  # the same order on every rank
        torch.distributed.broadcast(buf, src=0)
