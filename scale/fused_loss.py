"""
The LM head fused with the loss, chunk by chunk over tokens: no (B, T, V) logits in the forward or
the backward (Qwen's V = 152K at 4096 tokens is 2.5 GB a copy in fp32). prune.py uses it under
torchrun, or with --logit-chunk N; FusedLoss checks at its first call of each loss that it computes
what kd.py's plain function does, and refuses a loss it does not implement.

The losses are kd.py's eq. 12 / eq. 13 and next-token CE (top-1 KD against a one-hot teacher), of the
student logits z = post(W h + b), post the family's logit transform (architectures/logits.py).
dL/dz is written out and turned at once into dL/dh and dL/dW, chunk by chunk (three matmuls, as the
unfused head and loss have); the backward only scales them by the scalar it brings (Liger-Kernel's
fused linear cross-entropy does the same for CE). Under FSDP the head may be vocabulary-parallel (W's
rows split over the ranks, vocab_parallel.VocabShard): the same sums, the softmax's max and sum and
the top-K logits all-reduced.
"""
import collections
import contextlib
import types

import torch
import torch.nn.functional as F

import kd
from baselines.targets import rest_mass
from architectures.logits import logit_transform, model_logits
from runtime import E3Error, all_gather
from scale.vocab_parallel import VocabShard, assert_ids
from surgery import decoder_layers, hidden_out

def _chunk_logits(h, weight, bias, post, ids, rows, need_grad):
    """A chunk's first half, on this process's R rows alone: z = post(W h + b) (the graph through
    post kept when need_grad), and the two numbers a token that need every rank's rows, sent to
    every rank in one collective, started and not waited for: the log-sum-exp over the rows here,
    and the logits at the teacher's top-K ids held here (0 at the others)."""
    R = weight.shape[0]
    z_lin = F.linear(h, weight, bias)  # (n, R): the logits of this process's rows
    with torch.set_grad_enabled(need_grad):
        z_lin = z_lin.detach().requires_grad_(need_grad)
        z_graph = post(z_lin).float()
    z = z_graph.detach()
    local, here = rows.local_rows(ids, R)
    lse = z.logsumexp(-1) if R else z.new_full(z.shape[:1], -torch.inf)
    z_top = z.gather(-1, local) * here if R else z.new_zeros(ids.shape)
    stats = rows.gather_async(torch.cat([lse[:, None], z_top], -1))
    return types.SimpleNamespace(z_lin=z_lin, z_graph=z_graph, z=z, local=local, here=here,
                                 stats=stats)


def _chunk_losses(c, logprobs, w, need_grad, tail=False):
    """A chunk's second half, once every rank's numbers have come (c: _chunk_logits'): L_token(i)
    (n,) and, when need_grad, dL/dz_lin for sum_i w_i L_token(i) (z_lin = W h + b: this process's
    rows, the head's dtype). The whole vocabulary's log-sum-exp is that of the ranks' (each rank's
    over its rows, with its own max: exact in fp32), the top-K logits the ranks' sum (one non-zero
    addend each). With log p_s = z - lse(z), s = softmax(z) and P_i = sum_k p_t,c_k (the teacher's
    top-K mass):

        dL_token(i)/dz_v = P_i s_v - p_t,v [v in top-K]

    the student's softmax scaled to the mass the teacher put on the top-K, minus that mass where
    it lies. Sampled targets are the same sum with p_t the draws' shares (log 0 = -inf on unused
    slots: 0 log 0 = 0), hybrid ones the top-K's and then the rest's draws at r_t times theirs.
    tail: K + 1 classes, + r_t (log r_t - log r_s) with the teacher's rest r_t = 1 - P_i and the
    student's r_s = 1 - Q_i, Q_i = sum_k s_c_k; with c_i = r_t / r_s it adds

        c_i (s_v [v in top-K] - Q_i s_v).

    Softmax and lse in fp32; post's derivative by autograd (elementwise, local)."""
    every = c.stats()  # (world, n, 1 + K)
    lse, z_top = every[..., 0].logsumexp(0), every[..., 1:].sum(0)
    p_t = logprobs.exp()
    losses = (torch.xlogy(p_t, p_t) - p_t * (z_top - lse[:, None])).sum(-1)  # L_token(i), eq. 12
    scale, top = p_t.sum(-1), -p_t  # dL/dz: P_i s, and at the top-K ids - p_t
    if tail:  # as baselines/targets.py's tail_term: r_s = 1 - Q to fp32's ~1e-7, stopped there (its gradient too)
        s_top = torch.exp(z_top - lse[:, None])
        Q = s_top.sum(-1)
        open_ = Q < 1 - 1e-7
        rest_t = (1 - scale).clamp(min=0)
        losses = losses + torch.xlogy(rest_t, rest_t) - rest_t * torch.log1p(-Q.clamp(max=1 - 1e-7))
        c_i = rest_t / (1 - Q).clamp(min=1e-7) * open_
        scale, top = scale - c_i * Q, top + c_i[:, None] * s_top
    if not need_grad:
        return losses, None
    if not c.z.shape[-1]:  # no rows here (more ranks than rows): nothing to differentiate
        return losses, c.z_lin.detach()
    dz = torch.sub(c.z, lse[:, None]).exp_().mul_((w * scale)[:, None])  # w_i P_i softmax(z_i)
    dz.scatter_add_(-1, c.local, w[:, None] * top * c.here)  # - w_i p_t,v at the top-K ids
    (dz_lin,) = torch.autograd.grad(c.z_graph, c.z_lin, dz)  # through post: its derivative
    return losses, dz_lin


