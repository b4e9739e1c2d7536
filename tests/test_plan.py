"""scale/plan.py, the numbers behind prune.py --plan: against counts written out by hand here (the
parameters from the shapes, the FLOPs, the bytes), never against the code under test. The configs
are written as dicts: nothing downloads."""
import math

import pytest
import torch

import prune
from scale import plan as P
from scale.fsdp import meta_model
from surgery import decoder_layers

LLAMA2_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                 tie_word_embeddings=False)
QWEN3_32B = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, intermediate_size=25600, vocab_size=151936,
                 tie_word_embeddings=False)
SEQ, BATCH, T, T_M = 4096, 128, 1200, 120  # the paper's: 1200 steps of 128 x 4096, a 10% search
MiB = 2**20
H100, H200 = 0.9 * 81_559 * MiB, 0.9 * 143_771 * MiB  # usable: 90% of what the cards report
resolve = prune.resolve_args  # T, T_M, the logit chunk for L, ranks


def planned(tmp_path, config, keep, ranks, *flags):
    from transformers import AutoConfig
    cfg = dict(config)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp_path)
    args = prune.parse_args(["--model", str(tmp_path), "--keep", str(keep), "--plan", str(ranks),
                             *flags])
    model, _ = meta_model(args)
    L = len(decoder_layers(model))
    resolve(args, ranks)
    return args, model, L, P.plan(args, model, L, ranks, measured={})[1]


def llama2_counts():
    d, I, V, L = 4096, 11008, 32000, 32
    layer = 4 * d * d + 3 * d * I  # q, k, v, o; gate, up, down
    params = L * (layer + 2 * d) + 2 * V * d + d  # + 2 norms a layer, embedding, head, final norm
    return d, I, V, L, layer, params


def test_llama2_7b_on_8_ranks(tmp_path):
    args, model, L, s = planned(tmp_path, LLAMA2_7B, 13, 8)
    d, I, V, L, layer, params = llama2_counts()
    assert s["params"] == params == 6_738_415_616
    tokens = T * BATCH * SEQ
    assert s["tokens"] == tokens == 629_145_600

    def train_per_token(n):  # 6 x (n layers' matmuls + the head) + 12 n s a, a = 32 x 128 = d
        return 6 * (n * layer + V * d) + 12 * n * SEQ * d
    search, after = T_M * BATCH * SEQ, (T - T_M) * BATCH * SEQ
    train = search * train_per_token(32) + after * train_per_token(13)
    cache = tokens * (2 * (32 * layer + V * d) + 4 * 32 * SEQ * d)
    assert s["train_flops"] == pytest.approx(train, rel=1e-12)
    assert s["cache_flops"] == pytest.approx(cache, rel=1e-12)
    assert train == pytest.approx(1.3765e19, rel=1e-4) and cache == pytest.approx(9.6647e18, rel=1e-4)

    def total(m, chunk):  # bytes a rank at micro-batch m, no checkpointing (bf16 residual, FSDP2)
        # a token and layer, compiled (a plan's default), in the search: each norm's bf16 input (the
        # second's recomputed from the attention's bf16 output) and its fp32 1 / rms; q and k after
        # RoPE, v and SDPA's output (q = k = d here) and its fp32 log-sum-exp a head; the MLP's gate,
        # SiLU(gate), up and their product; the output of eq. 1's gate
        act = (2 * d + 2 * d + 8) + 2 * (2 * d + 2 * d) + 4 * 32 + 4 * 2 * I + 2 * d  # 145,544 B
        # the fused head's chunk: `chunk` tokens of each of the 8 ranks x its 4,000 rows, 16 B each
        return (16 * params / 8 + m * SEQ * 32 * act + 10 * (layer + 2 * d) + 6 * 8 * m * SEQ * d
                + 16 * chunk * 8 * 4000 + m * SEQ * (8 + 12 * 10 + 4))
    # the micro-batch divides 128 / 8 = 16: 2 fits, 4 does not even at the least chunk; the chunk
    # is then the largest up to half the micro-batch's 8,192 tokens
    assert total(2, 4096) <= H100 < total(4, 256)
    assert (s["micro_batch"], s["activation_checkpointing"], s["fits"]) == (2, "none", True)
    assert s["logit_chunk"] == 4096
    assert s["gb_per_rank"] == pytest.approx(total(2, 4096) / 1e9, abs=0.006)
    h200 = s["by_kind"]["H200"]
    assert (h200["micro_batch"], h200["logit_chunk"]) == (4, 8192)
    assert total(4, 8192) <= H200 < total(8, 256)
    # at the assumed 34% MFU of 989 TFLOP/s a GPU, on 8 of them
    assert s["hours"]["H100"] == pytest.approx((train + cache) / 0.34 / (8 * 989e12) / 3600, abs=1e-3)
    assert s["hours"]["A100"] == pytest.approx((train + cache) / 0.34 / (8 * 312e12) / 3600, abs=1e-3)
    assert s["gpu_hours"]["H100"] == pytest.approx(8 * s["hours"]["H100"], abs=0.01)


