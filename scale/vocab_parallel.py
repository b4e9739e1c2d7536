"""
The vocabulary-parallel embedding and LM head (Megatron-LM's layout, inside FSDP2's data
parallelism). FSDP2 gathers a unit whole to compute with it, and the largest unit is the V x d
embedding / head (Qwen3-32B: 152K x 5120, 3.1 GB in fp32): held gathered beside its gradient at the
end of every head forward, it is most of what a rank holds above its shards. Split by vocabulary rows
instead, rank r keeps rows [r c, (r + 1) c) of E and W for good (c = ceil(V / world); a DTensor
Shard(0), what DCP saves and reshards) and the ranks exchange tokens, not weights:

  lookup       every rank's ids gathered, each rank looks up those among its rows, the sum over
               ranks scattered back (each row lives on exactly one rank): tokens x d a call
  loss         fused_loss.head_kd_loss: each rank its rows' logits for every rank's tokens, the
               softmax's max and sum and the top-K logits all-reduced; its dL/dW whole for its rows
  plain head   model(x).logits (validation, importance, a teacher) gathers W as FSDP would
"""
import types

import torch
from torch import nn


class VocabShard:
    """Which rows of the head W this process computes, and how per-row results become whole-
    vocabulary ones. In one process: all V rows, and every reduction is the identity. Under FSDP
    with a vocabulary-parallel head (vocab_parallel below: W a DTensor sharded by rows), each
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

    def gather_async(self, x):
        """Every rank's x, stacked (world, *x.shape), its collective started and not waited for: the
        returned function waits and gives it (a GPU computes on meanwhile)."""
        if self.group is None:
            return lambda: x[None]
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        work = torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=self.group,
                                                        async_op=True)
        return lambda: (work.wait(), out.view(self.world, *x.shape))[1]

    def gather_tokens(self, *tensors, n_max=None):
        """Every rank's tokens (rows of each tensor), rank by rank, each rank's padded with zeros to
        n_max rows, the most any rank has. A caller that knows it passes it: a training micro-
        batch is one shape on every rank (prune.py; the fused loss keeps its masked tokens, at
        weight 0), W's rows are ceil(V / world) a shard. n_max None asks the ranks (a scalar all-
        reduce the host reads: a no-grad pass, such as a teacher's last, shorter batch). Remembers
        where this rank's are (`own`) and n_max, which scatter_tokens reads: a scatter undoes the
        gather before it. (A DTensor's local rows gathered this way are the whole tensor's first
        rows: torch.chunk's shards are all ceil(V / world) long but the last non-empty one, and the
        empty ones after it.)"""
        n = tensors[0].shape[0]
        if self.group is None:
            self.own = slice(0, n)
            return tensors
        if n_max is None:
            n_max = int(self.max(torch.tensor([n], device=tensors[0].device)))
        rank = torch.distributed.get_rank(self.group)
        self.own, self.n_max = slice(rank * n_max, rank * n_max + n), n_max
        out = []
        for t in tensors:
            padded = t.contiguous()
            if n < n_max:
                padded = torch.cat([padded, t.new_zeros((n_max - n, *t.shape[1:]))])
            whole = t.new_empty((self.world * n_max, *t.shape[1:]))
            torch.distributed.all_gather_into_tensor(whole, padded, group=self.group)
            out.append(whole)
        return out

    def local_rows(self, ids, R):
        """Global ids as indices into this rank's R rows (clamped into them, for a gather that
        needs no shape from the data) and which ids are here."""
        local = ids - self.start
        here = (local >= 0) & (local < R)
        return local.clamp(0, max(R - 1, 0)), here

    def scatter_tokens(self, x):
        """x (every rank's tokens, as gather_tokens laid them out): summed over ranks, each rank
        keeping its own tokens' rows."""
        if self.group is None:
            return x
        out = x.new_empty((self.n_max, *x.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, x, group=self.group)
        return out[: self.own.stop - self.own.start]


# the ids a lookup or a gather is given must be rows: `bad` the id, where the host has read it
TOKEN_IDS = "token id {bad}is outside the embedding's {rows} rows"


def assert_ids(ids, n, message):
    """Every id in [0, n), checked inside a micro-batch, where reading the ids back would stall the
    host: an assert queued with the device's kernels (a RuntimeError on a CPU, the device's assert
    on a GPU). prune.py checks once at the start that the tokenizer's ids fit the embedding, and a
    cache holds only that tokenizer's ids: this is the backstop."""
    torch._assert_async(((ids >= 0) & (ids < n)).all(), message)


def plain_lookup(embed):
    """An nn.Embedding whose backward needs the ids and dL/dx only, never the weight's values
    (F.embedding, or _LookupAddsRows below; max_norm would rewrite the weight in forward)."""
    return (isinstance(embed, nn.Embedding) and embed.max_norm is None and not embed.sparse
            and not embed.scale_grad_by_freq)


def add_rows(grad, ids, rows, scale=1.0):
    """grad[ids] += scale * rows, the rows of a repeated id summed in at least fp32. A grad of that
    precision takes them straight in. A bf16 one gets each distinct id's sum once, one rounding a
    row as the dense path has: the ids sorted, each id's rows summed at its first place, the other
    places adding exact zeros. No shape depends on the data (unique would): no host sync."""
    acc = torch.promote_types(rows.dtype, torch.float32)  # fp32, or fp64 when it is
    if torch.promote_types(grad.dtype, acc) == grad.dtype:
        grad.index_add_(0, ids, rows.to(grad.dtype), alpha=scale)
        return
    ids, order = ids.sort(stable=True)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    place = torch.arange(len(ids), device=ids.device)
    group = (place * first).cummax(0).values  # the first place of each one's id
    summed = torch.zeros(len(ids), rows.shape[1], dtype=acc, device=rows.device)
    summed.index_add_(0, group, rows[order].to(acc))
    grad.index_add_(0, ids, summed.mul_(scale).to(grad.dtype))


def _local_grad(weight):
    """The local rows of weight.grad (a DTensor), created as zeros if none yet, to add into."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad.to_local()


class _VocabParallelLookup(torch.autograd.Function):
    """x = E[ids] with E's rows split over the ranks and each rank its own ids (see above). The
    backward gathers every rank's dL/dx and adds the rows of its ids into its shard of E.grad, / world
    (FSDP's mean over ranks). E reaches the node in a tuple (`anchor` keeps it in the graph, as in
    _LookupAddsRows): its gradient is added in place, no dense (V / world) x d tensor a micro-batch."""

    @staticmethod
    def forward(ctx, anchor, holder, ids, padding_idx, dtype, n_max):
        weight = holder[0]
        shard, rows = VocabShard(weight), weight.to_local()
        (every,) = shard.gather_tokens(ids.reshape(-1), n_max=n_max)
        # every rank sees every id: all of them fail together, as nn.Embedding would in one process
        # (a missing row would otherwise look up as zeros)
        assert_ids(every, shard.V, TOKEN_IDS.format(bad="", rows=shard.V))
        local, here = shard.local_rows(every, rows.shape[0])
        x = (nn.functional.embedding(local, rows).masked_fill_(~here[:, None], 0) if rows.shape[0]
             else rows.new_zeros(len(every), rows.shape[1]))  # the rows held here, zeros for others
        # summed over ranks: each token's row, from the rank that has it (one non-zero addend: the
        # cast to the compute dtype first is exact, and halves the bytes in bf16)
        x = shard.scatter_tokens(x.to(dtype or x.dtype))
        ctx.save_for_backward(every)
        ctx.holder, ctx.padding_idx, ctx.shard = holder, padding_idx, shard
        return x.view(*ids.shape, -1)

    @staticmethod
    def backward(ctx, grad):
        (every,), weight, shard = ctx.saved_tensors, ctx.holder[0], ctx.shard
        # every rank's dL/dx, laid out as the forward's ids
        (rows,) = shard.gather_tokens(grad.reshape(-1, grad.shape[-1]), n_max=shard.n_max)
        R = weight.to_local().shape[0]
        local, here = shard.local_rows(every, R)
        if ctx.padding_idx is not None:  # nn.Embedding's rule: the padding row gets no gradient
            here &= every != ctx.padding_idx
        if R:  # the other ranks' rows add exact zeros
            add_rows(_local_grad(weight), local, rows.masked_fill(~here[:, None], 0), 1.0 / shard.world)
        return None, None, None, None, None, None


class _GatheredRowsLinear(torch.autograd.Function):
    """y = h W^T + b with W's rows split over the ranks, for a caller that wants the logits whole
    (validation, importance, a sharded teacher): W gathered for the forward and again for the
    backward, dL/dW reduce-scattered to its rows / world: what FSDP2 does for a unit."""

    @staticmethod
    def forward(ctx, h, rows, bias, shard, dtype):
        ctx.save_for_backward(h, rows, bias)
        ctx.shard, ctx.dtype, ctx.V = shard, dtype, shard.V
        W, b = _gather_rows(shard, ctx.V, rows, bias, dtype)
        return nn.functional.linear(h.to(W.dtype), W, b)

    @staticmethod
    def backward(ctx, g):
        h, rows, bias = ctx.saved_tensors
        shard = ctx.shard
        W, _ = _gather_rows(shard, ctx.V, rows, None, ctx.dtype)
        g2, h2 = g.reshape(-1, g.shape[-1]), h.reshape(-1, h.shape[-1])
        dh = (g2 @ W).view(h.shape).to(h.dtype) if ctx.needs_input_grad[0] else None
        dW = db = None  # (the flags are the same on every rank: the collectives below match)
        if ctx.needs_input_grad[1]:  # a frozen head (LoRA): no V x d gradient, no collective
            # every rank's dL/dW for all rows (its own tokens), padded to the gather's layout,
            # summed onto the rows' ranks
            dW = torch.zeros(shard.world * shard.n_max, W.shape[1], dtype=torch.float32,
                             device=g.device)
            dW[:ctx.V] = g2.float().t() @ h2.float()
            dW = shard.scatter_tokens(dW).div_(shard.world).to(rows.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = torch.zeros(shard.world * shard.n_max, dtype=torch.float32, device=g.device)
            db[:ctx.V] = g2.float().sum(0)
            db = shard.scatter_tokens(db).div_(shard.world).to(bias.dtype)
        return dh, dW, db, None, None


def _gather_rows(shard, V, rows, bias, dtype):
    """W (V, d) and b whole from every rank's rows (cast to `dtype` first: half the bytes in bf16)."""
    cast, per = dtype or rows.dtype, -(-V // shard.world)  # every shard padded to ceil(V / world)
    W = shard.gather_tokens(rows.to(cast), n_max=per)[0][:V]
    b = shard.gather_tokens(bias.to(cast), n_max=per)[0][:V] if bias is not None else None
    return W, b


def _shard_rows(param, mesh, device):
    """param (V, ...) as a Parameter holding this rank's rows only (a DTensor Shard(0): torch.chunk's
    split), copied to `device` so that the full tensor can be freed; on the meta device it stays."""
    from torch.distributed.tensor import DTensor, Shard
    rank, world = mesh.get_local_rank(), mesh.size()
    pieces = torch.chunk(param.detach(), world)  # fewer than world when V is tiny: empty shards
    local = pieces[rank] if rank < len(pieces) else param.detach()[:0]
    local = local if local.is_meta else local.to(device, copy=True)
    return nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                           shape=param.shape, stride=param.stride()),
                        requires_grad=param.requires_grad)


def vocab_parallel(model, device, dtype=None):
    """Split a plain nn.Embedding's and a plain nn.Linear LM head's weights by vocabulary rows over
    the ranks (tied: the one weight), and give them the forwards above; `dtype`: the compute dtype
    (FSDP's bf16 on GPU). Returns the modules done (their weights are for FSDP to ignore). A tied
    weight whose embedding is not a plain lookup (Gemma's scaled one) stays FSDP's."""
    from torch.distributed.device_mesh import init_device_mesh
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    lookup = plain_lookup(embed) and type(embed).forward is nn.Embedding.forward
    linear = isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
    if tied and not (lookup and linear):
        return []
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    done = []
    if lookup:
        embed.weight = _shard_rows(embed.weight, mesh, device)
        anchor = torch.zeros((), requires_grad=True)

        def lookup_forward(self, ids):  # a frozen E (LoRA): no backward node at all
            a = anchor if self.weight.requires_grad and torch.is_grad_enabled() else anchor.detach()
            # a training forward's ids are one shape on every rank (gather_tokens); others ask
            n_max = ids.numel() if torch.is_grad_enabled() else None
            return _VocabParallelLookup.apply(a, (self.weight,), ids, self.padding_idx, dtype, n_max)
        embed.forward = types.MethodType(lookup_forward, embed)
        done.append(embed)
    if linear:
        if tied:
            head.weight = embed.weight
        else:
            head.weight = _shard_rows(head.weight, mesh, device)
        if head.bias is not None:
            head.bias = _shard_rows(head.bias, mesh, device)

        def head_forward(self, h):
            if self.whole is not None and not torch.is_grad_enabled():  # gathered for a while
                return nn.functional.linear(h.to(self.whole[0].dtype), *self.whole)
            bias = self.bias.to_local() if self.bias is not None else None
            return _GatheredRowsLinear.apply(h, self.weight.to_local(), bias,
                                             VocabShard(self.weight), dtype)

        def gather_rows(gather=True):
            """W (and b) whole until gather_rows(False): for no-grad callers that run the head many
            times on one batch (importance's L skip runs, the teacher's chunks), one gather, not one
            a call; fused_loss.root_unsharded calls it as FSDP's unshard / reshard."""
            bias = head.bias.to_local() if head.bias is not None else None
            head.whole = (_gather_rows(VocabShard(head.weight), head.weight.shape[0],
                                       head.weight.to_local(), bias, dtype) if gather else None)
        head.forward = types.MethodType(head_forward, head)
        head.whole, head.gather_rows = None, gather_rows
        done.append(head)
    return done
