"""--assistant-only (cache_teacher.py, prune.py): on a chat corpus the loss counts only the positions
whose next token is the assistant's. The tokens told against ChatML written out by hand, piece by
piece; the mask stored with the cache; user and system turns get exactly no gradient, plain and
fused; the loss is the mean over the assistant's positions alone, in float64; prune.py reads the
mask from the cache without a flag; a template that rewrites earlier turns is refused in one line."""
import json

import pytest
import torch

import cache_teacher as data
import kd
from cache_teacher import TeacherCache, build_cache
from runtime import E3Error
from scale.fused_loss import head_kd_loss, next_token_targets
from test_data import sentences

SYSTEM = "you are a player"


@pytest.fixture(autouse=True)
def token_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "TOKEN_DIR", tmp_path / "tokens")


def chats(n, seed=0):
    """n conversations: a system line, then one to three user/assistant exchanges."""
    words = sentences(4 * n, seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": SYSTEM}]
        for j in range(1 + i % 3):
            turns += [{"role": "user", "content": words[(4 * i + 2 * j) % len(words)]},
                      {"role": "assistant", "content": words[(4 * i + 2 * j + 1) % len(words)]}]
        out.append(turns)
    return out


def chatml_by_hand(tok, conversation):
    """SmolLM2's template (ChatML) written out piece by piece: (ids, 1 where the token is the
    assistant's reply or its end-of-turn marker, else 0)."""
    ids, targets = [], []
    for m in conversation:
        head = f"<|im_start|>{m['role']}\n"
        pieces = [(head, 0), (m["content"] + "<|im_end|>\n", int(m["role"] == "assistant"))]
        for text, target in pieces:
            piece = tok(text, add_special_tokens=False)["input_ids"]
            ids, targets = ids + piece, targets + [target] * len(piece)
    return ids, targets


def write_corpus(path, conversations, texts=()):
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
        for t in texts:  # plain text counts whole
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


def test_the_assistants_tokens_are_chatmls_by_hand(tokenizer, tmp_path):
    convs, texts = chats(12), sentences(3, seed=1)
    path = write_corpus(tmp_path / "chat.jsonl", convs, texts)
    tokens = data.token_file(tokenizer, path, "text", None, assistant_only=True)
    ids, targets = [], []
    for c in convs:
        a, b = chatml_by_hand(tokenizer, c)
        ids, targets = ids + a, targets + b
    for t in texts:
        a = tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]
        ids, targets = ids + a, targets + [1] * len(a)
    assert tokens.read(0, tokens.n_tokens).tolist() == ids  # the same tokens as the template's
    stored = (tokens.folder / "mask.bin").read_bytes()
    assert list(stored) == targets
    assert 0.2 < sum(targets[:-3 * 20]) / len(targets) < 0.8  # both kinds present
    # the loss mask of a block: position i counts where token i + 1 is a target
    from scale.data import stored_mask
    blocks = data.Blocks(tokens, 0, tokens.n_tokens // 16, 16)
    mask = stored_mask(blocks, range(3, 7))["loss_mask"]
    want = torch.tensor(targets[3 * 16 + 1:7 * 16 + 1], dtype=torch.bool).view(4, 16)
    assert torch.equal(mask, want)
    # without --assistant-only: another token file, the same ids, no mask
    plain = data.token_file(tokenizer, path, "text", None)
    assert plain.folder != tokens.folder and not (plain.folder / "mask.bin").exists()
    assert torch.equal(plain.read(0, plain.n_tokens), tokens.read(0, tokens.n_tokens))
    assert stored_mask(data.Blocks(plain, 0, 4, 16), range(0, 4)) == {}


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer, tmp_path):
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    # the conversation's length at its head: a prefix renders another head
    tok.chat_template = ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_corpus(tmp_path / "chat.jsonl", chats(2))
    with pytest.raises(E3Error, match="rewrites earlier turns"):
        data.token_file(tok, path, "text", None, assistant_only=True)
    data.token_file(tok, path, "text", None)  # every token counting: no prefixes needed