def test_qwen3_32b_on_8_ranks(tmp_path):
    args, model, L, s = planned(tmp_path, QWEN3_32B, 48, 8)
    d, I, V, H, hd, kv = 5120, 25600, 151936, 64, 128, 8
    q, k = H * hd, kv * hd  # 8192, 1024: the attention is wider than the hidden size
    layer = d * q + 2 * d * k + q * d + 3 * d * I
    layer_params = layer + 2 * d + 2 * hd  # + the two norms and q/k's norms
    params = 64 * layer_params + 2 * V * d + d
    assert s["params"] == params == 32_762_123_264
    tokens = T * BATCH * SEQ
    search, after = T_M * BATCH * SEQ, (T - T_M) * BATCH * SEQ

    def train_per_token(n):
        return 6 * (n * layer + V * d) + 12 * n * SEQ * q
    train = search * train_per_token(64) + after * train_per_token(48)
    assert s["train_flops"] == pytest.approx(train, rel=1e-12)
    assert s["cache_flops"] == pytest.approx(tokens * (2 * (64 * layer + V * d) + 4 * 64 * SEQ * q),
                                             rel=1e-12)

    # a token and layer, compiled: as Llama's (test above), + q's and k's norms a head: the
    # projections' bf16 outputs and 1 / rms (the rest recomputed); the search's gate (2 d) on top
    none = (2 * d + 2 * d + 8) + 2 * (q + k) + 4 * (H + kv) + 2 * (2 * q + 2 * k) + 4 * H + 8 * I
    # the layer's bf16 input, the bf16 outputs of q, k, v, o, gate, up (down's: nothing needs it
    # once compiled), SDPA's and its LSE
    selective = 2 * d + 2 * q + 2 * k + 2 * k + 2 * d + 2 * I + 2 * I + 2 * q + 4 * H + 2 * d
    full = 2 * d + 2 * d
    none, recompute = none + 2 * d, none  # the search's; a recomputed layer has no gate output

    def total(ranks, m, act, recompute, chunk):
        return (16 * params / ranks + m * SEQ * (64 * act + recompute) + 10 * layer_params
                + 6 * ranks * m * SEQ * d + 16 * chunk * ranks * math.ceil(V / ranks) + m * SEQ * 132)
    # 8 H100s: not even one sequence with full checkpointing and the least chunk (the search's gates
    # keep 64 layers' outputs beside the checkpoints' inputs); the plan names LoRA and 16 ranks
    assert total(8, 1, full, recompute, 256) > H100
    assert (s["fits"], s["micro_batch"], s["min_ranks"]) == (False, None, 16)
    assert s["gb_per_rank"] == pytest.approx(total(8, 1, full, recompute, 256) / 1e9, abs=0.006)
    assert s["lora"]["lora_rank"] == 16 and s["lora"]["gb_per_rank"] <= H100 / 1e9
    # 8 H200s: no checkpointing does not fit, selective with 1 sequence does (2 do not)
    assert total(8, 1, none, 0, 256) > H200
    assert total(8, 1, selective, recompute, 2048) <= H200 < total(8, 2, selective, recompute, 256)
    h200 = s["by_kind"]["H200"]
    assert (h200["micro_batch"], h200["activation_checkpointing"], h200["logit_chunk"]) == (
        1, "selective", 2048)
    assert h200["gb_per_rank"] == pytest.approx(total(8, 1, selective, recompute, 2048) / 1e9, abs=0.006)
    # 4 H100s: nothing fits; the plan names what does
    s4 = P.plan(*planned(tmp_path, QWEN3_32B, 48, 4)[:3], 4, measured={})[1]
    assert total(4, 1, full, recompute, 256) > H100 and s4["fits"] is False
    assert s4["min_ranks"] == 16


