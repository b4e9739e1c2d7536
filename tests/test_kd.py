"""Top-K KD (eq. 12), adaptive KD (eq. 13) and next-token CE, kd.py's plain functions of the logits,
against an independent float64 computation."""
import pytest
import torch

from conftest import topk_kd_loss
from kd import LOSSES, next_token_loss


def reference(student, teacher, K, weight_by_entropy, mask):
    """float64, straight from the definitions: teacher's full softmax, its top-K, entropy weights."""
    ls = torch.log_softmax(student.double(), -1)
    lt = torch.log_softmax(teacher.double(), -1)
    top_lp, top_ids = lt.topk(K, -1)
    per_tok = (top_lp.exp() * (top_lp - ls.gather(-1, top_ids))).sum(-1)
    if weight_by_entropy:
        per_tok = per_tok * -(lt.exp() * lt).sum(-1)
    m = torch.ones_like(per_tok, dtype=torch.bool) if mask is None else mask
    return per_tok[m].sum() / m.sum(), top_ids, top_lp, -(lt.exp() * lt).sum(-1)


@pytest.mark.parametrize("K", [3, 50])  # 50 = V: the full KL
@pytest.mark.parametrize("akd", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_matches_float64_reference(K, akd, with_mask):
    torch.manual_seed(0)
    B, T, V = 3, 7, 50
    student, teacher = torch.randn(B, T, V) * 2, torch.randn(B, T, V) * 2
    mask = torch.rand(B, T) > 0.3 if with_mask else None
    ref, ids, lp, ent = reference(student, teacher, K, akd, mask)
    got = topk_kd_loss(student, ids, lp.float(), ent.float() if akd else None, mask)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    if K == V and not akd:  # K = V is the full KL(p_t || p_s)
        full = torch.nn.functional.kl_div(torch.log_softmax(student.double(), -1),
                                          torch.log_softmax(teacher.double(), -1), log_target=True,
                                          reduction="none").sum(-1)
        m = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
        torch.testing.assert_close(got.double(), full[m].mean(), rtol=1e-5, atol=1e-6)


def test_zero_when_student_is_teacher():
    torch.manual_seed(1)
    z = torch.randn(2, 5, 40)
    lt = torch.log_softmax(z, -1)
    lp, ids = lt.topk(10, -1)
    ent = -(lt.exp() * lt).sum(-1)
    assert topk_kd_loss(z, ids, lp, ent).abs().item() < 1e-6


def test_masked_positions_get_no_gradient_and_bf16_is_upcast():
    torch.manual_seed(2)
    B, T, V, K = 2, 6, 30, 4
    student = (torch.randn(B, T, V)).to(torch.bfloat16).requires_grad_(True)
    lt = torch.log_softmax(torch.randn(B, T, V), -1)
    lp, ids = lt.topk(K, -1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    loss = topk_kd_loss(student, ids, lp, -(lt.exp() * lt).sum(-1), mask)
    assert loss.dtype == torch.float32
    loss.backward()
    assert student.grad[0, 3:].abs().sum() == 0
    assert student.grad[mask].abs().sum(-1).min() > 0
    ref, *_ = reference(student.detach().float(), lt, K, True, mask)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)


def test_gradient_equals_float64_autograd():
    """dL/dz of eq. 13 through kd.py's fp32 function equals float64 autograd of the definition."""
    torch.manual_seed(3)
    student = torch.randn(2, 9, 20, dtype=torch.float64, requires_grad=True)
    lt = torch.log_softmax(torch.randn(2, 9, 20, dtype=torch.float64), -1)
    lp, ids = lt.topk(5, -1)
    ent = -(lt.exp() * lt).sum(-1)
    ref, *_ = reference(student, lt, 5, True, None)  # log_softmax(lt) = lt
    (g_ref,) = torch.autograd.grad(ref, student)
    s32 = student.detach().float().requires_grad_(True)
    topk_kd_loss(s32, ids, lp.float(), ent.float()).backward()
    torch.testing.assert_close(s32.grad.double(), g_ref, rtol=1e-4, atol=1e-7)


def test_cross_entropy_ignores_padding():
    torch.manual_seed(4)
    logits, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 2:] = False
    lp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    valid = mask[:, 1:]
    torch.testing.assert_close(next_token_loss(logits, ids, mask).double(), -lp[valid].mean())
    torch.testing.assert_close(LOSSES["sft"](logits, {"input_ids": ids, "mask": mask}).double(),
                               -lp[valid].mean())


def test_full_kd_with_a_masked_teacher_entry_is_finite():
    """A teacher logit of -inf (a masked id) adds 0 log 0 = 0 to KL(p_t || p_s), not NaN."""
    import kd
    torch.manual_seed(0)
    teacher, student = torch.randn(1, 3, 9, dtype=torch.float64), torch.randn(1, 3, 9, dtype=torch.float64)
    teacher[..., 4] = -float("inf")
    got = kd.LOSSES["kd"](student.float(), {"targets": "full", "teacher_logits": teacher.float()})
    keep = [i for i in range(9) if i != 4]
    p = torch.softmax(teacher[..., keep], -1)
    logp_s = torch.log_softmax(student, -1)[..., keep]
    expected = (p * (p.log() - logp_s)).sum(-1).mean()  # float64, over the finite entries
    assert torch.isfinite(got) and abs(got.item() - expected.item()) < 1e-5
