"""
Offline top-K knowledge distillation and its entropy-weighted ("adaptive") form (paper Sec. 3.3).

For token i, with the teacher's top-K ids c, their log-probabilities log p_t,c under the
teacher's FULL softmax (pre-computed by cache_teacher.py) and the student's
log p_s = log_softmax(z_s) in fp32:

    L_token(i) = sum_{c in top-K} p_t,c * (log p_t,c - log p_s,c)           (eq. 12, left)
    kd:   L = 1/N sum_i L_token(i)                                          (eq. 12, right)
    akd:  L = 1/N sum_i H_t(i) * L_token(i),   H_t the teacher's entropy    (eq. 13)

N counts valid (non-pad) tokens only. With K = V, L_token is the full KL(p_t || p_s). Next-token
cross-entropy is the same sum with K = 1, c = the next token and log p_t,c = 0 (a one-hot teacher).

head_kd_loss computes the same losses from the last hidden states h and the LM head (W, b), with
z = post(W h + b) made `chunk_tokens` tokens at a time and dL/dz turned into dL/dh and dL/dW at
once: no (T, V) tensor ever exists (Qwen's V = 152K at 4096 tokens: 2.5 GB a copy in fp32).
Under FSDP the head may be vocabulary-parallel (W's rows split over the ranks, VocabShard): the
same sums, with lse's max and sum and the top-K logits all-reduced over the ranks.
"""
import torch
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# The LM head and the loss fused, chunk by chunk over tokens (no (T, V) logits)

