"""
FSDP2 data parallelism (torchtitan's parallelize.py, gpt-fast's one-call style): prune.py calls
`parallelize(model, device)` once, in build_student, and its training step never asks about FSDP.

Its plain form is two lines, `fully_shard` on every decoder layer, then on the root; the rest of this
file is what keeps the memory of a rank down (each measured: docs/scale.md):

  load from rank 0          only rank 0 reads the weights; the others build the model on the meta
                            device and receive their shards (1 fp32 copy on the host, not 8)
  vocab_parallel            the V x d embedding and LM head split by vocabulary rows, never gathered
                            in training (vocab_parallel.py)
  reshard after no-grad     FSDP2 leaves the root gathered after a forward until a backward; after a
                            no-grad one (validation, importance) none comes
  free_embedding_in_backward, head_not_gathered_in_backward, tied_lookup_adds_rows
                            for an embedding / head that vocab_parallel could not take (a scaled
                            embedding), and the tied one in one process: no V x d weight or
                            gradient held where its values are not needed
  ChunkedAllGather, ChunkedReduceScatter
                            gloo's collectives in 16 MB pieces (CPU ranks): no whole-unit buffer
  release_freed_memory      glibc's mmap threshold fixed at 64 KB on a CPU: freed tensors go back
  drop_removed_layers       after the cut, the root forgets the removed layers' units
  replace_layer             a layer's unit rebuilt (the expert cut): gathered, cut, sharded again
  full_state_dict           the whole fp32 state gathered onto rank 0's CPU a tensor at a time
  apply_activation_checkpointing
                            every decoder layer's activations recomputed in the backward, whole
                            ("full") or all but its matmuls and attention ("selective")
  meta_model                prune.py --plan RANKS: the model built from config.json alone, no memory

In one process (prune.py --logit-chunk), parallelize applies only tied_lookup_adds_rows (and, on a
CPU, release_freed_memory, as prune.py does for every scale-wing run there).
"""
import ctypes
import functools
import math
import types

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
# FSDP2's interface for custom collectives (FSDPModule.set_custom_all_gather/_reduce_scatter)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache

from runtime import E3Error
from scale.vocab_parallel import add_rows, plain_lookup, vocab_parallel
from surgery import decoder_layers