@pytest.fixture(scope="module")
def chat_cache(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    path = write_corpus(tmp / "chat.jsonl", chats(300))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(data, "TOKEN_DIR", tmp / "tokens")
        cache = build_cache(tiny_model, path, tmp / "cache", topk=8, seq_len=32, max_tokens=32 * 16,
                            shard_seqs=8, assistant_only=True, max_val_tokens=32 * 4)
    return path, cache


def reference_positions(tok, path, cache):
    """Which positions of the cache's training rows count, from ChatML by hand (token i + 1 a
    target), and the rows' ids to check it against."""
    ids, targets = [], []
    for line in open(path):
        a, b = chatml_by_hand(tok, json.loads(line)["messages"])
        ids, targets = ids + a, targets + b
    n = cache.len_split("train") * cache.seq_len
    return (torch.tensor(ids[:n]).view(-1, cache.seq_len),
            torch.tensor(targets[1:n + 1], dtype=torch.bool).view(-1, cache.seq_len))


def test_user_turns_get_no_gradient(tiny_model, tokenizer, chat_cache):
    path, cache_path = chat_cache
    cache = TeacherCache(cache_path, tokenizer)
    assert cache.meta["assistant_only"] is True
    rows = list(range(cache.len_split("train")))
    batch = cache.get(rows)
    ids, counts = reference_positions(tokenizer, path, cache)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["loss_mask"], counts)
    assert 0 < counts.float().mean() < 1
    only = cache.get(rows[::-1], keys=("loss_mask",))  # the step's weights read the mask alone
    assert set(only) == {"loss_mask", "targets"} and torch.equal(only["loss_mask"], counts.flip(0))
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():  # a student other than the teacher: its last hidden state moved
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
        hidden = hidden + 0.5 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(0))
        logits = model.lm_head(hidden)
    V = len(tokenizer)
    for kind in ("kd", "akd", "sft"):
        z = logits[..., :V].clone().requires_grad_()
        loss = kd.LOSSES[kind](z, batch)
        loss.backward()
        # the reference: the per-position loss in float64, averaged over the counted positions
        logp_s = torch.log_softmax(z.detach().double(), -1)
        if kind == "sft":
            per = -logp_s[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
            where = counts[:, :-1]
        else:
            lp = batch["topk_logprobs"].double()
            per = (lp.exp() * (lp - logp_s.gather(-1, batch["topk_ids"]))).sum(-1)
            per = per * (batch["entropy"].double() if kind == "akd" else 1)
            where = counts
        assert loss.item() == pytest.approx(per[where].mean().item(), rel=1e-5), kind
        grad = z.grad.abs().sum(-1)
        silent = ~where if kind != "sft" else torch.cat([~where, torch.ones_like(where[:, :1])], 1)
        assert grad[silent].max() == 0, kind  # user and system turns: exactly no gradient
        assert (grad[where if kind != "sft" else torch.cat([where, where[:, :1] & False], 1)]
                > 0).all(), kind
        # the fused head (scale/fused_loss.py): the same loss, the same silent positions
        h = hidden.clone().requires_grad_()
        if kind == "sft":
            t_ids, t_lp, mask = next_token_targets(batch["input_ids"], None, batch["loss_mask"])
            entropy = None
        else:
            t_ids, t_lp, mask = batch["topk_ids"], batch["topk_logprobs"], kd.positions(batch)
            entropy = batch["entropy"] if kind == "akd" else None
        fused = head_kd_loss(h, model.lm_head.weight, None, t_ids, t_lp, entropy, mask, None, V, 16)
        assert fused.item() == pytest.approx(loss.item(), rel=1e-4), kind
        fused.backward()
        assert h.grad.abs().sum(-1)[silent].max() == 0, kind


def test_prune_py_reads_the_mask_from_the_cache(make_tiny, tmp_path, monkeypatch):
    import prune
    from test_prune import events
    monkeypatch.setattr(prune, "TEACHER_CACHE_DIR", tmp_path / "teacher")
    model = make_tiny("llama", 6)
    path = write_corpus(tmp_path / "chat.jsonl", chats(400))
    common = ["--model", model, "--keep", "4", "--data", path, "--seq-len", "32", "--batch-size",
              "4", "--micro-batch", "2", "--steps", "4", "--n-calib", "2", "--warmup", "1"]
    prune.main(common + ["--out", str(tmp_path / "mixed")])
    prune.main(common + ["--out", str(tmp_path / "plain"), "--assistant-only"])
    prune.main(common + ["--out", str(tmp_path / "fused"), "--assistant-only", "--logit-chunk", "8"])
    losses = {r: [e["loss"] for e in events(tmp_path / r, "train")] for r in ("mixed", "plain",
                                                                              "fused")}
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-3)
    assert losses["plain"][0] != pytest.approx(losses["mixed"][0], rel=1e-3)  # fewer positions
    flags = json.loads((tmp_path / "plain" / "model" / "pruning.json").read_text())["flags"]
    assert flags["assistant_only"] is True