class VocabShard:
    """Which rows of the head W this process computes, and how per-row results become whole-
    vocabulary ones. In one process: all V rows, and every reduction is the identity. Under FSDP
    with a vocabulary-parallel head (parallel.vocab_parallel: W a DTensor sharded by rows), each
    rank holds ceil(V / world) rows (the last ranks fewer, or none) and computes their logits for
    EVERY rank's tokens: the softmax's max
    and sum and the student's logits at the teacher's top-K ids are all-reduced over the ranks,
    dL/dh is summed back to the tokens' own ranks, and each rank's dL/dW is whole for its rows
    (Megatron-LM's vocabulary-parallel cross-entropy). W and its gradient are never whole on any
    rank; what travels is (tokens x d) and (tokens x K) a micro-batch."""

    def __init__(self, weight):
        self.group, self.world, self.start, self.V = None, 1, 0, weight.shape[0]
        if hasattr(weight, "device_mesh"):  # a DTensor: rank r holds rows [start, start + rows)
            from torch.distributed.tensor import Shard
            if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
                raise ValueError(f"a vocabulary-parallel head is sharded by rows over one mesh "
                                 f"dimension, not {weight.placements}")
            self.group = weight.device_mesh.get_group()
            self.world = torch.distributed.get_world_size(self.group)
            rank = torch.distributed.get_rank(self.group)
            per = -(-weight.shape[0] // self.world)  # torch.chunk's split, DTensor's Shard(0)
            self.start = min(rank * per, weight.shape[0])

    def max(self, x):
        if self.group is not None:
            torch.distributed.all_reduce(x, torch.distributed.ReduceOp.MAX, group=self.group)
        return x

    def sum(self, x):
        if self.group is not None:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_tokens(self, *tensors):
        """Every rank's tokens (rows of each tensor), rank by rank, each rank's padded with zeros to
        the largest count. Remembers where this rank's are (`own`) and the padded count, which
        scatter_tokens reads: a scatter undoes the gather before it. (A DTensor's local rows
        gathered this way are the whole tensor's first rows: torch.chunk's shards are all
        ceil(V / world) long but the last non-empty one, and the empty ones after it.)"""
        n = tensors[0].shape[0]
        if self.group is None:
            self.own = slice(0, n)
            return tensors
        counts = torch.tensor([n], device=tensors[0].device)
        n_max = int(self.max(counts.clone()))
        rank = torch.distributed.get_rank(self.group)
        self.own, self.n_max = slice(rank * n_max, rank * n_max + n), n_max
        out = []
        for t in tensors:
            padded = t.new_zeros((n_max, *t.shape[1:]))
            padded[:n] = t
            whole = t.new_empty((self.world * n_max, *t.shape[1:]))
            torch.distributed.all_gather_into_tensor(whole, padded, group=self.group)
            out.append(whole)
        return out

    def scatter_tokens(self, x):
        """x (every rank's tokens, as gather_tokens laid them out): summed over ranks, each rank
        keeping its own tokens' rows."""
        if self.group is None:
            return x
        out = x.new_empty((self.n_max, *x.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, x, group=self.group)
        return out[: self.own.stop - self.own.start]


def _chunk_losses(h, weight, bias, post, ids, logprobs, w, rows, need_grad):
    """For one chunk of n tokens: L_token(i) (n,) with z = post(W h + b), and, when need_grad,
    dL/dz_lin for sum_i w_i L_token(i) (z_lin = W h + b: this process's rows, the head's dtype).
    With log p_s = z - lse(z) and P_i = sum_k p_t,c_k (the teacher's top-K mass):

        dL_token(i)/dz_v = P_i softmax(z_i)_v - p_t,v [v in top-K]

    the student's softmax scaled to the mass the teacher put on the top-K, minus that mass where
    it lies. Softmax and lse in fp32; post's derivative by autograd (elementwise, local)."""
    R = weight.shape[0]
    z_lin = F.linear(h, weight, bias)  # (n, R): the logits of this process's rows
    with torch.set_grad_enabled(need_grad):
        z_lin = z_lin.detach().requires_grad_(need_grad)
        z_graph = post(z_lin).float()
    z = z_graph.detach()
    # log-sum-exp over the whole vocabulary: max and sum over the rows here, then over the ranks
    m = rows.max(z.amax(-1) if R else z.new_full(z.shape[:1], -torch.inf))
    e = torch.exp(z - m[:, None])
    lse = m + rows.sum(e.sum(-1)).log()
    # the student's logits at the teacher's top-K ids (global ids: rows [start, start + R) here)
    local = ids - rows.start
    here = (local >= 0) & (local < R)
    local = local.clamp(0, max(R - 1, 0))
    z_top = rows.sum(z.gather(-1, local) * here if R else z.new_zeros(ids.shape))
    p_t = logprobs.exp()
    losses = (p_t * (logprobs - (z_top - lse[:, None]))).sum(-1)  # L_token(i), eq. 12
    if not need_grad:
        return losses, None
    if not R:  # no rows here (more ranks than rows): nothing to differentiate
        return losses, z_lin.detach()
    dz = e.mul_((torch.exp(m - lse) * w * p_t.sum(-1))[:, None])  # w_i P_i softmax(z_i), in place
    dz.scatter_add_(-1, local, -(w[:, None] * p_t * here))  # - w_i p_t,v at the top-K ids
    (dz_lin,) = torch.autograd.grad(z_graph, z_lin, dz)  # through post: its derivative
    return losses, dz_lin


def _head_losses(h, weight, bias, post, ids, logprobs, w, chunk, rows, need=(False, False, False)):
    """L_token(i) for every token, z_i = post(W h_i + b), `chunk` tokens at a time (h: (n, d), W:
    (R, d), the rows `rows` says), and the gradients `need` asks for (of h, W, b) of
    sum_i w_i L_token(i), made chunk by chunk: dL/dh = dz W, dL/dW = sum dz^T h, dL/db = sum dz.
    Three matmuls, as the unfused head + loss has."""
    losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    # dL/dh in at least fp32: under FSDP's bf16 each rank's partial sum is exact before the
    # reduce-scatter adds them (a bf16 one rounds world times)
    dh = torch.zeros(h.shape, dtype=torch.promote_types(h.dtype, torch.float32),
                     device=h.device) if need[0] else None
    # accumulated in place, one R x d buffer (autograd summing per-chunk products would hold two),
    # in at least fp32: a bf16 sum over many chunks drifts; autograd rounds it to W's dtype once
    acc = torch.promote_types(weight.dtype, torch.float32)
    dW = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need[1] else None
    db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need[2] else None
    # the compute dtype: one GPU's autocast, or FSDP's bf16 (h's) for fp32 rows it does not manage;
    # cast once, not per chunk
    cast = (torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type)
            else h.dtype)
    weight, bias = weight.to(cast), bias.to(cast) if bias is not None else None
    for a in range(0, h.shape[0], chunk):
        sl = slice(a, a + chunk)
        losses[sl], dz = _chunk_losses(h[sl], weight, bias, post, ids[sl], logprobs[sl], w[sl], rows,
                                       any(need))
        if dh is not None:
            dh[sl] = (dz @ weight).to(dh.dtype)
        if dW is not None and dz.dtype == dW.dtype:  # fp32: in place, no R x d temporary
            dW.addmm_(dz.t(), h[sl].to(dz.dtype))
        elif dW is not None:  # bf16: the chunk's product in bf16 (half an R x d), summed in fp32
            dW += dz.t() @ h[sl].to(dz.dtype)
        if db is not None:
            db += dz.sum(0)
    return losses, dh, dW, db


class _HeadTokenLosses(torch.autograd.Function):
    """sum_i w_i L_token(i) over this process's tokens as an autograd node. The gradients are made
    in the forward (the loss is the graph's end, so dL/dz is known there up to the one scalar the
    backward brings) and nothing of size (n, V) is kept: the backward only scales them (Liger-
    Kernel's fused linear cross-entropy does the same for CE). No weight is saved either: under
    FSDP the head's unit may reshard. Vocabulary-parallel, every rank's tokens are computed here
    and each rank's dL/dW for its rows sums them all: over `world` ranks that is world x the mean
    gradient FSDP makes for every other weight, hence / world (and every rank must scale its loss
    alike: checked in the backward)."""

    @staticmethod
    def forward(ctx, h, weight, bias, post, ids, logprobs, w, chunk, rows):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        if rows.world > 1:  # dL/dh made on every rank: the reduce-scatter below is collective
            need = (True, *need[1:])
        H, IDS, LP, Wt = rows.gather_tokens(h, ids, logprobs, w)
        losses, dH, dW, db = _head_losses(H, weight, bias, post, IDS, LP, Wt, chunk, rows, need)
        ctx.rows = rows
        dh = rows.scatter_tokens(dH).to(h.dtype) if dH is not None else None
        ctx.grads = [dh if ctx.needs_input_grad[0] else None,
                     dW.div_(rows.world) if dW is not None else None,
                     db.div_(rows.world) if db is not None else None]
        return (w * losses[rows.own]).sum()

    @staticmethod
    def backward(ctx, g):
        if ctx.grads is None:
            raise RuntimeError("head_kd_loss supports one backward (its gradients were made in the "
                               "forward, and no graph is kept for a second or higher-order one)")
        grads, ctx.grads = ctx.grads, None
        if ctx.rows.world > 1:  # dW_r sums every rank's tokens: right only if all scale alike
            spread = ctx.rows.max(torch.stack([g, -g]).float())
            if spread[0] + spread[1] > 1e-6 * spread[0].abs():
                raise RuntimeError("vocabulary-parallel head_kd_loss: the ranks scaled their "
                                   "losses differently; scale by the same factor on every rank")
        # g: dObjective/dLoss, a scalar (1 / the micro-batch count...); in place, no copy
        scaled = [t.mul_(g.to(t.dtype)) if t is not None else None for t in grads]
        return (*scaled, None, None, None, None, None, None)


def head_kd_loss(hidden, weight, bias, topk_ids, topk_logprobs, entropy=None, mask=None,
                 post=None, vocab=None, chunk_tokens=256):
    """The top-K KD loss, a scalar: eq. 12 (entropy None: kd) or eq. 13 (entropy (B, T) = H_t: akd)
    of the student logits z = post(hidden W^T + b)[..., :vocab], which are never made whole.
    hidden (B, T, d); the head's weight (V, d) and bias (V) or None; topk_ids, topk_logprobs
    (B, T, K); mask (B, T) bool or None (False = padding: no loss, no gradient); post the model's
    logit transform (None: identity); vocab: the head's first rows only (a padded embedding's extra
    rows get no gradient). At most `chunk_tokens` x V logits exist at once: lower it when memory
    is tight, raise it for GPU throughput (each chunk reads W once). Logits given directly: pass
    them as `hidden` with an identity `weight`. W (and b) may be DTensors sharded by rows
    (parallel.vocab_parallel): then every rank must call this alike (with or without grad), and
    gets its own tokens' loss."""
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    ids = topk_ids.reshape(-1, topk_ids.shape[-1]).long()
    logprobs = topk_logprobs.reshape(ids.shape).float()
    w = torch.ones(ids.shape[0], device=h.device, dtype=torch.float32)
    if entropy is not None:  # akd: token i weighs H_t(i) (eq. 13); kd: every token weighs 1
        w = w * entropy.reshape(-1).float()
    if mask is not None:  # padding leaves first: no memory, no loss, no gradient
        keep = mask.reshape(-1).bool()
        h, ids, logprobs, w = h[keep], ids[keep], logprobs[keep], w[keep]
    rows = VocabShard(weight)
    if rows.group is not None:  # vocabulary-parallel: this rank's rows (autograd maps them back)
        weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
    if vocab is not None and vocab < rows.start + weight.shape[0]:
        top = max(vocab - rows.start, 0)
        weight, bias = weight[:top], bias[:top] if bias is not None else None
    w = w / max(h.shape[0], 1)  # 1/N over the valid tokens; none (all padding) gives 0
    post = post or (lambda z: z)
    chunk = chunk_tokens * rows.world  # every rank's tokens x V / world rows: chunk_tokens x V
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (h, weight, bias)):
        return _HeadTokenLosses.apply(h, weight, bias, post, ids, logprobs, w, chunk, rows)
    # no backward will follow (validation, a search's fitness): the loss alone
    H, IDS, LP, Wt = rows.gather_tokens(h, ids, logprobs, w)
    losses = _head_losses(H, weight, bias, post, IDS, LP, Wt, chunk, rows)[0]
    return (w * losses[rows.own]).sum()


def next_token_targets(input_ids, mask=None):
    """Cross-entropy as a top-1 KD target: c = the next token, log p_t,c = 0 (ids, log-probs, and
    which positions count: not the last, which has no next token, nor padding)."""
    ids = input_ids.roll(-1, dims=1)[..., None]
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    valid[:, -1] = False
    if mask is not None:
        valid &= mask.bool() & mask.bool().roll(-1, dims=1)
    return ids, torch.zeros(ids.shape, dtype=torch.float32, device=ids.device), valid