def parallelize(model, device, fused_loss=False, train=True):
    """The model as this rank computes with it. Under torchrun: FSDP2 (each decoder layer its own
    unit, then the root), the embedding and LM head split by vocabulary rows outside FSDP (or their
    own units where they cannot be: one when tied), bf16 compute with fp32 master weights and fp32
    gradient reduction on a GPU, fp32 on a CPU; rank 0's weights sent as shards. fused_loss: the
    model is trained only through scale/fused_loss.py, whose head makes W's gradient in its forward
    (no gather of W for the backward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if train:
        tied_lookup_adds_rows(model)
    if device.type == "cpu":
        release_freed_memory()
    if not torch.distributed.is_initialized():
        return model.to(device)
    rank = torch.distributed.get_rank()
    full_state = model.state_dict() if rank == 0 else {}  # the full tensors, before the shards
    mp = MixedPrecisionPolicy()  # CPU (gloo): fp32 throughout
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    for layer in layers:
        # torchtitan's choice: the last layer's backward is the first to run, right after the
        # forward (and the head's loss): kept gathered, not all-gathered again at once
        fully_shard(layer, mp_policy=mp, reshard_after_forward=layer is not layers[-1])
    rows = vocab_parallel(model, device, mp.param_dtype)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    units = [[embed, head]] if tied and not rows else [m for m in (embed, head)
                                                       if m is not None and m not in rows]
    for unit in units:
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False,  # as for the last layer
                ignored_params={p for m in rows for p in m.parameters()})
    free_embedding_in_backward(model)
    if fused_loss:
        head_not_gathered_in_backward(model)
    if torch.distributed.get_backend() == "gloo":  # CPU ranks: collectives in pieces (below)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(ChunkedAllGather())
                m.set_custom_reduce_scatter(ChunkedReduceScatter())
    load_from_rank0(model, full_state, rank, device)
    model.register_forward_hook(reshard_after_no_grad)
    return model


def apply_activation_checkpointing(model, mode, layers=None):
    """Recompute each decoder layer's activations in its backward instead of keeping them: "full"
    keeps a layer's input alone; "selective" keeps the outputs of its matmuls and attention too, and
    recomputes only the cheap elementwise ops between them (norms, RoPE, SiLU, the residual adds:
    torchtitan's op-level SAC): nearly the FLOPs of no checkpointing, for part of its memory.

    The checkpoint wraps each layer's own `forward` (an instance attribute: the module, its names and
    its hooks stay), as torchtitan wraps a block before compiling it: a compiled layer
    (scale/compile.py, applied after) compiles the checkpoint with it, compile(checkpoint(f)), and the
    compiler's partitioner applies the selective policy. The other order, a checkpoint around a
    compiled layer (transformers' own switch did that up to 5.17, wrapping the layer's __call__),
    fails under selective with inductor ("Tensor cached during selective activation checkpoint has been
    mutated"). Forward hooks (FSDP2's gather, the search's gates) run outside the checkpoint, once:
    FSDP2's pre-backward gather serves the recomputation, and during the search each gate keeps its
    layer's output for d out / d m (one residual-stream tensor a layer more than the checkpoint's
    input). Call it before compile and parallelize. layers: these alone (default: every decoder layer)."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing is 'full' or 'selective', not {mode!r}")
    # full: checkpoint's own default context (dynamo cannot trace its noop_context_fn handed in)
    context = {"context_fn": _save_matmuls} if mode == "selective" else {}
    for layer in decoder_layers(model) if layers is None else layers:
        # a partial of the bound forward: copy.deepcopy of the model rebinds it to the copy's layer
        layer.forward = functools.partial(_checkpointed, layer.forward, context)
    return model


def _checkpointed(forward, context, *args, **kwargs):
    """One layer's forward under torch.utils.checkpoint (non-reentrant); a forward with no backward to
    come (validation, importance, no_grad) runs plain."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # no KV cache (whatever its keyword's name): the recomputation would append to it a second time
    kwargs = {k: None if isinstance(v, Cache) or k == "layer_past" else False if k == "use_cache" else v
              for k, v in kwargs.items()}
    return checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)


def saved_ops():
    """The ops whose outputs a selective checkpoint keeps: the compute-bound ones (matmuls,
    attention: functorch's compute-intensive list, and SDPA's CPU and cuDNN kernels)."""
    from torch._functorch.partitioners import get_default_op_list
    aten = torch.ops.aten
    return {*get_default_op_list().compute_intensive_ops, aten.linear,
            aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_cudnn_attention}


def _save_matmuls():
    """The contexts of one selective checkpoint: saved_ops()'s outputs saved, every other op's
    recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    saved = saved_ops()

    def policy(ctx, func, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if func.overloadpacket in saved
                else CheckpointPolicy.PREFER_RECOMPUTE)
    return create_selective_checkpoint_contexts(policy)


