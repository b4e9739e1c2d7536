"""Teacher targets beside the paper's top-K (kd.TARGETS; cache_teacher.py --targets; prune.py --kd-tail,
--kd-full): the K + 1-class KL against float64 written out token by token; the sampled target's gradient,
averaged over many draws, against the full KL's (the same check fails for top-K); top-K with K = V equals
the full KL; the fused head computes what kd.py does; the bytes a token of each cache, the draws seeded,
drawn from the teacher; prune.py with each; experiments/target_noise.py's variances against draws."""
import itertools
import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import kd
from cache_teacher import TeacherCache, build_cache
from scale.fused_loss import _loss_fn, distinct_draws, head_kd_loss


def sampled_kl(logp_s, draws):  # kd.TARGETS["sampled"] on a batch of draws alone
    return kd.TARGETS["sampled"](logp_s, {"sample_ids": draws})


def ls(logits):
    """The student's log-probs, what kd.py's L_token functions take."""
    return torch.log_softmax(logits.float(), -1)


def tail_kl_float64(student, teacher, K):
    """The K + 1-class KL, one position at a time, in float64 with Python sums: the teacher's top-K
    and the rest lumped, p_t,rest = 1 - sum_K p_t, p_s,rest = sum of the student's p over the rest."""
    V = student.shape[-1]
    out = torch.zeros(student.shape[:-1], dtype=torch.float64)
    for pos in itertools.product(*map(range, student.shape[:-1])):
        ps = torch.softmax(student[pos].double(), -1).tolist()
        pt = torch.softmax(teacher[pos].double(), -1).tolist()
        top = sorted(range(V), key=lambda v: -pt[v])[:K]
        rest = [v for v in range(V) if v not in top]
        pt_rest, ps_rest = 1 - sum(pt[c] for c in top), sum(ps[v] for v in rest)
        out[pos] = sum(pt[c] * math.log(pt[c] / ps[c]) for c in top) + \
            pt_rest * math.log(pt_rest / ps_rest)
    return out


def tail_kl_autograd64(student, teacher_logprobs, ids):
    """The same K + 1-class KL vectorised in float64 (the rest as 1 - the top-K's mass): autograd's
    gradient is the reference for kd.py's and the fused head's."""
    ls = torch.log_softmax(student, -1)
    lp = teacher_logprobs
    r_t, r_s = 1 - lp.exp().sum(-1), 1 - ls.gather(-1, ids).exp().sum(-1)
    return (lp.exp() * (lp - ls.gather(-1, ids))).sum(-1) + r_t * (r_t.log() - r_s.log())


def fused(logits, ids, lp, entropy=None, mask=None, tail=False, chunk=4):
    """head_kd_loss of given logits: the identity as the head (z = h I^T)."""
    eye = torch.eye(logits.shape[-1], dtype=logits.dtype)
    return head_kd_loss(logits, eye, None, ids, lp, entropy, mask, chunk_tokens=chunk, tail=tail)


@pytest.mark.parametrize("K", [1, 4, 19])  # 19 of 20: the rest is one token
def test_tail_kl_equals_float64_written_out(K):
    torch.manual_seed(0)
    B, T, V = 2, 5, 20
    student, teacher = torch.randn(B, T, V) * 2, torch.randn(B, T, V) * 2
    lp, ids = torch.log_softmax(teacher, -1).topk(K, -1)
    want = tail_kl_float64(student, teacher, K)
    torch.testing.assert_close(kd.TARGETS["tail"](ls(student), {"topk_ids": ids, "topk_logprobs": lp}).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kd.LOSSES["kd"](student, {"topk_ids": ids, "topk_logprobs": lp,
                                                         "targets": "tail"}).double(),
                               want.mean(), rtol=1e-5, atol=1e-6)
    # the fused head (closed-form dL/dz): loss and gradient against float64 autograd
    s64 = student.double().requires_grad_(True)
    tail_kl_autograd64(s64, lp.double(), ids).mean().backward()
    s32 = student.clone().requires_grad_(True)
    loss = fused(s32, ids, lp, tail=True)
    loss.backward()
    torch.testing.assert_close(loss.double(), want.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s32.grad.double(), s64.grad, rtol=1e-4, atol=1e-6)
    s = student.clone().requires_grad_(True)  # kd.py's by autograd too
    kd.TARGETS["tail"](ls(s), {"topk_ids": ids, "topk_logprobs": lp}).mean().backward()
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-4, atol=1e-6)