def _lagged(items, depth):
    """The items of an iterator, each once `depth` more have been started after it: a chunk's
    collective runs while the next chunk's logits are made."""
    queue = collections.deque()
    for item in items:
        queue.append(item)
        if len(queue) > depth:
            yield queue.popleft()
    yield from queue


def _head_losses(h, weight, bias, post, ids, logprobs, w, chunk, rows, need=(False, False, False),
                 tail=False):
    """L_token(i) for every token, z_i = post(W h_i + b), `chunk` tokens at a time (h: (n, d), W:
    (R, d), the rows `rows` says), and the gradients `need` asks for (of h, W, b) of
    sum_i w_i L_token(i), made chunk by chunk: dL/dh = dz W, dL/dW = sum dz^T h, dL/db = sum dz.
    Three matmuls, as the unfused head + loss has. Vocabulary-parallel, one collective a chunk,
    waited for one chunk later."""
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
    started = ((sl, _chunk_logits(h[sl], weight, bias, post, ids[sl], rows, any(need)))
               for sl in (slice(a, a + chunk) for a in range(0, h.shape[0], chunk)))
    for sl, c in _lagged(started, 1 if rows.world > 1 else 0):
        losses[sl], dz = _chunk_losses(c, logprobs[sl], w[sl], any(need), tail)
        if dh is not None:
            dh[sl] = (dz @ weight).to(dh.dtype)
        if dW is not None and dz.dtype == dW.dtype:  # fp32: in place, no R x d temporary
            dW.addmm_(dz.t(), h[sl].to(dz.dtype))
        elif dW is not None:  # bf16: the chunk's product in bf16 (half an R x d), summed in fp32
            dW += dz.t() @ h[sl].to(dz.dtype)
        if db is not None:
            db += dz.sum(0)
    return losses, dh, dW, db


# teacher ids must be rows of the student's logits: a gather would clamp the others silently
TEACHER_IDS = "teacher token id {bad}is outside the student's {rows} logits"


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
    def forward(ctx, h, weight, bias, post, ids, logprobs, w, chunk, rows, n_logits, tail):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2])
        if rows.world > 1:  # dL/dh made on every rank: the reduce-scatter below is collective
            need = (True, *need[1:])
        # a training micro-batch is one shape on every rank: its token count known, nothing asked
        H, IDS, LP, Wt = rows.gather_tokens(h, ids, logprobs, w, n_max=h.shape[0])
        assert_ids(IDS, n_logits, TEACHER_IDS.format(bad="", rows=n_logits))
        losses, dH, dW, db = _head_losses(H, weight, bias, post, IDS, LP, Wt, chunk, rows, need,
                                          tail)
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
            spread = ctx.rows.max(torch.stack([g, -g]).float())  # asserted on the device: no sync
            torch._assert_async(~(spread[0] + spread[1] > 1e-6 * spread[0].abs()),
                                "vocabulary-parallel head_kd_loss: the ranks scaled their losses "
                                "differently; scale by the same factor on every rank")
        # g: dObjective/dLoss, a scalar (1 / the micro-batch count...); in place, no copy
        scaled = [t.mul_(g.to(t.dtype)) if t is not None else None for t in grads]
        return (*scaled, None, None, None, None, None, None, None, None)


