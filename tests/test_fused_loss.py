"""The LM head fused with the loss (scale/fused_loss.py): loss and gradients against float64 autograd
through the whole logits; the same numbers as kd.py's plain functions; a loss it does not implement,
or an edited kd.py, refused at the first call."""
import pytest
import torch

import kd
from conftest import topk_kd_loss as reference_kd_loss
from scale.fused_loss import FusedLoss, head_kd_loss, next_token_targets


def topk_kd_loss(logits, ids, lp, entropy=None, mask=None, chunk_tokens=1024):
    """The fused loss of given logits: head_kd_loss with the identity as the head (z = h I^T = h)."""
    eye = torch.eye(logits.shape[-1], dtype=logits.dtype)
    return head_kd_loss(logits, eye, None, ids, lp, entropy, mask, chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("K", [3, 50])
@pytest.mark.parametrize("akd", [False, True])
def test_fused_equals_kd_py_and_chunks_do_not_matter(K, akd):
    torch.manual_seed(0)
    B, T, V = 3, 7, 50
    student, teacher = torch.randn(B, T, V) * 2, torch.randn(B, T, V) * 2
    mask = torch.rand(B, T) > 0.3
    lt = torch.log_softmax(teacher, -1)
    lp, ids = lt.topk(K, -1)
    ent = -(lt.exp() * lt).sum(-1) if akd else None
    plain = reference_kd_loss(student, ids, lp, ent, mask)
    for chunk in (1, 5, 10_000):
        torch.testing.assert_close(topk_kd_loss(student, ids, lp, ent, mask, chunk), plain,
                                   rtol=1e-5, atol=1e-6)


def test_chunked_gradient_equals_unchunked():
    torch.manual_seed(3)
    student = torch.randn(2, 9, 20, requires_grad=True)
    lt = torch.log_softmax(torch.randn(2, 9, 20), -1)
    lp, ids = lt.topk(5, -1)
    g = []
    for chunk in (1, 4, 10_000):
        student.grad = None
        topk_kd_loss(student, ids, lp, chunk_tokens=chunk).backward()
        g.append(student.grad.clone())
    torch.testing.assert_close(g[0], g[2])
    torch.testing.assert_close(g[1], g[2])


def test_teacher_ids_outside_the_logits_are_refused():
    """A teacher id past the student's logits was clamped to the last row: a wrong loss, silently.
    The fused head asserts it without reading the ids back (a device-side assert on a GPU); the
    batch's check, once a batch on the host, names the id."""
    z = torch.randn(1, 4, 10)
    lp = torch.log_softmax(torch.randn(1, 4, 3), -1)
    ids = torch.tensor([[[0, 1, 2], [3, 4, 5], [6, 7, 12], [1, 2, 3]]])
    with pytest.raises(RuntimeError, match="outside the student's 10 logits"):
        topk_kd_loss(z, ids, lp)
    eye = torch.eye(10)
    with pytest.raises(RuntimeError, match="outside the student's 7 logits"):  # the vocabulary cut
        head_kd_loss(z, eye, None, ids.clamp(max=9), lp, vocab=7)
    with pytest.raises(RuntimeError, match="outside the student's 10 logits"):  # past the head's rows
        head_kd_loss(z, eye, None, ids, lp, vocab=16)


@pytest.mark.parametrize("chunk", [1, 4, 10_000])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_head_loss_equals_float64_logits_path(chunk, softcap):
    """head_kd_loss (LM head + loss fused, chunked, gradients made in the forward) against float64
    autograd through the whole logits: loss and the gradients of h, W and b; entropy weights, a
    padding mask, and a head with 2 padding rows past the vocabulary (no gradient there)."""
    torch.manual_seed(5)
    B, T, d, V, K = 2, 7, 6, 30, 4
    h = torch.randn(B, T, d, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V + 2, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V + 2, dtype=torch.float64, requires_grad=True)
    lt = torch.log_softmax(torch.randn(B, T, V, dtype=torch.float64) * 2, -1)
    lp, ids = lt.topk(K, -1)
    ent = -(lt.exp() * lt).sum(-1)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) > 0.3
    post = (lambda z: softcap * torch.tanh(z / softcap)) if softcap else None

    z = (h @ W.t() + b)[..., :V]  # the reference: the whole (B, T, V) logits, float64
    z = post(z) if post else z
    ls = torch.log_softmax(z, -1)
    per_tok = (lp.exp() * (lp - ls.gather(-1, ids))).sum(-1) * ent
    ref = per_tok[mask].sum() / mask.sum()
    ref_grads = torch.autograd.grad(ref * 0.25, (h, W, b))  # 0.25: a micro-batch's 1 / n_micro

    hf, Wf, bf = (t.detach().float().requires_grad_(True) for t in (h, W, b))
    got = head_kd_loss(hf, Wf, bf, ids, lp.float(), ent.float(), mask, post=post, vocab=V,
                       chunk_tokens=chunk)
    (got * 0.25).backward()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    for t, r in zip((hf, Wf, bf), ref_grads):
        torch.testing.assert_close(t.grad.double(), r, rtol=1e-4, atol=1e-6)
    assert Wf.grad[V:].abs().sum() == 0 and hf.grad[~mask].abs().sum() == 0
    with torch.no_grad():  # validation's path: the loss alone, the same number
        torch.testing.assert_close(head_kd_loss(hf, Wf, bf, ids, lp.float(), ent.float(), mask,
                                                post=post, vocab=V, chunk_tokens=chunk), got)


