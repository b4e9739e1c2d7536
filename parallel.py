"""
Data parallelism with FSDP2, in one place (torchtitan's parallelize.py, gpt-fast's `apply_tp` idea):
prune.py calls these the same way in one process and under torchrun, and never asks which it is.

  distribute(model, device, rank, world)  one process: .to(device); torchrun: sharded from rank 0
  parallelize(model, device)              fully_shard each decoder layer, then the root
  vocab_parallel(model, device, dtype)    the embedding and the LM head split by vocabulary rows
  free_embedding_in_backward(model)       the embedding's weight is not gathered for its backward
  ChunkedAllGather, ChunkedReduceScatter  gloo's collectives in pieces (no whole-unit buffer)
  load_from_rank0(model, state, ...)      rank 0 read the checkpoint; every rank receives its shards
  drop_removed_layers(model)              after pruning: forget the removed layers' FSDP units
  reshard(model)                          every unit back to its shards (after a no-grad forward)
  compute_context(model, device)          bf16 autocast on one GPU (FSDP: its own mixed precision)
  clip_grad_norm(params, max_norm)        the global gradient norm (a DTensor under FSDP), a float
  mean_over_ranks(x), average_grad(p)     all-reduce for what lives outside FSDP (the scores S)
  full_state_dict(model)                  the whole fp32 state on rank 0's CPU (export); others {}
  tied_lookup_adds_rows(model)            a tied embedding's backward adds its rows into the grad
  head_not_gathered_in_backward(model)    the fused loss made W's gradient in the forward: no gather
(free_embedding_in_backward, tied_lookup_adds_rows, head_not_gathered_in_backward: for an embedding
or head that vocab_parallel could not take, and in one process.)
"""
import contextlib
import types

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
# FSDP2's interface for custom collectives (what FSDPModule.set_custom_all_gather/_reduce_scatter take)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from common import all_reduce_sum
from kd import VocabShard
from surgery import decoder_layers


def is_sharded(model):
    return hasattr(model, "set_requires_gradient_sync")  # what fully_shard adds to a module