def release_freed_memory():
    """On a CPU the host is the device: glibc keeps freed blocks smaller than its mmap threshold in
    its heap, and raises that threshold (up to 32 MB) whenever a larger block is freed, so after the
    first steps every tensor of a step is heap memory, held once freed. Fixed at 64 KB, a freed
    tensor goes back to the OS (a 2-rank CPU run of an 88M model: 1.35 GB a rank instead of 1.98),
    for the price of an mmap, a munmap and fresh pages for every tensor above it: a CPU step takes
    about twice as long (the demo: 160 against 310 tok/s), which is why the plain one-process path
    leaves glibc's default. Not glibc: nothing to set."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def reshard_after_no_grad(model, args, output):
    """FSDP2 keeps the root unit (the final norm; the embedding and head where they are FSDP's)
    gathered after a forward for the backward that follows. After a no-grad forward none follows:
    put every unit back to its shards, or the gathered tensors stay (and an optimizer built then
    would hold them instead of the shards)."""
    if not torch.is_grad_enabled():
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


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
    if not plain_lookup(embed) or not isinstance(embed, FSDPModule):
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
    """For a model trained only through the fused head + loss (fused_loss.py) makes the LM head's weight gradient in its forward and saves no weight, so
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


def drop_removed_layers(model):
    """After remove_layers under FSDP2: the root unit listed every layer's unit when it first ran
    (lazy init) and would keep the removed ones alive (their shards, ~1.9 GB a rank for Llama-2-7B
    at 60%) and run their post-backward hooks every step. Keep only the units still in the module
    tree. (FSDP2 has no public call for this; the list is `_state_ctx.all_states` of the root
    state.)"""
    if not isinstance(model, FSDPModule):
        return
    state = model._get_fsdp_state()
    alive = set(model.modules())
    state._state_ctx.all_states = [s for s in state._state_ctx.all_states
                                   if all(m in alive for m in s._modules)]


def replace_layer(model, i, layer, rows, moments=None):
    """Decoder layer i, an FSDP2 unit, replaced by `layer` (built on the meta device as parallelize
    prepared the old one: LoRA, checkpointing, compile), sharded as the old one was (its mesh, mixed
    precision, reshard after forward, gloo's chunked collectives), never a whole tensor on a rank:
    rows(name) is (dim, index) for a tensor whose rows `index` of dim stay (an expert cut), else None;
    each new shard is made from the old shards (_moved: the kept rows sent where the new sharding
    places them), the optimizer's state `moments` of the old parameters moved to the new ones the
    same way. The root lists its units when it first runs (FSDP2's lazy init, private to torch):
    reset here, so that the next forward lists the new unit and forgets the old."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from surgery import layers_owner
    owner, attr = layers_owner(model)
    old = getattr(owner, attr)[i]
    state = old._get_fsdp_state()
    group = state._fsdp_param_group
    fully_shard(layer, mesh=group.mesh_info.mesh, mp_policy=state._mp_policy,
                reshard_after_forward=group.post_forward_mesh_info is not None)
    if torch.distributed.get_backend() == "gloo":
        layer.set_custom_all_gather(ChunkedAllGather())
        layer.set_custom_reduce_scatter(ChunkedReduceScatter())
    layer.to_empty(device=group.device)
    params, buffers = dict(old.named_parameters()), dict(old.named_buffers())
    with torch.no_grad():
        for name, p in layer.named_parameters():
            src, cut = params[name], rows(name)
            if p.dtype != src.dtype:
                raise E3Error(f"{name}: the rebuilt layer holds {p.dtype}, the model {src.dtype}")
            p.to_local().copy_(_moved(src, cut, p))
            p.requires_grad_(src.requires_grad)
            state_of = moments.pop(src, None) if moments is not None else None
            if state_of is not None:
                moments[p] = {k: DTensor.from_local(_moved(v, cut, p), p.device_mesh, p.placements,
                                                    run_check=False, shape=p.shape, stride=p.stride())
                              if torch.is_tensor(v) and v.shape == src.shape else v
                              for k, v in state_of.items()}
        for name, b in layer.named_buffers():
            cut = rows(name)
            b.copy_(buffers[name] if cut is None else buffers[name].index_select(cut[0], cut[1].to(b.device)))
    getattr(owner, attr)[i] = layer
    if layer.training != old.training:
        layer.train(old.training)
    if torch.cuda.is_available():  # no collective of the old units in flight when the root forgets them
        torch.cuda.synchronize()
    for m in model.modules():  # the next forward's root lazy init lists every unit again
        if isinstance(m, FSDPModule):
            m._get_fsdp_state()._is_root = None
    model._get_fsdp_state()._state_ctx.all_states = []


def _moved(x, cut, like):
    """This rank's shard of `like` (a sharded parameter) from x (the old parameter's or a moment's
    shard, DTensor): as it is (cut None), or its rows cut[1] of dim cut[0] stay. Sharded by rows
    (Shard(0), FSDP2's) a rank r holds rows [r c, (r + 1) c), c = ceil(rows / ranks): each rank sends
    the kept rows it holds to the rank that holds them after (all_to_all), a shard in, a shard out.
    A tensor cut on another dim (a [1, E] score correction) is small: gathered and cut. The rows
    kept in increasing order (the received ones arrive by source rank)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    if cut is None:
        return x.to_local()
    dim, index = cut
    assert index.tolist() == sorted(set(index.tolist())), "the kept rows, increasing"
    if dim != 0 or x.placements != (Shard(0),):
        full = x.full_tensor().index_select(dim, index.to(x.device))
        return distribute_tensor(full, like.device_mesh, like.placements).to_local()
    mesh = x.device_mesh  # FSDP2's one-dimensional mesh: its ranks and group, not the world's
    r, R, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    c, n = -(-x.shape[0] // R), -(-len(index) // R)  # rows a rank holds, before and after
    kept = index.tolist()
    send = [[k - r * c for j, k in enumerate(kept) if k // c == r and j // n == s] for s in range(R)]
    recv = [sum(1 for j, k in enumerate(kept) if k // c == q and j // n == r) for q in range(R)]
    local, row = x.to_local(), math.prod(x.shape[1:])
    out = local.new_empty(sum(recv), *x.shape[1:])
    taken = local[torch.tensor(sum(send, []), dtype=torch.long, device=local.device)].contiguous()
    torch.distributed.all_to_all_single(out.view(-1), taken.view(-1), [q * row for q in recv],
                                        [len(s) * row for s in send], group=group)
    return out


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
        add_rows(weight.grad, ids, rows)
        return None, None, None, None


def tied_lookup_adds_rows(model):
    """When the input embedding and the LM head share one trainable weight, and the embedding is a
    plain nn.Embedding (scaled or normed embeddings keep their own forward), its lookup becomes
    _LookupAddsRows: two fewer V x d gradients per micro-batch. Training-only; the exported
    weights are the same tensors."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if (head is None or head.weight is not embed.weight or not embed.weight.requires_grad
            or type(embed).forward is not nn.Embedding.forward or not plain_lookup(embed)):
        return model

    anchor = torch.zeros((), requires_grad=True)

    def forward(self, ids):  # self.weight: under FSDP2 the gathered weight while it computes
        return _LookupAddsRows.apply(anchor, (self.weight,), ids, self.padding_idx)
    embed.forward = types.MethodType(forward, embed)
    return model


def meta_model(args):
    """For prune.py --plan: the model (LoRA added as asked) on the meta device, shapes only (no
    weights, no tokenizer), and the bytes a token of the teacher cache it would build."""
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # transformers' own
        raise E3Error(f"transformers cannot build the model of {args.model}'s config.json "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    if args.lora_rank:
        from scale.lora import add_lora
        add_lora(model, args.lora_rank, args.lora_alpha, args.seed)
    vocab = model.config.get_text_config().vocab_size
    # a cache token: 1 + K ids (uint16 or int32), K fp16 log-probs, one fp32 entropy; sampled: 1 + N
    # ids and the entropy; hybrid: 1 + K + N ids, K log-probs; --assistant-only: one byte more
    K = 0 if args.targets == "sampled" else args.topk
    N = 0 if args.targets == "topk" else args.samples
    per_token = (2 if vocab <= 65536 else 4) * (1 + K + N) + 2 * K + 4
    return model, per_token + bool(args.assistant_only)