def one_process(d, I, V, L, layer, params, m, act, recompute, unit_layers, trainable=True):
    """Bytes of a one-process run (the plain head): fp32 residual (4 B) under autocast."""
    return ((16 if trainable else 4) * params + m * SEQ * (L * act + recompute)
            + 2 * (unit_layers * layer + V * d) + 16 * m * SEQ * V + m * SEQ * 132)


def test_llama2_7b_on_one_gpu(tmp_path):
    """Llama-2-7B -> 13 on one GPU: an H200 holds it (run on one: experiments/gpu_check); an 80 GB
    card does not, and the plan names what does: LoRA or 2 ranks."""
    args, model, L, s = planned(tmp_path, LLAMA2_7B, 13, 1)
    d, I, V, L, layer, params = llama2_counts()
    h = 32
    # a token and layer, one process (fp32 residual, bf16 matmuls by autocast), compiled: the first
    # norm's fp32 input, the second's recomputed from the attention's bf16 output, two 1 / rms; q and
    # k after RoPE, v, SDPA's output (q = k = d), its LSE; the MLP's four; the search's gate output
    recompute = (4 * d + 2 * d + 8) + 2 * (2 * d + 2 * d) + 4 * h + 8 * I  # 145,544 B
    none = recompute + 4 * d  # 161,928 B
    # the input, q k v o's and gate's and up's outputs (down's: nothing needs it once compiled),
    # SDPA's with its LSE, + the gate's output
    selective = 4 * d + 2 * (3 * d + d) + 2 * d + 4 * h + 2 * 2 * I + 4 * d  # 117,888 B
    full = 4 * d + 4 * d
    assert (recompute, none, selective) == (145_544, 161_928, 117_888)
    # compiled (a GPU's default): autocast's bf16 weight copies made inside each layer's graph,
    # one layer's and the head's at a time
    fits = one_process(d, I, V, L, layer, params, 1, none, 0, 1)
    assert one_process(d, I, V, L, layer, params, 2, selective, recompute, 1) > H200 >= fits
    h200 = s["by_kind"]["H200"]
    assert (h200["fits"], h200["micro_batch"], h200["activation_checkpointing"]) == (
        True, 1, "none")
    assert h200["gb_per_rank"] == pytest.approx(fits / 1e9, abs=0.006)
    assert s["compile"] is True and h200["hours"] > 0
    # one H100: 16 B a parameter is 108 GB alone; LoRA (4 B a frozen one) or 2 ranks
    assert 16 * params > H100
    assert (s["fits"], s["min_ranks"], s["micro_batch"]) == (False, 2, None)
    smallest = one_process(d, I, V, L, layer, params, 1, full, recompute, 1)
    assert s["gb_per_rank"] == pytest.approx(smallest / 1e9, abs=0.006)
    adapters = L * 16 * (4 * (d + d) + 2 * (d + I) + (I + d))  # rank 16 on all seven linears
    lora = one_process(d, I, V, L, layer, params, 2, none, 0, 1, trainable=False) + 16 * adapters
    assert one_process(d, I, V, L, layer, params, 4, none, 0, 1, trainable=False) > H100
    assert s["lora"] == {"lora_rank": 16, "micro_batch": 2, "activation_checkpointing": "none",
                         "gb_per_rank": pytest.approx(lora / 1e9, abs=0.006)}
    lines = P.plan(args, model, L, 1, measured={})[0]
    verdict = next(line for line in lines if "on H100" in line)
    assert "nothing fits 1 rank(s)" in verdict and "--lora-rank 16" in verdict and "2 ranks" in verdict


@pytest.mark.parametrize("flags, measured_gb", [
    (("--activation-checkpointing", "selective"), 124.45),  # gpu_check: prune.py's search steps
    (("--activation-checkpointing", "full"), 112.04),  # the bench: a step without the gates
    (("--activation-checkpointing", "full", "--no-compile"), 123.75)])