def test_tail_kl_is_zero_at_the_teacher_and_sees_the_mass_top_k_kd_does_not():
    """At the teacher both read 0; a student that puts all its mass on the teacher's top-K (eq. 12's
    minimum) reads 0 under top-K KD but not under the K + 1-class KL."""
    torch.manual_seed(1)
    V, K = 30, 5
    t = torch.randn(1, 1, V) * 2
    lp, ids = torch.log_softmax(t, -1).topk(K, -1)
    assert kd.TARGETS["tail"](ls(t), {"topk_ids": ids, "topk_logprobs": lp}).abs().max() < 1e-5
    on_top = torch.full_like(t, -30.0).scatter(-1, ids, lp)  # p_s = p_t / sum_K p_t on the top-K
    assert kd.token_kl(ls(on_top), ids, lp).item() < kd.token_kl(ls(t), ids, lp).item()  # eq. 12 prefers it
    # r_t log(r_t / r_s) with r_t = 0.034 and r_s ~ 1e-12, which the loss stops at 1e-7
    assert kd.TARGETS["tail"](ls(on_top), {"topk_ids": ids, "topk_logprobs": lp}).item() == pytest.approx(
        kd.token_kl(ls(on_top), ids, lp).item() + 0.034 * math.log(0.034 / 1e-7), rel=0.05)


def test_top_k_with_k_equal_v_is_the_full_kl():
    torch.manual_seed(2)
    V = 25
    student, teacher = torch.randn(3, 4, V) * 2, torch.randn(3, 4, V) * 2
    lp, ids = torch.log_softmax(teacher, -1).topk(V, -1)
    pt, ps = torch.softmax(teacher.double(), -1), torch.softmax(student.double(), -1)
    want = (pt * (pt.log() - ps.log())).sum(-1)
    torch.testing.assert_close(kd.token_kl(ls(student), ids, lp).double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kd.TARGETS["full"](ls(student), {"teacher_logits": teacher}).double(), want, rtol=1e-5, atol=1e-6)


def test_distinct_draws_count_every_draw_once():
    """The fused head's form of the draws: each distinct id once, at its share of the draws."""
    torch.manual_seed(3)
    draws = torch.randint(0, 6, (50, 12))
    ids, logw = distinct_draws(draws)
    for row, i, ww in zip(draws.tolist(), ids.tolist(), logw.exp().tolist()):
        got = {c: x for c, x in zip(i, ww) if x > 0}
        assert got == pytest.approx({c: n / 12 for c, n in Counter(row).items()})
        assert len(got) == sum(x > 0 for x in ww)  # each id once


def test_sampled_gradient_is_the_full_kl_gradient_in_expectation_and_top_k_is_not():
    """E over draws of d/dz sum_c w_c (log w_c - log p_s,c) = softmax(z) - p_t, the full KL's gradient:
    averaged over M positions of N = 12 draws each, within 5 standard errors of it (the standard error
    of a share of N M draws, sqrt(p (1 - p) / (N M))). Top-K's gradient, P softmax(z) - p_t on the
    top-K, misses by far more: the mass the teacher puts off its top-K."""
    torch.manual_seed(4)
    V, N, M, K = 40, 12, 20_000, 5
    z, t = torch.randn(V), torch.randn(V)
    p_t = torch.softmax(t.double(), -1)
    full = torch.softmax(z.double(), -1) - p_t
    se = (p_t * (1 - p_t) / (N * M)).sqrt().max().item()
    draws = torch.multinomial(p_t.float().expand(M, V), N, replacement=True)
    zs = z.expand(M, V).clone().requires_grad_(True)
    sampled_kl(ls(zs), draws).sum().backward()
    sampled = zs.grad.double().mean(0)
    assert (sampled - full).abs().max().item() < 5 * se, ((sampled - full).abs().max(), se)
    # the fused head: the same gradient from the distinct draws at their shares
    zf = z.expand(M, V).clone().requires_grad_(True)
    ids, logw = distinct_draws(draws)
    (fused(zf[None], ids[None], logw[None], chunk=4096) * M).backward()
    torch.testing.assert_close(zf.grad.double().mean(0), sampled, rtol=0, atol=1e-6)
    lp, tid = torch.log_softmax(t, -1).topk(K)
    zk = z.clone().requires_grad_(True)
    kd.token_kl(ls(zk), tid, lp).backward()
    assert (zk.grad.double() - full).abs().max().item() > 20 * se


