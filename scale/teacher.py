"""
The teacher on GPUs. Its targets' per-slice work compiled (cache_teacher.token_stats: the one
function, eager on a CPU), and a teacher too big for one GPU (or any, with cache_teacher.py
--shard-teacher under torchrun) FSDP2-sharded over the ranks instead of copied to each. Only rank 0
reads its weights, the others build it on the meta device and receive their shards
(fsdp.parallelize), so host and device memory a rank falls with the number of ranks. Every rank
still computes its own shards of the cache; since each forward is collective, a rank with fewer
batches runs the difference on a dummy batch, whose targets it discards. The cache is the same as
one process's.
"""
import functools

import torch
from tqdm import tqdm

from cache_teacher import (all_gather, compute_shards, load_model, teacher_dtype, teacher_targets,
                           token_stats)
from scale.data import stored_mask
from scale.fsdp import parallelize


def compiled_token_stats(z, topk, with_logp=False):
    """token_stats(z, topk, with_logp), compiled. Eager, each of its operations writes an (n, V)
    fp32 tensor that the next reads back: the upcast, log p, p, the clamp. Compiled, they become a
    few fused reductions over the slice's logits (bf16, half fp32's bytes) that write only the (n,)
    entropy and the (n, K) log-probs gathered at the top-K (log p itself only when sampling asks for
    it); the top-K is torch's own kernel, over z. Static shapes: the 4096-token slices, and a
    batch's last one, compile once each."""
    return _compiled()(z, topk, with_logp)


@functools.cache
def _compiled():  # on first use: torch.compile imports dynamo and inductor, seconds a process
    # (not fullgraph: past dynamo's limit of shapes a shape runs eagerly instead of raising; the
    # tests check that each form is one graph)
    return torch.compile(token_stats, dynamic=False)


def fits_one_device(model_name, device, margin=0.8):
    """Whether the teacher's bf16 weights take less than `margin` of one GPU's free memory (the
    rest is for activations and the head's chunks). On a CPU: yes (--shard-teacher asks)."""
    if device.type != "cuda":
        return True
    meta, _ = load_model(model_name, weights=False)  # the config alone: no reads, no memory
    return 2 * sum(p.numel() for p in meta.parameters()) < margin * torch.cuda.mem_get_info(
        device)[0]


def load_sharded_teacher(model_name, device):
    """The teacher in eval mode, FSDP2-sharded over the ranks; bf16 on a GPU, fp32 on a CPU."""
    rank = torch.distributed.get_rank()
    model, _ = load_model(model_name, "cpu", teacher_dtype(device), weights=rank == 0)
    model = parallelize(model, device, train=False).eval()
    with torch.no_grad():  # one root forward first: FSDP2 initialises lazily, from the root down
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    return model


def compute_shards_sharded(model_name, device, todo, shards, blocks, out, identity, batch_size,
                           logit_chunk=0):
    """cache_teacher.compute_shards for this rank's `todo` with the sharded teacher; every rank
    loads it if any has work and runs as many forwards as the busiest. Returns the tokens done."""
    rank = torch.distributed.get_rank()
    batches = all_gather(sum(-(-len(shards[job]) // batch_size) for job in todo))
    if max(batches) == 0:
        return 0
    model = load_sharded_teacher(model_name, device)
    jobs = ((job, blocks[job[0]][shards[job]], stored_mask(blocks[job[0]], shards[job]))
            for job in todo)
    total = sum(len(shards[job]) for job in todo) * identity["seq_len"]
    with tqdm(total=total, unit="tok", unit_scale=True, desc="teacher targets",
              disable=rank != 0) as bar:
        tokens = compute_shards(model, jobs, out, identity, batch_size, bar, logit_chunk)
    for _ in range(max(batches) - batches[rank]):
        teacher_targets(model, blocks["train"][0:1].to(device), identity["vocab_size"],
                        identity["topk"] or 1, logit_chunk)  # in step with the others: discarded
    return tokens