def test_one_gpu_memory_against_the_h200_measurements(tmp_path, flags, measured_gb):
    """Llama-2-7B whole on one H200, one sequence of 4,096, one process: the peak allocated by
    prune.py's own search steps at the plan's pick (experiments/gpu_check/h200-7b.json: 124.45 GB,
    selective, compiled) and by the bench's training steps (experiments/gpu_bench.json: full
    checkpointing, 112.04 GB compiled, 123.75 eager); the plan's figure within 10% of each."""
    args, model, L, s = planned(tmp_path, LLAMA2_7B, 13, 1, "--micro-batch", "1", *flags)
    gb = s["by_kind"]["H200"]["gb_per_rank"]
    assert gb == pytest.approx(measured_gb, rel=0.1)


def test_the_activation_model_matches_the_bench_probe():
    """experiments/gpu_bench.py --activations on one H200 (7b8: Llama-2-7B's layers, one sequence
    of 4,096 tokens, one process): 326,280, 109,696 and 16,384 bytes a token and layer without,
    with selective and with full checkpointing; the model within 10% (here: to the byte)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(LLAMA2_7B, num_hidden_layers=8)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    for mode, measured in ("none", 326_280), ("selective", 109_696), ("full", 16_384):
        assert P.probe_bytes(model, mode, False, 4096) == pytest.approx(measured, rel=0.1)
        assert P.probe_bytes(model, mode, False, 4096) == pytest.approx(measured, abs=1)
    # FSDP2 over one GPU (bf16 residual and matmuls, no autocast copies): 186,504 and 101,504
    # (under full checkpointing the probe measured nothing: the deeper model left less allocated)
    for mode, measured in ("none", 186_504), ("selective", 101_504):
        assert P.probe_bytes(model, mode, True, 4096) == pytest.approx(measured, abs=1)


def test_the_fused_heads_chunk():
    """Powers of two from half a micro-batch's tokens down to 256; a tiny micro-batch: its half."""
    assert P.chunk_sizes(4096) == [2048, 1024, 512, 256]
    assert P.chunk_sizes(8192)[0] == 4096 and P.chunk_sizes(5000)[0] == 2048
    assert P.chunk_sizes(64) == [32]


def test_the_capacity_is_read_from_the_device(tmp_path, monkeypatch):
    """With CUDA, the plan adds this GPU at its free memory (torch.cuda.mem_get_info), and a run
    picks for it: Llama-2-7B -> 13 on a free H200 is one sequence, none; on 80 GB free nothing
    fits (one sequence, full checkpointing, warned)."""
    free = {"bytes": 143_771 * MiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free["bytes"], 143_771 * MiB))
    args, model, L, s = planned(tmp_path, LLAMA2_7B, 13, 1)
    here = s["by_kind"]["this GPU (NVIDIA H200)"]
    assert (here["fits"], here["micro_batch"], here["activation_checkpointing"]) == (
        True, 1, "none")
    assert here["hours"] == s["hours"]["H200"]  # its peak by name
    args.plan = None
    args.micro_batch = args.activation_checkpointing = None
    P.pick_for_card(args, 1)
    assert (args.micro_batch, args.activation_checkpointing, args.logit_chunk) == (1, "none", 0)
    free["bytes"] = 80e9
    args.micro_batch = args.activation_checkpointing = None
    P.pick_for_card(args, 1)
    assert (args.micro_batch, args.activation_checkpointing) == (1, "full")