def test_a_step_is_the_mean_over_its_counted_positions():
    """Micro-batches of a step count different numbers of assistant positions: weighted by
    scale.data.micro_batch_weights, their means add up to the mean over all the step's counted
    positions, written out in float64 (a plain mean of their means does not)."""
    from scale.data import micro_batch_weights
    g = torch.Generator().manual_seed(0)
    density = torch.tensor([0.05, 0.9, 0.5, 0.2, 0.7, 0.1, 0.95, 0.3])[:, None]
    mask = torch.rand(8, 16, generator=g) < density  # rows far apart in how many count
    per_token = torch.rand(8, 16, generator=g, dtype=torch.float64) * 5

    class Source:
        def get(self, rows, keys=None):
            assert keys == ("loss_mask",)  # the weights read the mask alone
            return {"loss_mask": mask[rows]}
    for kind, counted, values in (("kd", mask, per_token),
                                  ("sft", mask[:, :-1], per_token[:, :-1])):
        weights = micro_batch_weights(Source(), list(range(8)), 4, kind, world=1)
        means = [kd.masked_mean(values[2 * m:2 * m + 2], counted[2 * m:2 * m + 2]) for m in range(4)]
        step = sum(w * x for w, x in zip(weights, means))
        assert step.item() == pytest.approx(values[counted].mean().item(), rel=1e-12), kind
        assert sum(means).item() / 4 != pytest.approx(values[counted].mean().item(), rel=1e-2)


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_two_ranks_with_an_assistant_only_cache_match_one_process(make_tiny, tmp_path):
    """Two FSDP2 ranks (the vocabulary-parallel head fused with the loss) against one process on
    the plain logits path, over an --assistant-only cache: the same losses (the step's mean over
    both ranks' counted positions)."""
    from test_prune import events, run
    model = make_tiny("llama", 6)
    path = write_corpus(tmp_path / "chat.jsonl", chats(400))
    cache = build_cache(model, path, tmp_path / "cache", topk=8, seq_len=32, max_tokens=32 * 64,
                        assistant_only=True)
    for out, n in (("one", 1), ("two", 2)):
        run(["--model", model, "--keep", "4", "--cache", cache, "--batch-size", "8",
             "--micro-batch", "2", "--steps", "4", "--n-calib", "2", "--warmup", "1", "--out",
             str(tmp_path / out)], tmp_path, nproc=n)
    losses = {out: [e["loss"] for e in events(tmp_path / out, "train")] for out in ("one", "two")}
    assert losses["two"] == pytest.approx(losses["one"], rel=1e-3)


def test_validation_is_the_mean_over_the_counted_positions(tiny_model, tokenizer, chat_cache):
    """prune.validate over an --assistant-only cache, one row a micro-batch (rows far apart in how
    many positions count): kd and CE are the means over every counted position of the val split,
    written out in float64 from the model's logits, not the mean of the rows' means."""
    import types

    import prune
    from transformers import AutoModelForCausalLM
    cache = TeacherCache(chat_cache[1], tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():  # a student other than the teacher: its head moved
        model.lm_head.weight += 0.1 * torch.randn(model.lm_head.weight.shape,
                                                  generator=torch.Generator().manual_seed(0))
    V, n = len(tokenizer), cache.len_split("val")
    batch = cache.get(list(range(n)), "val")
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["input_ids"]).logits[..., :V].double(), -1)
    where = batch["loss_mask"]
    lp = batch["topk_logprobs"].double()
    kd_ref = (lp.exp() * (lp - logp.gather(-1, batch["topk_ids"]))).sum(-1)[where].mean().item()
    nll = -logp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    ce_ref = nll[where[:, :-1]].mean().item()
    counts = where.sum(-1)
    assert n >= 3 and counts.max() > 1.5 * counts.min()  # a mean of row means would differ
    args = types.SimpleNamespace(micro_batch=1, device="cpu")
    got = prune.validate(model, cache, prune.plain_losses(V), args)
    assert got == pytest.approx([kd_ref, ce_ref], rel=1e-5)