def head_kd_loss(hidden, weight, bias, topk_ids, topk_logprobs, entropy=None, mask=None,
                 post=None, vocab=None, chunk_tokens=256, tail=False, scale=1.0):
    """The top-K KD loss, a scalar: eq. 12 (entropy None: kd) or eq. 13 (entropy (B, T) = H_t: akd)
    of the student logits z = post(hidden W^T + b)[..., :vocab], which are never made whole.
    hidden (B, T, d); the head's weight (V, d) and bias (V) or None; topk_ids, topk_logprobs
    (B, T, K); mask (B, T) bool or None (False = padding: no loss, no gradient); post the model's
    logit transform (None: identity); vocab: the head's first rows only (a padded embedding's extra
    rows get no gradient). At most `chunk_tokens` x V logits exist at once: lower it when memory
    is tight, raise it for GPU throughput (each chunk reads W once). Logits given directly: pass
    them as `hidden` with an identity `weight`. W (and b) may be DTensors sharded by rows
    (vocab_parallel.py): then every rank must call this alike (with or without grad), and
    gets its own tokens' loss. scale: a factor on the loss, inside the token weights (prune.py's
    micro-batch weights may differ between ranks; the head's gradient sums every rank's tokens)."""
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    ids = topk_ids.reshape(-1, topk_ids.shape[-1]).long()
    logprobs = topk_logprobs.reshape(ids.shape).float()
    w = torch.ones(ids.shape[0], device=h.device, dtype=torch.float32)
    if entropy is not None:  # akd: token i weighs H_t(i) (eq. 13); kd: every token weighs 1
        w = w * entropy.reshape(-1).float()
    count = max(h.shape[0], 1)
    if mask is not None:  # padding at weight 0: no loss, no gradient, no shape from the data
        keep = mask.reshape(-1).bool()
        w, count = w * keep, keep.sum().clamp(min=1)
        # what a padded position holds is never read: a valid id, a teacher with no mass
        ids = ids.masked_fill(~keep[:, None], 0)
        logprobs = logprobs.masked_fill(~keep[:, None], -torch.inf)
    rows = VocabShard(weight)
    n_logits = rows.V if vocab is None else min(vocab, rows.V)  # the rows both have
    if rows.group is not None:  # vocabulary-parallel: this rank's rows (autograd maps them back)
        weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
    if vocab is not None and vocab < rows.start + weight.shape[0]:
        top = max(vocab - rows.start, 0)
        weight, bias = weight[:top], bias[:top] if bias is not None else None
    w = w * scale / count  # 1/N over the counted tokens; none (all padding) gives 0
    post = post or (lambda z: z)
    chunk = chunk_tokens * rows.world  # every rank's tokens x V / world rows: chunk_tokens x V
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (h, weight, bias)):
        return _HeadTokenLosses.apply(h, weight, bias, post, ids, logprobs, w, chunk, rows,
                                      n_logits, tail)
    # no backward will follow (validation, a search's fitness): the loss alone
    H, IDS, LP, Wt = rows.gather_tokens(h, ids, logprobs, w)
    assert_ids(IDS, n_logits, TEACHER_IDS.format(bad="", rows=n_logits))
    losses = _head_losses(H, weight, bias, post, IDS, LP, Wt, chunk, rows, tail=tail)[0]
    return (w * losses[rows.own]).sum()


def next_token_targets(input_ids, mask=None, loss_mask=None):
    """Cross-entropy as a top-1 KD target: c = the next token, log p_t,c = 0 (ids, log-probs, and
    which positions count: not the last, which has no next token, nor padding, nor one loss_mask
    leaves out)."""
    ids = input_ids.roll(-1, dims=1)[..., None]
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    valid[:, -1] = False
    if mask is not None:
        valid &= mask.bool() & mask.bool().roll(-1, dims=1)
    if loss_mask is not None:
        valid &= loss_mask.bool()
    return ids, torch.zeros(ids.shape, dtype=torch.float32, device=ids.device), valid


# -----------------------------------------------------------------------------
# The head as a module that returns losses, and the logits of the last layer's output

def head_losses(model, input_ids, losses, attention_mask=None):
    """One forward of the model whose LM head, instead of the (B, T, V) logits, returns the losses
    `losses` ask for: each fn(x, W, b, post) -> a scalar, with x the head's input norm(h_L) at every
    position, W and b the head's weight and bias, post = logit_transform(model). A tensor of them.

    The head module is the one that runs, once, as in a plain forward: under FSDP2 its hooks gather
    W for it and reduce-scatter the gradient the losses return for W (a vocabulary-parallel head,
    vocab_parallel.py, is no FSDP unit: W arrives as this rank's rows, a DTensor, and the
    losses work on the rows). What the model's forward does
    after its head (soft-capping, a logit scale) then runs on the returned losses and is dropped:
    the losses apply post themselves."""
    head, post = model.get_output_embeddings(), logit_transform(model)
    out = {}

    def forward(self, x):
        # the head's output, as FSDP2 registered its backward hook on it: kept, not a copy (and no
        # view, which FSDP2 warns about)
        out["losses"] = torch.stack([fn(x, self.weight, getattr(self, "bias", None), post)
                                     .reshape(1, 1) for fn in losses], dim=-1)
        return out["losses"]
    before = head.__dict__.get("forward")  # an instance-level forward someone set (hooks): kept
    head.forward = types.MethodType(forward, head)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        if before is None:
            del head.forward  # the class's forward again
        else:
            head.forward = before
    return out["losses"].view(-1)