def test_next_token_targets_give_cross_entropy():
    """Cross-entropy as top-1 KD against a one-hot teacher: equals F.cross_entropy in float64 on
    the next tokens, the last position and padded positions (and the ones before them) excluded."""
    torch.manual_seed(6)
    B, T, d, V = 2, 9, 5, 17
    h, W = torch.randn(B, T, d, dtype=torch.float64), torch.randn(V, d, dtype=torch.float64)
    x = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    ids, lp, valid = next_token_targets(x, mask)
    got = head_kd_loss(h.float(), W.float(), None, ids, lp, mask=valid, chunk_tokens=4)
    logits, labels = (h @ W.t())[:, :-1], x[:, 1:].clone()
    labels[~mask[:, 1:]] = -100
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1),
                                            ignore_index=-100)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_fused_head_gradient_of_a_bf16_head_is_rounded_once():
    """Under FSDP's bf16 parameters the head's dW is a sum over many chunks: summed in bf16 chunk by
    chunk it drifted (1.1% from the float64 reference at 128 chunks); accumulated in fp32 and rounded
    once it is as close as one bf16 matmul over all tokens (0.27%)."""
    g = torch.Generator().manual_seed(7)
    n, d, V, K = 4096, 16, 64, 4
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    W = torch.randn(V, d, generator=g, dtype=torch.float64) * 0.3
    lt = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    lp, ids = lt.topk(K, -1)
    Wr = W.clone().requires_grad_(True)
    ref = (lp.exp() * (lp - torch.log_softmax(h @ Wr.t(), -1).gather(-1, ids))).sum(-1).mean()
    (ref_dW,) = torch.autograd.grad(ref, Wr)
    Wb = W.to(torch.bfloat16).requires_grad_(True)
    head_kd_loss(h.to(torch.bfloat16)[None], Wb, None, ids[None], lp.float()[None],
                 chunk_tokens=32).backward()
    assert Wb.grad.dtype == torch.bfloat16
    err = (Wb.grad.double() - ref_dW).norm() / ref_dW.norm()
    assert err < 0.005, err