def test_sampled_kl_reads_zero_at_its_own_draws_and_matches_float64():
    """KL(the draws' empirical distribution || p_s), the counts made with a Counter, in float64; 0 when
    the student is that distribution; the fused head (distinct ids at their shares) the same."""
    torch.manual_seed(5)
    V, N = 16, 12
    draws = torch.multinomial(torch.softmax(torch.randn(6, V), -1), N, replacement=True)
    student = torch.randn(6, V)
    ps = torch.softmax(student.double(), -1)
    want = torch.tensor([sum(m / N * math.log(m / N / ps[r, c].item()) for c, m in Counter(row).items())
                         for r, row in enumerate(draws.tolist())], dtype=torch.float64)
    torch.testing.assert_close(sampled_kl(ls(student), draws).double(), want, rtol=1e-5, atol=1e-6)
    empirical = torch.zeros(6, V).scatter_add_(-1, draws, torch.full((6, N), 1 / N)).clamp(min=1e-30).log()
    assert sampled_kl(ls(empirical), draws).abs().max() < 1e-5
    torch.testing.assert_close(fused(student[None], *distinct_draws(draws[None])),
                               sampled_kl(ls(student), draws).mean(), rtol=1e-5, atol=1e-6)


def hybrid_kl_float64(student, ids, logprobs, draws):
    """The hybrid target's KL at one position, Python sums in float64: the top-K at p_t,c, then each
    distinct draw x at r_t m_x / N (r_t = 1 - the top-K's mass, m_x its count among the N draws)."""
    ps = torch.softmax(student.double(), -1).tolist()
    pt = [math.exp(x) for x in logprobs.double().tolist()]
    r, N = 1 - sum(pt), len(draws)
    head = sum(p * math.log(p / ps[c]) for c, p in zip(ids.tolist(), pt))
    return head + sum(r * m / N * math.log(r * m / N / ps[x]) for x, m in Counter(draws.tolist()).items())


def hybrid_targets(t, K, N, M, generator=None):
    """M positions of one teacher t (V,): its top-K, and N draws each from the rest, drawn as
    cache_teacher.teacher_targets does: p_t with the top-K set to 0."""
    lp, ids = torch.log_softmax(t.float(), -1).topk(K)
    rest = torch.softmax(t.float(), -1).index_fill(0, ids, 0)
    draws = torch.multinomial(rest.expand(M, -1), N, replacement=True, generator=generator)
    return ids.expand(M, K), lp.expand(M, K), draws


def test_hybrid_kl_matches_float64_and_reads_zero_at_its_target():
    """kd.TARGETS['hybrid'] and the fused head (top-K ids, then the distinct draws at r_t x their
    shares) against the float64 sums written out; 0 when the student is the target itself."""
    torch.manual_seed(6)
    V, K, N = 24, 4, 12
    t, student = torch.randn(5, V) * 2, torch.randn(5, V)
    rows = [hybrid_targets(t[i], K, N, 1) for i in range(5)]
    ids, lp, draws = (torch.cat(x) for x in zip(*rows))
    want = torch.tensor([hybrid_kl_float64(student[i], ids[i], lp[i], draws[i]) for i in range(5)],
                        dtype=torch.float64)
    got = kd.TARGETS["hybrid"](ls(student), {"topk_ids": ids, "topk_logprobs": lp, "sample_ids": draws})
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    batch = {"targets": "hybrid", "topk_ids": ids[None], "topk_logprobs": lp[None], "sample_ids": draws[None],
             "entropy": torch.ones(1, 5)}
    fused_loss = _loss_fn("kd", batch, V, 2)(student[None], torch.eye(V), None, None)  # logits as hidden
    torch.testing.assert_close(fused_loss.double(), want.mean(), rtol=1e-5, atol=1e-6)
    target = torch.full((5, V), 1e-30)  # the target distribution itself as the student's softmax
    r = 1 - lp.exp().sum(-1, keepdim=True)
    target.scatter_(-1, ids, lp.exp()).scatter_add_(-1, draws, r.expand(5, N) / N)
    assert kd.TARGETS["hybrid"](ls(target.log()), {"topk_ids": ids, "topk_logprobs": lp, "sample_ids": draws}).abs().max() < 1e-5


