"""
The teacher on GPUs. Its targets' per-slice work compiled (cache_teacher.token_stats, handed in:
the one function, eager on a CPU), and a teacher too big for one GPU (or any, with cache_teacher.py
--shard-teacher under torchrun) FSDP2-sharded over the ranks instead of copied to each. Only rank 0
reads its weights, the others build it on the meta device (cache_teacher.build_cache) and receive
their shards here (fsdp.parallelize), so host and device memory a rank falls with the number of
ranks. Every rank still computes its own shards of the cache; since each forward is collective, a
rank with fewer batches runs the difference on a dummy batch, whose targets it discards
(compute_shards' `forwards`). The cache is the same as one process's.
"""
import functools

import torch

from runtime import load_model
from scale.fsdp import parallelize


@functools.cache
def compiled(token_stats):
    """token_stats(z, topk, with_logp), compiled, once a process. Eager, each of its operations
    writes an (n, V) fp32 tensor that the next reads back: the upcast, log p, p, the clamp.
    Compiled, they become a few fused reductions over the slice's logits (bf16, half fp32's bytes)
    that write only the (n,) entropy and the (n, K) log-probs gathered at the top-K (log p itself
    only when sampling asks for it); the top-K is torch's own kernel, over z. Static shapes: the
    4096-token slices, and a batch's last one, compile once each. Not fullgraph: past dynamo's
    limit of shapes a shape runs eagerly instead of raising (the tests check that each form is one
    graph)."""
    return torch.compile(token_stats, dynamic=False)


def fits_one_device(model_name, device, margin=0.8):
    """Whether the teacher's bf16 weights take less than `margin` of one GPU's free memory (the
    rest is for activations and the head's chunks). On a CPU: yes (--shard-teacher asks)."""
    if device.type != "cuda":
        return True
    meta, _ = load_model(model_name, weights=False)  # the config alone: no reads, no memory
    return 2 * sum(p.numel() for p in meta.parameters()) < margin * torch.cuda.mem_get_info(
        device)[0]


def sharded(model, device):
    """The teacher (its weights on rank 0, on the meta device elsewhere) FSDP2-sharded over the
    ranks, in eval mode."""
    model = parallelize(model, device, train=False).eval()
    with torch.no_grad():  # one root forward first: FSDP2 initialises lazily, from the root down
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    return model


def full_teacher(args, cache):
    """prune.py --kd-full: the model that made the cache, in its dtype, frozen, in eval mode (None
    without a cache): the full-vocabulary reference target, beside the student in one process."""
    if not cache:
        return None
    teacher = load_model(cache.meta["model"]["model"], args.device,
                         getattr(torch, cache.meta.get("teacher_dtype", "float32")))[0]
    return teacher.eval().requires_grad_(False)  # frozen: its forwards record no graph