def last_layer_output(model, input_ids, attention_mask=None):
    """(h_L, the model's own logits at the last position) from one forward that computes the LM head
    for the last position only (logits_to_keep=1), so no (T, V) tensor is made here."""
    out = {}
    # a hook on the last layer, not output_hidden_states: that would keep all L + 1 hidden states
    hook = decoder_layers(model)[-1].register_forward_hook(
        lambda module, args, output: out.update(h=hidden_out(output)))
    try:
        last = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                     logits_to_keep=1).logits
    finally:
        hook.remove()
    return out["h"], last[:, -1]


def check_logits_path(model, h, last_logits):
    """Refuse, with one line, an architecture whose forward does something after its last decoder
    layer that model_logits does not (a final norm under another name, another logit scale): the
    recomputed logits of the last position must be the model's own."""
    z = model_logits(model, h[:, -1]).float()
    ref = last_logits.float()
    # loose and relative: rounding may differ between the two paths; a missing norm or logit
    # scale is off by far more
    if (z - ref).abs().max() > 1e-2 * (1 + ref.abs().max()):
        raise E3Error(f"{type(model).__name__}: logits recomputed from the last layer's output "
                      f"differ from the model's own by {(z - ref).abs().max():.3g}; teach "
                      f"architectures/logits.py this architecture's final norm or logit scale")



class root_unsharded:
    """Under FSDP2 the root unit (the final norm; the embeddings and LM head where they are FSDP's)
    is sharded outside the root's own forward; calling the head directly needs it gathered first.
    A vocabulary-parallel head would gather its rows at every call: gathered once here instead
    (no-grad calls). A no-op without FSDP."""

    def __init__(self, model):
        # duck-typed: FSDP2 adds unshard/reshard to the module's own class; a vocabulary-parallel
        # head (vocab_parallel.py) has gather_rows
        self.fsdp = hasattr(model, "unshard") and hasattr(model, "reshard")
        self.model = model
        self.head = model.get_output_embeddings()
        self.rows = hasattr(self.head, "gather_rows")

    def __enter__(self):
        if self.fsdp:
            self.model.unshard()
        if self.rows:
            self.head.gather_rows()

    def __exit__(self, *exc):
        if self.rows:
            self.head.gather_rows(False)
        if self.fsdp:
            self.model.reshard()


def chunked_logits(model, input_ids, chunk):
    """The model's own logits of input_ids (B, T), `chunk` tokens at a time, (chunk, V) each: the
    last layer's output from one forward that makes the head's logits for the last position only,
    then post(W norm(h)) chunk by chunk. For a teacher too big to hold (B, T, V) logits at once
    (cache_teacher.py --logit-chunk), whole or FSDP-sharded."""
    h, last_logits = last_layer_output(model, input_ids)
    with root_unsharded(model):  # under FSDP2 the head runs outside the forward: gathered here
        check_logits_path(model, h, last_logits)  # the cache holds log_softmax(model(x).logits)
        for hc in h.reshape(-1, h.shape[-1]).split(chunk):
            yield model_logits(model, hc)


# -----------------------------------------------------------------------------
# What prune.py calls: losses(model, batch, kinds), as its plain_losses

def distinct_draws(draws):
    """(..., N) draws -> ids and log-shares (..., N): each distinct id once, sorted, at the log of
    its share of the N draws; the slots left over hold id 0 at log 0 = -inf (weight 0)."""
    ids = draws.sort(-1).values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[..., 1:] = ids[..., 1:] != ids[..., :-1]
    slot = first.long().cumsum(-1) - 1  # each id's place among the distinct ones: 0, 0, 1, 2, 2
    out = torch.zeros_like(ids).scatter_(-1, slot, ids)  # repeats write the same id
    share = torch.full(ids.shape, 1 / ids.shape[-1], device=ids.device)
    return out, torch.zeros_like(share).scatter_add_(-1, slot, share).log()