def test_hybrid_gradient_is_the_full_kl_gradient_in_expectation_with_less_variance_than_sampled():
    """E over draws of the hybrid gradient = softmax(z) - p_t, the full KL's: averaged over M positions
    within 5 standard errors (r_t sqrt(q (1 - q) / (N M)), q the rest's conditional probabilities);
    its per-position variance at the same N is under a third of the sampled target's when the top-K
    holds most of the mass (here ~0.7: about r_t^2 = 0.09 of it)."""
    torch.manual_seed(7)
    V, N, M, K = 40, 12, 20_000, 4
    z, t = torch.randn(V), torch.randn(V) * 2
    p_t = torch.softmax(t.double(), -1)
    full = torch.softmax(z.double(), -1) - p_t
    ids, lp, draws = hybrid_targets(t, K, N, M)
    r = 1 - lp[0].double().exp().sum()
    q = p_t.index_fill(0, ids[0], 0) / r
    se = (r * (q * (1 - q) / (N * M)).sqrt()).max().item()
    zh = z.expand(M, V).clone().requires_grad_(True)
    kd.TARGETS["hybrid"](ls(zh), {"topk_ids": ids, "topk_logprobs": lp, "sample_ids": draws}).sum().backward()
    hybrid = zh.grad.double()
    assert (hybrid.mean(0) - full).abs().max().item() < 5 * se, ((hybrid.mean(0) - full).abs().max(), se)
    zs = z.expand(M, V).clone().requires_grad_(True)
    sampled_kl(ls(zs), torch.multinomial(p_t.float().expand(M, V), N, replacement=True)).sum().backward()
    var = lambda g: g.var(0).sum().item()  # noqa: E731
    assert var(hybrid) < var(zs.grad.double()) / 3, (var(hybrid), var(zs.grad.double()), r.item())


def tensor_bytes_a_token(path):
    """The stored tensors' bytes (safetensors' headers aside) over the tokens: what a token costs."""
    total, tokens = 0, 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
                tokens += t.numel() if k == "input_ids" else 0
    return total / tokens