def test_compile_is_on_by_default_on_a_gpu(tmp_path, monkeypatch):
    """--compile: on where CUDA is (and in a plan, made for GPUs), off on a CPU; --no-compile and
    --compile win."""
    base = ["--model", "m", "--keep", "1", "--micro-batch", "1", "--activation-checkpointing", "none"]

    def compiled(*flags):
        args = prune.parse_args(base + list(flags))
        prune.resolve_args(args, 1)
        return args.compile
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (compiled(), compiled("--compile"), compiled("--plan", "8")) == (False, True, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (compiled(), compiled("--no-compile")) == (True, False)


def test_the_bench_sets_the_mfu(tmp_path):
    """The bench's MFU of the plan's path (FSDP2, compiled, 7b8) and the teacher's set the hours;
    its activation probes do not scale the formula (fitted to no measurement: the probes check it)."""
    args, model, L, _ = planned(tmp_path, LLAMA2_7B, 13, 8)
    bench = {"device": "NVIDIA H100 80GB HBM3",
             "activations": {"fsdp": {"none": {"measured": 340240, "formula": 170120}}},
             "runs": [{"shape": "7b8", "path": "fsdp", "compile": True, "ac": "none", "mfu": 0.5},
                      {"shape": "7b8", "path": "fsdp", "compile": False, "ac": "none", "mfu": 0.4},
                      {"shape": "7b8", "path": "teacher", "mfu": 0.6}]}
    lines, s = P.plan(args, model, L, 8, measured=bench)
    assert s["activation_bytes"] == P.plan(args, model, L, 8, measured={})[1]["activation_bytes"]
    train, cache = s["train_flops"], s["cache_flops"]
    assert s["hours"]["H100"] == pytest.approx((train / 0.5 + cache / 0.6) / (8 * 989e12) / 3600,
                                               abs=1e-3)
    assert any("measured on NVIDIA H100 80GB HBM3" in line for line in lines)


def test_routed_experts_count_at_their_share():
    """A MoE layer's 3-D expert weights count top-k / experts of their size (a token visits top-k)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_experts=8,
                               num_experts_per_tok=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64  # q, k, v, o
    experts = 8 * 3 * 64 * 32 * 2 / 8  # gate_up and down of 8 experts, 2 visited
    router = 8 * 64
    per_token = 6 * (2 * (attn + experts + router) + 1000 * 64) + 12 * 2 * 16 * 64
    assert P.flops_per_token(model, 16) == pytest.approx(per_token)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None), (None, None)])
def test_peak_by_device_name(name, peak):
    assert P.peak_flops(name) == peak


def test_prune_py_plan_ends_with_one_json_object(tmp_path):
    """`prune.py --model M --keep 13 --plan 8` from config.json alone: its last line is the summary,
    against the hand count of Llama-2-7B (params, tokens, FLOPs) and the keys a user scripts on."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    from transformers import AutoConfig
    cfg = dict(LLAMA2_7B)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp_path)
    root = Path(prune.__file__).resolve().parent
    r = subprocess.run([sys.executable, str(root / "prune.py"), "--model", str(tmp_path), "--keep",
                        "13", "--plan", "8"], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    d, I, V, L, layer, params = llama2_counts()
    assert s["params"] == params and s["tokens"] == T * BATCH * SEQ
    train = BATCH * SEQ * (T_M * (6 * (L * layer + V * d) + 12 * L * SEQ * d)
                           + (T - T_M) * (6 * (13 * layer + V * d) + 12 * 13 * SEQ * d))
    assert s["train_flops"] == pytest.approx(train, rel=1e-12)
    assert s["micro_batch"] >= 1 and s["activation_checkpointing"] in ("none", "selective", "full")
    assert set(s["hours"]) == {"H100", "H200", "A100"} and s["gb_per_rank"] < 80
    assert s["mfu"] and s["cache_flops"] > 0


def test_a_gpu_run_keeps_a_micro_batch_or_checkpointing_it_was_given(tmp_path, monkeypatch):
    """On a GPU an unset --micro-batch / --activation-checkpointing takes the plan's pick for the
    card; a value given is kept, even where the plan's estimate says nothing fits (Qwen3-32B x 8 on
    cards with 80 GB free: above, 76.0 GB at micro-batch 1 with full checkpointing)."""
    args, model, L, _ = planned(tmp_path, QWEN3_32B, 48, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80e9, 81_559 * MiB))
    args.plan = None
    args.micro_batch, args.activation_checkpointing = 2, None
    P.pick_for_card(args, 8)
    assert (args.micro_batch, args.activation_checkpointing) == (2, "full")
    args.micro_batch, args.activation_checkpointing = None, "selective"
    P.pick_for_card(args, 8)
    assert (args.micro_batch, args.activation_checkpointing) == (1, "selective")