def test_fused_loss_refuses_what_kd_py_does_not_compute(make_tiny, monkeypatch):
    """FusedLoss gives kd.py's numbers (checked at its first call of each loss on the batch's first
    tokens); a fork's edited loss in kd.py, or a new one, is refused with one error line, never
    replaced by eq. 12."""
    from transformers import AutoModelForCausalLM

    import prune
    from runtime import E3Error
    model = AutoModelForCausalLM.from_pretrained(make_tiny("llama", 3), dtype=torch.float32)
    V = 49152
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (2, 12), generator=g)
    lt = torch.log_softmax(torch.randn(2, 12, V, generator=g) * 3, -1)
    lp, top = lt.topk(10, -1)
    batch = {"input_ids": ids, "topk_ids": top, "topk_logprobs": lp,
             "entropy": -(lt.exp() * lt).sum(-1)}
    plain = prune.plain_losses(V)
    fused = FusedLoss(V, 5, reference=plain)(model, batch, ["akd", "kd", "sft"])
    for a, b in zip(fused, plain(model, batch, ["akd", "kd", "sft"])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    akd = kd.LOSSES["akd"]
    monkeypatch.setitem(kd.LOSSES, "akd", lambda logits, b: akd(logits, b) * 1.01)  # a fork's edit
    with pytest.raises(E3Error, match="--logit-chunk 0"):
        FusedLoss(V, 5, reference=plain)(model, batch, ["akd"])
    # --assistant-only: the check looks where tokens count, not at a prompt where both losses read
    # 0 (row 0's first 6 positions a prompt, a 4-token check); a micro-batch in which nothing counts
    # checks nothing, and the next one is checked
    prompt = torch.ones(2, 12, dtype=torch.bool)
    prompt[0, :6] = False
    with pytest.raises(E3Error, match="--logit-chunk 0"):
        FusedLoss(V, 5, reference=plain, check_tokens=4)(model, {**batch, "loss_mask": prompt}, ["akd"])
    fused = FusedLoss(V, 5, reference=plain, check_tokens=4)
    fused(model, {**batch, "loss_mask": torch.zeros(2, 12, dtype=torch.bool)}, ["akd"])
    with pytest.raises(E3Error, match="--logit-chunk 0"):
        fused(model, {**batch, "loss_mask": prompt}, ["akd"])
    monkeypatch.setitem(kd.LOSSES, "mine", akd)
    with pytest.raises(E3Error, match="implements the losses akd, kd and sft"):
        FusedLoss(V, 5, reference=plain)(model, batch, ["mine"])


def test_fused_loss_runs_the_model_under_autocast(make_tiny):
    """FusedLoss(autocast=True), prune.py's one-GPU --logit-chunk path: the model's matmuls run under
    bf16 autocast on the batch's device (here a CPU's), as the plain path's do (it ran fp32 on a
    GPU); the loss within bf16's rounding of the fp32 one, and its gradient reaches the weights."""
    from transformers import AutoModelForCausalLM

    import prune
    model = AutoModelForCausalLM.from_pretrained(make_tiny("llama", 2), dtype=torch.float32)
    V = 49152
    g = torch.Generator().manual_seed(1)
    lt = torch.log_softmax(torch.randn(2, 12, V, generator=g) * 3, -1)
    lp, top = lt.topk(10, -1)
    batch = {"input_ids": torch.randint(0, V, (2, 12), generator=g), "topk_ids": top,
             "topk_logprobs": lp, "entropy": -(lt.exp() * lt).sum(-1)}
    seen = []
    layer = model.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda m, i, out: seen.append((torch.is_autocast_enabled("cpu"),
                                                               out.dtype)))
    plain = prune.plain_losses(V)
    (loss,) = FusedLoss(V, 5, reference=plain, autocast=True)(model, batch, ["akd"])
    loss.backward()
    # the first-call check's fused forward, its reference (kd.py's, fp32 here), the loss's forward
    bf16, fp32 = (True, torch.bfloat16), (False, torch.float32)
    assert seen == [bf16, fp32, bf16], seen
    with torch.no_grad():
        (ref,) = plain(model, batch, ["akd"])
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=1e-3)
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
    seen.clear()
    FusedLoss(V, 5, reference=plain)(model, batch, ["akd"])  # the default: fp32, as before
    assert seen == [fp32] * 3, seen