def test_sampled_cache_bytes_seeded_draws_from_the_teacher(tiny_model, tmp_path):
    """A sampled cache: 30 bytes a token at N = 12 (top-10: 46), its kind in meta.json, the same
    draws when a shard is computed again; and the draws are the teacher's: the mean share of the
    teacher's most likely token among them is its mean probability."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    common = dict(seq_len=64, max_tokens=64 * 64, batch_size=16, shard_seqs=32)
    topk = build_cache(tiny_model, None, tmp_path / "topk", topk=10, **common)
    sampled = build_cache(tiny_model, None, tmp_path / "sampled", targets="sampled", samples=12, **common)
    assert tensor_bytes_a_token(topk) == 46 and tensor_bytes_a_token(sampled) == 30
    meta = json.loads((Path(sampled) / "meta.json").read_text())
    assert meta["targets"] == "sampled" and meta["samples"] == 12 and meta["bytes_per_token"] <= 64
    assert json.loads((Path(topk) / "meta.json").read_text())["targets"] == "topk"
    a, b = TeacherCache(topk, tok, seq_len=64), TeacherCache(sampled, tok, seq_len=64)
    assert (a.targets, b.targets) == ("topk", "sampled")
    rows = list(range(a.len_split("train")))
    x, y = a.get(rows), b.get(rows)
    assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["entropy"], y["entropy"])
    assert y["sample_ids"].shape == (len(rows), 64, 12)
    share = (y["sample_ids"] == x["topk_ids"][..., 0:1]).float().mean(-1)
    assert abs(share.mean() - x["topk_logprobs"][..., 0].exp().mean()) < 0.02
    # a shard computed again (a killed run's rerun) draws what it drew
    first = Path(sampled) / "train-00000.safetensors"
    before = {k: v.clone() for k, v in y.items() if torch.is_tensor(v)}
    first.unlink()
    (Path(sampled) / "meta.json").unlink()
    build_cache(tiny_model, None, tmp_path / "sampled", targets="sampled", samples=12, **common)
    again = TeacherCache(sampled, tok).get(rows)
    assert all(torch.equal(before[k], again[k]) for k in before)
    with pytest.raises(Exception, match="another"):  # a top-K build into a sampled cache's folder
        build_cache(tiny_model, None, tmp_path / "sampled", topk=10, **common)


def test_hybrid_cache_bytes_and_draws_from_the_rest(tiny_model, tmp_path):
    """A hybrid cache at K = 8, N = 12: 62 bytes a token, its kind in meta.json, the top-K as a top-K
    cache's; its draws never a top-K id, and drawn from the teacher's rest: the mean share of the
    teacher's 9th most likely token among them is its mean probability given the rest, p_9 / r_t."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    common = dict(seq_len=64, max_tokens=64 * 64, batch_size=16, shard_seqs=32)
    top9 = build_cache(tiny_model, None, tmp_path / "top9", topk=9, **common)
    hybrid = build_cache(tiny_model, None, tmp_path / "hybrid", targets="hybrid", topk=8, samples=12,
                         **common)
    assert tensor_bytes_a_token(hybrid) == 62
    meta = json.loads((Path(hybrid) / "meta.json").read_text())
    assert (meta["targets"], meta["topk"], meta["samples"]) == ("hybrid", 8, 12) and meta["bytes_per_token"] <= 64
    a, b = TeacherCache(top9, tok, seq_len=64), TeacherCache(hybrid, tok, seq_len=64, topk=8)
    rows = list(range(a.len_split("train")))
    x, y = a.get(rows), b.get(rows)
    assert y["targets"] == "hybrid" and y["sample_ids"].shape == (len(rows), 64, 12)
    # the top-K as a top-K cache's: the same log-probs, and the same ids but where two stored (fp16)
    # log-probs tie (torch.topk orders equal values arbitrarily: topk(9)[:8] and topk(8) may differ)
    lp = x["topk_logprobs"]
    assert torch.equal(lp[..., :8], y["topk_logprobs"]) and torch.equal(x["entropy"], y["entropy"])
    tie = (lp[..., 1:] == lp[..., :-1]).any(-1)
    assert tie.float().mean() < 0.2 and torch.equal(x["topk_ids"][..., :8][~tie], y["topk_ids"][~tie])
    assert not (y["sample_ids"][..., :, None] == y["topk_ids"][..., None, :]).any()
    p = x["topk_logprobs"].exp()
    given_rest = p[..., 8] / (1 - p[..., :8].sum(-1))
    share = (y["sample_ids"] == x["topk_ids"][..., 8:9]).float().mean(-1)
    assert abs(share.mean() - given_rest.mean()) < 0.02, (share.mean(), given_rest.mean())


# -----------------------------------------------------------------------------
# prune.py with each target: the kind read from the cache, --kd-tail, --kd-full; the fused head (one
# process and two vocabulary-parallel ranks) computes what kd.py does

from test_prune import L, corpus, events, one_line_error, run, run_here, tiny_args  # noqa: E402,F401


def train_losses(out):
    return [e["loss"] for e in events(out, "train")]