def _loss_fn(kind, batch, vocab, chunk):
    """The fused form of kd.LOSSES[kind]: fn(x, W, b, post) -> the loss, for head_losses."""
    targets, tail = batch.get("targets", "topk"), False
    if kind == "sft":
        ids, logprobs, mask = next_token_targets(batch["input_ids"], batch.get("mask"),
                                                 batch.get("loss_mask"))
        entropy = None
    elif kind in ("kd", "akd") and targets in ("topk", "tail", "sampled", "hybrid"):
        if targets in ("topk", "tail"):
            ids, logprobs, tail = batch["topk_ids"], batch["topk_logprobs"], targets == "tail"
        else:  # sampled, hybrid: each drawn token once, with its share of the draws
            ids, logprobs = distinct_draws(batch["sample_ids"])
        if targets == "hybrid":  # the top-K first, then the rest's draws at r_t times their shares
            top = batch["topk_logprobs"].float()
            rest = rest_mass(top)[..., None].log()
            ids = torch.cat([batch["topk_ids"], ids], -1)
            logprobs = torch.cat([top, rest + logprobs], -1)
        mask, entropy = kd.positions(batch), batch["entropy"] if kind == "akd" else None
    else:
        raise E3Error(f"the fused LM head implements the losses akd, kd and sft over top-K, tail, "
                      f"sampled or hybrid targets, not '{kind}' over '{targets}'; run with "
                      f"--logit-chunk 0 (the plain logits path, kd.py), or teach "
                      f"scale/fused_loss.py the new loss")
    return lambda x, W, b, post: head_kd_loss(x, W, b, ids, logprobs, entropy, mask, post, vocab,
                                              chunk, tail, batch.get("weight", 1.0))


class FusedLoss:
    """losses(model, batch, kinds) with the LM head fused in. At the first call of each kind it
    computes the loss both ways on 256 tokens of the batch around its first counted one (no
    gradient) and refuses, with one error line, a difference beyond rounding: kd.py's function is
    the reference, so an edited kd.py (or a logit transform architectures/logits.py does not know)
    is never silently replaced by eq. 12. autocast: the model's forward in bf16 on its device
    (one GPU; FSDP2 casts by its own policy), as prune.plain_losses(autocast=True) runs it."""

    def __init__(self, vocab, chunk, reference, check_tokens=256, autocast=False):
        self.vocab, self.chunk, self.reference = vocab, chunk, reference
        self.check_tokens, self.checked, self.autocast = check_tokens, set(), autocast

    def __call__(self, model, batch, kinds):
        for kind in kinds:
            if (kind, batch.get("targets")) not in self.checked and self.check(model, batch, kind):
                self.checked.add((kind, batch.get("targets")))
        fns = [_loss_fn(kind, batch, self.vocab, self.chunk) for kind in kinds]
        with self.precision(batch):
            return list(head_losses(model, batch["input_ids"], fns))

    def precision(self, batch):
        return (torch.autocast(batch["input_ids"].device.type, torch.bfloat16) if self.autocast
                else contextlib.nullcontext())

    @torch.no_grad()
    def check(self, model, batch, kind):
        """True once the two losses have agreed on a window of tokens that count, on some rank;
        False while none counts anywhere (an --assistant-only micro-batch of prompts: both losses
        would read 0, whatever they are). Under FSDP both forwards are collective: every rank
        runs a window of the same length, counted or not, and they agree on the answer."""
        ids = batch["input_ids"]
        mask = batch.get("loss_mask")
        hits = (torch.ones_like(ids) if mask is None else kd.counted(mask, kind)).nonzero()
        # the first counted position (a prompt may come before it) inside a window of n tokens
        row, first = hits[0].tolist() if len(hits) else (0, 0)
        n = min(self.check_tokens, ids.shape[1])
        start = min(first, ids.shape[1] - n)
        part = {k: v[row:row + 1, start:start + n] if torch.is_tensor(v) else v
                for k, v in batch.items()}
        training = model.training
        model.eval()
        with self.precision(part):
            fused = head_losses(model, part["input_ids"], [_loss_fn(kind, part, self.vocab,
                                                                    self.chunk)])[0]
        (plain,) = self.reference(model, part, [kind])
        model.train(training)
        tight = plain.device.type == "cpu" and not self.autocast  # fp32; else bf16 matmuls
        if len(hits) and not torch.allclose(fused.float(), plain.float(),  # sums in another order
                                            rtol=1e-4 if tight else 2e-2, atol=1e-4 if tight else 1e-3):
            raise E3Error(f"the fused LM head's '{kind}' loss is {fused.item():.6g} where kd.py's "
                          f"is {plain.item():.6g}: kd.py (or the model's logit transform) computes "
                          f"something scale/fused_loss.py does not; run with --logit-chunk 0")
        return any(all_gather(bool(len(hits))))  # once a kind, not a micro-batch: a host value