def test_a_plan_for_a_given_cache_takes_its_sequence_length_and_targets(tmp_path, capsys):
    """`prune.py --cache C --plan N` (the README's two-step workflow): the cache's meta.json fixes the
    sequence length and the targets, as it does for the run itself (its command line run in this
    process; the test above runs one as a process of its own)."""
    import json
    from transformers import AutoConfig
    cfg = dict(LLAMA2_7B)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp_path / "m")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "meta.json").write_text(json.dumps({"seq_len": 2048, "topk": 16, "targets": "topk"}))
    prune.main(["--model", str(tmp_path / "m"), "--keep", "13", "--cache", str(tmp_path / "c"),
                "--plan", "8", "--steps", "10"])
    out = capsys.readouterr().out
    assert "128 x 2048 tokens a step" in out
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == 10 * 128 * 2048


@pytest.mark.parametrize("flags, micro", [(("--search-batch-size", "96"), 32),
                                          (("--masks-per-step", "4"), 32)])
def test_the_cards_micro_batch_divides_every_batch_the_run_uses(tmp_path, monkeypatch, flags, micro):
    """On a GPU the plan picks the micro-batch; it must run every step: divide the search's batch
    as well as the fine-tune's, and give each of --masks-per-step draws its share of a search
    step's micro-batches. A small Llama at 32 tokens, 80 GB free: memory allows all 128 sequences
    at once, so the pick is the largest that divides both 128 and 96 (gcd 32), or that leaves a
    search step 4 micro-batches for 4 draws (128 / 4 = 32)."""
    from transformers import AutoConfig
    AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, vocab_size=1000).save_pretrained(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80e9, 81_559 * MiB))
    args = prune.parse_args(["--model", str(tmp_path), "--keep", "2", "--seq-len", "32",
                             "--batch-size", "128", *flags])
    prune.resolve_args(args, 1)
    assert args.micro_batch == micro
    model, _ = meta_model(args)
    prune.check_args(args, model.config, 4, 1)  # the run starts: no error line


def test_the_plans_json_states_every_rate_its_hours_use(tmp_path, capsys):
    """`prune.py --plan 8` for Llama-2-7B with the bench's measurements (experiments/gpu_bench.json):
    each kind's hours are recomputed here from the JSON's own fields, the training's FLOPs at its
    MFU and the teacher cache's at its own, on ranks x the card's dense bf16 peak (H100 and H200
    989, A100 312 TFLOP/s: the vendors' sheets)."""
    import json
    from transformers import AutoConfig
    cfg = dict(LLAMA2_7B)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp_path)
    prune.main(["--model", str(tmp_path), "--keep", "13", "--plan", "8"])
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: s["peak_flops"][k] for k in ("H100", "H200", "A100")} == {
        "H100": 989e12, "H200": 989e12, "A100": 312e12}
    for kind in ("H100", "H200", "A100"):
        seconds = (s["train_flops"] / s["mfu"][kind] + s["cache_flops"] / s["cache_mfu"][kind]) / (
            s["ranks"] * s["peak_flops"][kind])
        assert s["hours"][kind] == pytest.approx(seconds / 3600, abs=1e-3)
        assert s["gpu_hours"][kind] == pytest.approx(8 * seconds / 3600, abs=0.01)


def test_checkpointing_is_tried_in_the_order_of_its_measured_speed(tmp_path):
    """After no checkpointing (the fastest: nothing recomputed), the plan tries selective and full in
    the order of the bench's tok/s on the plan's path: FSDP2 eager on the H200 measured full faster
    than selective (27,162 against 24,012 tok/s), so Qwen3-32B on 8 H200s, where no checkpointing does
    not fit, trains with full; were selective the faster, it would pick selective. With no
    measurement the assumed slowdowns (RECOMPUTE) put selective first."""
    args, model, L, s = planned(tmp_path, QWEN3_32B, 48, 8)
    assert s["by_kind"]["H200"]["activation_checkpointing"] == "selective"  # measured={}

    def bench(selective, full):
        return {"runs": [{"shape": "7b8", "path": "fsdp", "compile": c, "ac": ac, "mfu": mfu}
                         for c in (False, True)
                         for ac, mfu in (("none", 0.4), ("selective", selective), ("full", full))]}
    picks = [P.plan(args, model, L, 8, measured=bench(*rates))[1]["by_kind"]["H200"]
             for rates in ((0.29, 0.33), (0.38, 0.33))]
    assert [p["activation_checkpointing"] for p in picks] == ["full", "selective"]
    assert picks[0]["mfu"] == 0.33 and picks[1]["mfu"] == 0.38