@pytest.mark.slow  # a variant of a run the default tests make: a flag's own path
def test_prune_py_with_each_target(make_tiny, corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    import prune
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = make_tiny("llama", L)
    args = lambda out, *extra: tiny_args(model, corpus, tmp_path / out, "--steps", "4", *extra)  # noqa: E731
    prune.main(args("topk"))
    prune.main(args("tail", "--kd-tail"))
    prune.main(args("tail-fused", "--kd-tail", "--logit-chunk", "8"))
    topk, tail = train_losses(tmp_path / "topk"), train_losses(tmp_path / "tail")
    assert tail[0] != pytest.approx(topk[0], rel=1e-3)  # + the rest's term
    assert train_losses(tmp_path / "tail-fused") == pytest.approx(tail, rel=1e-3)
    # validation keeps the cache's own targets (one yardstick): the dense model reads the same
    assert events(tmp_path / "tail", "val")[0]["val_loss"] == events(tmp_path / "topk", "val")[0]["val_loss"]

    # a sampled cache: read as such without a flag, plain and fused
    sampled = build_cache(model, corpus, tmp_path / "sampled-cache", targets="sampled", samples=8, seq_len=32,
                          max_tokens=4096)
    prune.main(args("sampled", "--cache", sampled))
    prune.main(args("sampled-fused", "--cache", sampled, "--logit-chunk", "8"))
    assert train_losses(tmp_path / "sampled-fused") == pytest.approx(train_losses(tmp_path / "sampled"),
                                                                    rel=1e-3)
    meta = json.loads((tmp_path / "sampled" / "model" / "pruning.json").read_text())
    assert meta["flags"]["targets"] == "sampled" and meta["flags"]["samples"] == 8
    one_line_error(args("bad", "--cache", sampled, "--kd-tail"), capsys, "--kd-tail", "sampled")
    # a hybrid cache too, and prune.py building one (--targets hybrid): the same cache
    hybrid = build_cache(model, corpus, tmp_path / "hybrid-cache", targets="hybrid", topk=4, samples=8,
                         seq_len=32, max_tokens=4096)
    prune.main(args("hybrid", "--cache", hybrid))
    prune.main(args("hybrid-fused", "--cache", hybrid, "--logit-chunk", "8"))
    assert train_losses(tmp_path / "hybrid-fused") == pytest.approx(train_losses(tmp_path / "hybrid"),
                                                                   rel=1e-3)
    assert train_losses(tmp_path / "hybrid")[0] != pytest.approx(train_losses(tmp_path / "sampled")[0], rel=1e-3)
    prune.main(args("hybrid-built", "--targets", "hybrid", "--topk", "4", "--samples", "8"))
    built = [json.loads(m.read_text()) for m in (tmp_path / "teacher").glob("*/meta.json")]
    assert [(m["targets"], m["topk"], m["samples"]) for m in built if m.get("samples")] == [("hybrid", 4, 8)]
    one_line_error(args("bad", "--kd-full", "--logit-chunk", "8"), capsys, "--kd-full", "one process")

    # --kd-full: the loss sees the teacher's own logits of the batch, the whole vocabulary
    seen = []
    full = kd.TARGETS["full"]
    monkeypatch.setitem(kd.TARGETS, "full", lambda z, b: seen.append((z.detach(), b)) or full(z, b))
    prune.main(args("full", "--kd-full", "--loss", "kd"))
    from transformers import AutoModelForCausalLM
    teacher = AutoModelForCausalLM.from_pretrained(model).eval()
    want = []
    for z, b in seen[:4]:  # step 1: 4 micro-batches of 1 sequence, its loss their mean
        with torch.no_grad():
            torch.testing.assert_close(b["teacher_logits"], teacher(b["input_ids"]).logits)
        pt, ps = torch.softmax(b["teacher_logits"].double(), -1), torch.softmax(z.double(), -1)
        want.append((pt * (pt.log() - ps.log())).sum(-1).mean().item())
    assert train_losses(tmp_path / "full")[0] == pytest.approx(sum(want) / 4, rel=1e-4)


def test_kd_full_distils_the_teacher_in_the_dtype_that_made_the_cache(make_tiny, corpus, tmp_path, monkeypatch):  # noqa: F811
    """--kd-full is the reference each cached target is measured against, so it must distil the same
    teacher: on a GPU cache_teacher.py runs the teacher in bf16 (meta.json's teacher_dtype), and the
    online teacher beside the student must too (an fp32 one would be a better teacher than the cache's)."""
    import prune
    model = make_tiny("llama", L)
    cache = Path(build_cache(model, corpus, tmp_path / "cache", seq_len=32, max_tokens=4096))
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["teacher_dtype"] == "float32"  # built here, on a CPU
    (cache / "meta.json").write_text(json.dumps({**meta, "teacher_dtype": "bfloat16"}))  # as a GPU's
    seen = []
    full = kd.TARGETS["full"]
    monkeypatch.setitem(kd.TARGETS, "full", lambda z, b: seen.append(b) or full(z, b))
    prune.main(tiny_args(model, corpus, tmp_path / "full", "--steps", "1", "--cache", str(cache),
                         "--kd-full", "--loss", "kd"))
    from transformers import AutoModelForCausalLM
    teacher = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        torch.testing.assert_close(seen[0]["teacher_logits"], teacher(seen[0]["input_ids"]).logits)


# two ranks (slow): the default run has one process with each target and two ranks with the top-K
@pytest.mark.slow
@pytest.mark.parametrize("targets", ["sampled", "hybrid"])
def test_two_ranks_with_a_sampled_cache_match_one_process(make_tiny, corpus, tmp_path, monkeypatch, targets):  # noqa: F811
    """Two FSDP2 ranks (the vocabulary-parallel head fused with the loss) against one process on the
    plain logits path, over a sampled (or hybrid) cache: the same losses."""
    model = make_tiny("llama", L)
    sampled = build_cache(model, corpus, tmp_path / "sampled-cache", targets=targets, samples=8, seq_len=32,
                          max_tokens=4096, topk=4)
    args = lambda out: tiny_args(model, corpus, tmp_path / out, "--steps", "4", "--cache", sampled)  # noqa: E731
    run_here(args("one"), tmp_path, monkeypatch)
    run(args("two"), tmp_path, nproc=2)
    assert train_losses(tmp_path / "two") == pytest.approx(train_losses(tmp_path / "one"), rel=1e-3)
    assert events(tmp_path / "two", "pruned")[0]["kept"] == events(tmp_path / "one", "pruned")[0]["kept"]


def test_target_noise_variances_match_draws_and_the_bias_is_top_ks_alone():
    """experiments/target_noise.py's added variances E||q - p_t||^2 of the sampled and hybrid targets
    against 40,000 sets of draws made here (the hybrid's off the top-K, weighted by r), and top-K's
    bias ||r p_s - p_t,off||^2 against its expected gradient minus the full KL's written out."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    from target_noise import HYBRID, SAMPLED, teacher_terms, top_k_bias
    g = torch.Generator().manual_seed(0)
    p_t = torch.softmax(torch.randn(1, 40, generator=g, dtype=torch.float64) * 2, -1)
    terms, R = teacher_terms(p_t), 40_000
    for n in SAMPLED:
        q = torch.multinomial(p_t[0], R * n, replacement=True, generator=g).view(R, n)
        q = torch.zeros(R, 40, dtype=torch.float64).scatter_add_(1, q, torch.ones(R, n, dtype=torch.float64)) / n
        mc = ((q - p_t) ** 2).sum(-1)
        assert terms[f"sampled N={n}"].item() == pytest.approx(mc.mean().item(), abs=5 * mc.std().item() / R ** 0.5)
    for k, n in HYBRID:
        top = p_t[0].topk(k).indices
        off = p_t[0].scatter(0, top, 0.0)
        r = off.sum()
        x = torch.multinomial(off / r, R * n, replacement=True, generator=g).view(R, n)
        q = p_t[0] - off + r * torch.zeros(R, 40, dtype=torch.float64).scatter_add_(
            1, x, torch.ones(R, n, dtype=torch.float64)) / n
        mc = ((q - p_t) ** 2).sum(-1)
        assert terms[f"hybrid K={k} N={n}"].item() == pytest.approx(mc.mean().item(), abs=5 * mc.std().item() / R ** 0.5)
    p_s = torch.softmax(torch.randn(1, 40, generator=g, dtype=torch.float64), -1)
    top = p_t[0].topk(10).indices
    grad_topk = p_t[0, top].sum() * p_s[0] - torch.zeros(40, dtype=torch.float64).index_add_(0, top, p_t[0, top])
    assert top_k_bias(p_s, p_t).item() == pytest.approx(((grad_topk - (p_s[0] - p_t[0])) ** 2).sum().item(), rel=1e-12)
    assert top_k_bias(p_t, p_t).item() > 0  # biased even at the teacher