def parallelize(model, device):
    """FSDP2 (torchtitan's layout): each decoder layer its own unit, then the root (the final norm
    and what is left); the input embedding and the LM head split by vocabulary rows outside FSDP
    (vocab_parallel), or, where they cannot be, their own units (one when tied: a shared weight
    must live in one). bf16 compute with fp32 master weights, fp32 gradient reduction on GPU; fp32
    on CPU. Small units bound what a rank holds whole at once: a layer while it computes; the V x d
    weights (at V = 152K: 2.5 GB in fp32) are never whole in training."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # Per-layer units let FSDP all-gather one layer while the previous one computes, and let the
    # pruned layers' units disappear from the module tree after the search (drop_removed_layers).
    mp = MixedPrecisionPolicy()  # CPU (gloo): fp32 throughout
    if device.type == "cuda":  # bf16 matmuls; gradients reduced in fp32 for the fp32 master weights
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    # the embedding and the LM head split by vocabulary rows (below), outside FSDP: never gathered
    # for training; what cannot be (a scaled embedding, say) is FSDP's unit as any other
    rows = vocab_parallel(model, device, mp.param_dtype)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    # tied, vocab_parallel takes both or neither
    units = [[embed, head]] if tied and not rows else [m for m in (embed, head)
                                                       if m is not None and m not in rows]
    for unit in units:
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp, ignored_params={p for m in rows for p in m.parameters()})
    free_embedding_in_backward(model)
    if torch.distributed.get_backend() == "gloo":  # CPU ranks: collectives in pieces (see below)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(ChunkedAllGather())
                m.set_custom_reduce_scatter(ChunkedReduceScatter())
    return model


def _plain_lookup(embed):
    """An nn.Embedding whose backward needs the ids and dL/dx only, never the weight's values
    (F.embedding, or _LookupAddsRows below; max_norm would rewrite the weight in forward)."""
    return (isinstance(embed, nn.Embedding) and embed.max_norm is None and not embed.sparse
            and not embed.scale_grad_by_freq)


class _AfterBackward(torch.autograd.Function):
    """Identity on x; `callback()` runs once dL/dx is computed, i.e. after the backward of the
    module x enters (its weights' gradients are accumulated first: autograd runs AccumulateGrad
    nodes before others, the order FSDP2's own post-backward hook relies on)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


def free_embedding_in_backward(model):
    """The input embedding's V x d weight is not needed by its own backward (dL/dE adds dL/dx at
    the ids' rows), but FSDP2 gathers a unit whole for the backward of each module in it:
    - untied: the embedding's unit is not gathered again in backward (`set_unshard_in_backward`,
      FSDP2's switch for this case): one V x d weight less at the end of every backward;
    - tied (one unit, since E is also the LM head): the unit is resharded as soon as the head's
      backward has accumulated its gradient, not after the lookup's at the very end: E is not held
      gathered through the backward of every layer. Its gradient stays until the unit's
      reduce-scatter, which now follows the lookup's backward."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not _plain_lookup(embed) or not isinstance(embed, FSDPModule):
        return
    if head is None or head.weight is not embed.weight:
        embed.set_unshard_in_backward(False)
        return

    def wrap_input(module, args):
        if not args or not torch.is_grad_enabled():  # no backward to come (or called by keyword)
            return None
        return (_AfterBackward.apply(args[0], head.reshard), *args[1:])
    head.register_forward_pre_hook(wrap_input)


def head_not_gathered_in_backward(model):
    """For a model trained only through surgery.head_losses (prune.py): the fused head + loss
    (kd.head_kd_loss) makes the LM head's weight gradient in its forward and saves no weight, so
    the backward never reads W. FSDP2 would gather the head's unit again for it: a V x d
    all-gather a micro-batch (1.5 GB in bf16 for Qwen3-32B's head), held beside the gradient.
    Tied, the unit is the embedding's too, whose backward needs no W either (free_embedding_in_
    backward). A plain backward through model(x).logits would then fail: not for other callers.
    (A vocabulary-parallel head, vocab_parallel, is no FSDP unit: nothing to switch.)"""
    head = model.get_output_embeddings()
    if isinstance(head, FSDPModule):
        head.set_unshard_in_backward(False)
    return model


# CPU ranks (gloo): gloo's all-gather and reduce-scatter copy the whole tensor through a buffer of
# their own, so FSDP2's collective on a unit costs two copies of it instead of one (measured with a
# 49K x 768 fp32 unit, 144 MB: a reduce-scatter peaks 146 MB above its input and output, an
# all-gather 144 MB above its output). Done in pieces of GLOO_CHUNK_BYTES, the same sums land in
# the same places and the extra is one piece. NCCL works in place: GPUs keep FSDP2's own.
GLOO_CHUNK_BYTES = 16 << 20


def _pieces(shard_numel, world, element_size):
    step = max(1, GLOO_CHUNK_BYTES // (world * element_size))
    return [(a, min(a + step, shard_numel)) for a in range(0, shard_numel, step)]


class _Allocate:
    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class ChunkedAllGather(_Allocate, AllGather):
    """output (world x shard, flat) = every rank's input (shard), one column block at a time."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        world = torch.distributed.get_world_size(group)
        out = output_tensor.view(world, -1)
        for a, b in _pieces(input_tensor.numel(), world, input_tensor.element_size()):
            piece = torch.empty(world * (b - a), dtype=out.dtype, device=out.device)
            torch.distributed.all_gather_into_tensor(piece, input_tensor[a:b], group=group)
            out[:, a:b].copy_(piece.view(world, -1))
        return None


class ChunkedReduceScatter(_Allocate, ReduceScatter):
    """output (shard) = op over ranks of this rank's block of input (world x shard, flat), one
    column block at a time."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        world = torch.distributed.get_world_size(group)
        inp = input_tensor.view(world, -1)
        for a, b in _pieces(output_tensor.numel(), world, input_tensor.element_size()):
            torch.distributed.reduce_scatter_tensor(output_tensor[a:b], inp[:, a:b].reshape(-1),
                                                    op=op, group=group)
        return None


def load_from_rank0(model, full_state, rank, device):
    """Give every rank its shards of rank 0's weights: the other ranks built the model on the meta
    device, so the host holds one full copy of the checkpoint instead of one per rank (8 x 27 GB for
    a 7B model in fp32 under the headline command). Buffers (e.g. rotary inv_freq) are not sharded
    and, when not persistent, not in the state dict: they are broadcast whole."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    if rank > 0:
        # real (uninitialised) shards and buffers; FSDP keeps ties tied
        model.to_empty(device=device)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():  # the same order on every rank
        torch.distributed.broadcast(buf, src=0)


def distribute(model, device, rank, world):
    """The model as this process trains it: on `device` in one process; under torchrun sharded with
    FSDP2, rank 0 holding the weights it read (the other ranks built `model` on the meta device)."""
    if world == 1:
        return model.to(device)
    # the full tensors, taken before parallelize() splits them into shards
    full_state = model.state_dict() if rank == 0 else {}
    load_from_rank0(parallelize(model, device), full_state, rank, device)
    return model


def drop_removed_layers(model):
    """After remove_layers under FSDP2: the root unit listed every layer's unit when it first ran
    (lazy init) and would keep the removed ones alive (their shards, ~1.9 GB a rank for Llama-2-7B
    at 60%) and run their post-backward hooks every step. Keep only the units still in the module
    tree. (FSDP2 has no public call for this; the list is `_state_ctx.all_states` of the root
    state.)"""
    if not is_sharded(model):
        return
    state = model._get_fsdp_state()
    alive = set(model.modules())
    state._state_ctx.all_states = [s for s in state._state_ctx.all_states
                                   if all(m in alive for m in s._modules)]


def reshard(model):
    """Put every FSDP unit back to its shards. FSDP2 leaves the root unit (the final norm; the
    embeddings and LM head where they are FSDP's) gathered after a forward until the backward that follows; after a no-grad forward (validation,
    importance) no backward follows, and the module then holds the full tensors: an optimizer built
    from model.parameters() at that moment would hold those instead of the shards and never train
    the root. A no-op in one process."""
    for m in model.modules() if is_sharded(model) else []:
        if isinstance(m, FSDPModule):
            m.reshard()


def compute_context(model, device):
    """bf16 autocast on a single GPU; FSDP's mixed-precision policy casts by itself; fp32 on CPU."""
    if device.type == "cuda" and not is_sharded(model):
        return torch.autocast("cuda", torch.bfloat16)
    return contextlib.nullcontext()


def clip_grad_norm(params, max_norm):
    """Clip to max_norm by the global norm over all ranks' shards; returns it as a float."""
    norm = nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP: the norm of the whole, not of a shard
        norm = norm.full_tensor()
    return norm.item()


def mean_over_ranks(x):
    """The mean of a tensor over ranks (every rank must call it); itself in one process."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return all_reduce_sum(x) / world


def average_grad(param):
    """Average a gradient over ranks by hand, for a parameter that lives outside FSDP (the scores S:
    every rank holds all L of them, and each rank's gradient comes from its own micro-batches)."""
    if param.grad is None:  # the mask did not depend on it this step (k'_t = the protected layers)
        param.grad = torch.zeros_like(param)
    param.grad.copy_(mean_over_ranks(param.grad))


def full_state_dict(model):
    """The whole state dict, gathered onto rank 0's CPU in fp32 (every rank must call it; the others
    get {}). Tensors are gathered one at a time, so rank 0 never holds more than one full copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {k: v.cpu() for k, v in state.items()}


# -----------------------------------------------------------------------------
# Memory of a tied embedding / LM head (one V x d weight E used twice: x = E[ids], logits = h E^T)

class _LookupAddsRows(torch.autograd.Function):
    """x = E[ids], whose backward adds the batch's rows of dL/dx straight into E.grad. Plain
    autograd returns a dense V x d gradient (zero but for the batch's rows) and, as E is also the
    head, E's accumulation waits for both uses: the head's V x d gradient is held through the whole
    backward, then summed out of place with the lookup's: three V x d fp32 tensors a micro-batch
    (3 x 151 MB for SmolLM2's 49K x 768; 3 x 1.2 GB for Qwen2.5-3B's 152K x 2048). Here E is no
    autograd input of the lookup (it reaches backward in a tuple; `anchor`, a scalar that requires
    grad, keeps the node in the graph), so the head's gradient lands in E.grad at once and the rows
    are added to it in place at the end. dL/dE is the same sum."""

    @staticmethod
    def forward(ctx, anchor, holder, ids, padding_idx):
        ctx.save_for_backward(ids)
        ctx.holder, ctx.padding_idx = holder, padding_idx
        return nn.functional.embedding(ids, holder[0], padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,), weight = ctx.saved_tensors, ctx.holder[0]
        ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding's rule: the padding row gets no gradient
            rows = rows.masked_fill((ids == ctx.padding_idx)[:, None], 0)
        if weight.grad is None:  # the head's gradient comes first (backward order), unless frozen
            weight.grad = torch.zeros_like(weight)
        # the weight FSDP2 computes with (gathered): its post-backward reduce-scatters this .grad
        _add_rows(weight.grad, ids, rows)
        return None, None, None, None


def tied_lookup_adds_rows(model):
    """When the input embedding and the LM head share one trainable weight, and the embedding is a
    plain nn.Embedding (scaled or normed embeddings keep their own forward), its lookup becomes
    _LookupAddsRows: two fewer V x d gradients per micro-batch. Training-only; the exported
    weights are the same tensors."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (head is None or head.weight is not embed.weight or not embed.weight.requires_grad
            or type(embed).forward is not nn.Embedding.forward or embed.max_norm is not None
            or embed.sparse):
        return model

    anchor = torch.zeros((), requires_grad=True)

    def forward(self, ids):  # self.weight: under FSDP2 the gathered weight while it computes
        return _LookupAddsRows.apply(anchor, (self.weight,), ids, self.padding_idx)
    embed.forward = types.MethodType(forward, embed)
    return model


# -----------------------------------------------------------------------------
# The vocabulary-parallel embedding and LM head (Megatron-LM's layout, inside FSDP2's data parallelism)
#
# FSDP2 gathers a unit whole to compute with it, and the largest unit is the V x d embedding / head
# (Qwen3-32B: 152K x 5120, 3.1 GB fp32; SmolLM2: a third of all weights): held gathered beside its
# gradient at the end of every head forward, it is most of what a rank holds above its shards. Split
# by vocabulary rows instead, rank r keeps rows [r c, (r + 1) c) of E and W for good (c = ceil(V / world))
# (a DTensor Shard(0), what DCP saves and reshards) and the ranks exchange tokens, not weights:
#   lookup:      every rank's ids gathered, each rank looks up those among its rows, the sum over
#                ranks scattered back (each row lives on exactly one rank): tokens x d a call;
#   loss:        kd.head_kd_loss: each rank its rows' logits for every rank's tokens, softmax's max
#                and sum and the top-K logits all-reduced; its dL/dW whole for its rows;
#   plain head:  model(x).logits (validation, importance, a teacher) gathers W as FSDP would.

def _add_rows(grad, ids, rows, scale=1.0):
    """grad[ids] += scale * rows, each distinct row summed in (at least) fp32 first and added once:
    one rounding per row in bf16, as the dense path has (and no racing duplicate indices on a GPU)."""
    uniq, inverse = ids.unique(return_inverse=True)
    acc = torch.promote_types(rows.dtype, torch.float32)  # fp32, or fp64 when it is
    summed = torch.zeros(len(uniq), rows.shape[1], dtype=acc, device=rows.device)
    summed.index_add_(0, inverse, rows.to(acc))
    grad.index_add_(0, uniq, summed.mul_(scale).to(grad.dtype))


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
    def forward(ctx, anchor, holder, ids, padding_idx, dtype):
        weight = holder[0]
        shard, rows = VocabShard(weight), weight.to_local()
        (every,) = shard.gather_tokens(ids.reshape(-1))
        local = every - shard.start
        here = (local >= 0) & (local < rows.shape[0])
        x = rows.new_zeros(len(every), rows.shape[1])
        x[here] = rows[local[here]]
        # summed over ranks: each token's row, from the rank that has it (one non-zero addend: the
        # cast to the compute dtype first is exact, and halves the bytes in bf16)
        x = shard.scatter_tokens(x.to(dtype or x.dtype))
        ctx.save_for_backward(every)
        ctx.holder, ctx.padding_idx, ctx.shard = holder, padding_idx, shard
        return x.view(*ids.shape, -1)

    @staticmethod
    def backward(ctx, grad):
        (every,), weight, shard = ctx.saved_tensors, ctx.holder[0], ctx.shard
        (rows,) = shard.gather_tokens(grad.reshape(-1, grad.shape[-1]))  # every rank's dL/dx
        local = every - shard.start
        here = (local >= 0) & (local < weight.to_local().shape[0])
        if ctx.padding_idx is not None:  # nn.Embedding's rule: the padding row gets no gradient
            here &= every != ctx.padding_idx
        _add_rows(_local_grad(weight), local[here], rows[here], 1.0 / shard.world)
        return None, None, None, None, None


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
    cast = dtype or rows.dtype
    W = shard.gather_tokens(rows.to(cast))[0][:V]
    b = shard.gather_tokens(bias.to(cast))[0][:V] if bias is not None else None
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
    lookup = _plain_lookup(embed) and type(embed).forward is nn.Embedding.forward
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
            return _VocabParallelLookup.apply(a, (self.weight,), ids, self.padding_idx, dtype)
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
            a call; surgery.root_unsharded calls it as FSDP's unshard / reshard."""
            bias = head.bias.to_local() if head.bias is not None else None
            head.whole = (_gather_rows(VocabShard(head.weight), head.weight.shape[0],
                                       head.weight.to_local(), bias, dtype) if gather else None)
        head.forward = types.MethodType(head_forward, head)
        head.whole, head.gather_rows = None, gather_rows
        done.append(head)
    return done