def test_the_shared_expert_is_counted(tmp_path):
    """Qwen2-MoE's shared expert runs on every token beside the routed ones: a gated MLP keeps its
    gate, act(gate), up and their product, 4 c I_s bytes a token (c = 2, bf16) at least, so four
    times its width keeps at least 4 x 2 x 3 I_s more a token and layer."""
    from transformers import AutoConfig
    base = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                num_experts_per_tok=2, vocab_size=1000)
    act = {}
    for shared in (128, 512):
        folder = tmp_path / str(shared)
        AutoConfig.for_model("qwen2_moe", shared_expert_intermediate_size=shared, **base).save_pretrained(folder)
        args = prune.parse_args(["--model", str(folder), "--keep", "1", "--plan", "8", "--seq-len", "256",
                                 "--protect-first", "0"])
        act[shared] = P.activation_bytes(meta_model(args)[0], "none", True, seq_len=256)
    assert act[512] - act[128] >= 4 * 2 * (512 - 128)


# transformers' default config of every family the project lists (tests/test_architectures.py's,
# docs/architectures.md's): --plan 1 and 8 end on the plan's JSON line; those whose default config
# transformers itself cannot build or run (DeepSeek-V2's: no top-k, and an odd expert width that
# leaves no instance small enough), and the families whose layers a CPU instance cannot stand for
# (Mamba, gated delta-net: their GPU kernels), on one error line
PLANNED = ["llama", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text", "olmoe",
           "granitemoe", "granite", "cohere", "hyperclovax", "gemma3_text", "gpt2", "gpt_neox", "opt",
           "gemma3", "qwen2", "qwen3", "mistral", "smollm3", "glm4_moe", "glm4_moe_lite", "afmoe",
           "ernie4_5_moe", "exaone4"]
REFUSED = {"deepseek_v2": "could not be counted", "lfm2_moe": "cannot build", "dots1": "cannot build",
           "falcon_h1": "could not be counted", "qwen3_next": "could not be counted"}


@pytest.mark.slow
@pytest.mark.parametrize("family", PLANNED + list(REFUSED))
def test_the_plan_of_every_familys_default_config(family, tmp_path, capsys):
    import json

    from transformers import AutoConfig

    from test_prune import one_line_error
    AutoConfig.for_model(family).save_pretrained(tmp_path)
    for ranks in ("1", "8"):
        argv = ["--model", str(tmp_path), "--keep", "2", "--plan", ranks]
        if family in REFUSED:
            one_line_error(argv, capsys, REFUSED[family])
            continue
        prune.main(argv)
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["ranks"] == int(ranks) and min(summary["activation_bytes"].values()) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "qwen3_moe"])
def test_the_formula_is_what_autograd_saves(family):
    """Two independent counts of one thing: scale/plan.py's formula, read off the modules, and what
    autograd saves on small instances of the model (scale/saved.py), for the families the formula
    models: one process (fp32 stream, bf16 matmuls) and FSDP2 (bf16 stream), with and without the
    search's gates, no checkpointing and selective, at a sequence past Gemma's window."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from scale.saved import counted_bytes
    cfg = AutoConfig.for_model(family, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1000,
                               **(dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)
                                  if family == "qwen3_moe" else {}),
                               **(dict(sliding_window=128) if family == "gemma3_text" else {}))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert all(P.modelled(layer) for layer in decoder_layers(model))
    for r in (4, 2):
        saved, searched, selective = counted_bytes(cfg, r, 2, 1024)
        counted = {("none", False): saved, ("none", True): searched, ("selective", False): selective}
        for (mode, search), each in counted.items():
            want = sum(each) / len(each)
            got = P.activation_formula(model, mode, r, 2, False, search, 1024)
            assert got == pytest.approx(want, rel=5e-3), (r, mode, search)
