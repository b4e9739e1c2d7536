"""The distributed pieces on 2 gloo ranks: the cut frees the removed layers' FSDP units, a launch as
2 "nodes" equals 1 process, FSDP2's gradients equal one process's (tied and untied, gloo's collectives in
pieces) while the embedding is not gathered for its own backward, and --plan from a config.json alone (the
meta device, no weights)."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import free_port, torchrun_failure
from test_prune import ROOT, assert_same_weights, tiny_args
from test_prune import corpus, single_run  # noqa: F401

AFTER_THE_CUT = r'''
import gc, os, sys, weakref
import torch
sys.path.insert(0, sys.argv[2])
import prune, runtime
from scale.fsdp import parallelize
from surgery import LayerSearch, decoder_layers
rank, world, device = runtime.init_distributed()
model, _ = runtime.load_model(sys.argv[1], weights=rank == 0)
model = parallelize(model, device).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(rank))
def step():
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()
step()  # FSDP's lazy init: the root lists every unit
removed = decoder_layers(model)[2]
dead = weakref.ref(removed)
del removed
args = prune.parse_args(["--keep", "4", "--lr", "1e-3", "--weight-decay", "0"])  # every flag at its default
search = LayerSearch(torch.tensor([9., 9., 0., 0., 9., 9.]), args, 6, 0, [], device)
kept, opt = prune.prune_to_top_k(model, opt, search, args)
gc.collect()
units = len(model._get_fsdp_state()._state_ctx.all_states)
step()  # the k-layer model trains on
os.write(1, f"rank {rank}: kept {kept} units {units} removed_alive {dead() is not None}\n".encode())  # one write
torch.distributed.barrier()  # no rank closes its connections while another still uses them
torch.distributed.destroy_process_group()
'''


def test_the_cut_frees_the_removed_layers_fsdp_units(make_tiny, tmp_path):
    """After prune_to_top_k under FSDP2 the root lists k + 1 units (the kept layers, itself: the tied
    embedding and LM head are vocabulary-parallel, no unit), and a removed layer is garbage: before
    scale.fsdp.drop_removed_layers it listed L + 1, the removed layers alive."""
    script = tmp_path / "cut.py"
    script.write_text(AFTER_THE_CUT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", str(script), make_tiny("llama", 6), str(ROOT)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc.stderr)
    for r in (0, 1):
        assert f"rank {r}: kept [0, 1, 4, 5] units 5 removed_alive False" in proc.stdout, proc.stdout


@pytest.mark.slow  # by default: 2 ranks on one node == 1 process
def test_two_nodes_on_one_host_match_one_process(single_run, make_tiny, corpus, tmp_path):  # noqa: F811
    """torchrun --nnodes 2 --node-rank 0|1 (one rank each, a static rendezvous at node 0's address) is
    the README's multi-node launch; on one host it must train the same model as one process."""
    out = tmp_path / "run"
    port = free_port()
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(n), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                               port, str(ROOT / "prune.py"), *tiny_args(make_tiny("llama", 6), corpus, out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), torchrun_failure(*logs)
    assert_same_weights(single_run, out, atol=1e-4)


LLAMA_2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                  intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)


def plan_lines(argv, capsys):
    """prune.py's command line run in this process (tests/test_plan.py runs `--plan` as a process)."""
    import prune
    prune.main(argv)
    return capsys.readouterr().out


def test_plan_from_a_config_alone(tmp_path, capsys):
    """Llama-2-7B x 8 ranks from its config.json alone (no weights, no tokenizer): the parameter count
    written out here, 16 B per parameter over 8 ranks, the paper's schedule (5% warm-up of T = 1200)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    line = plan_lines(["--model", str(tmp_path), "--keep", "13", "--plan", "8"], capsys)
    d, ff, V, L = 4096, 11008, 32000, 32
    layer = 4 * d * d + 3 * d * ff + 2 * d  # q k v o, gate up down, two RMSNorms
    params = 2 * V * d + L * layer + d  # embedding, LM head (untied), layers, final norm
    assert params == 6_738_415_616  # the published Llama-2-7B size
    assert f"{params / 1e6:,.1f}M params" in line, line
    assert f"{16 * params / 8 / 1e9:.3g} GB/rank in the search" in line, line
    assert f"{16 * (params - (L - 13) * layer) / 8 / 1e9:.3g} GB/rank after the cut" in line, line
    assert "T 1200 (search T_M 120, warm-up 60)" in line, line
    tokens = 1200 * 128 * 4096
    assert f"{tokens:,} tokens" in line and f"cache {46 * tokens / 1e9:.3g} GB on disk" in line, line


def test_short_budget_keeps_the_schedule_shape(tmp_path, capsys):
    """A 58-step budget with the paper's settings warms up for 5% of it (3 steps), not for 60."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    out = plan_lines(["--model", str(tmp_path), "--keep", "13", "--plan", "8", "--steps", "58"], capsys)
    assert "T 58 (search T_M 6, warm-up 3)" in out, out


def tied_grads(model, batches, adds_rows):
    """dL/dtheta of a copy of `model`, summed over the micro-batches (float64, one process)."""
    import copy

    from scale.fsdp import tied_lookup_adds_rows
    model = copy.deepcopy(model).double()
    if adds_rows:
        tied_lookup_adds_rows(model)
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_tied_lookup_adds_rows_gives_autograds_gradient():
    """The tied embedding's lookup that adds its rows into E.grad: every gradient equals plain autograd's
    (float64), with repeated ids, the padding id (its row gets nothing from the lookup) and two accumulated
    micro-batches; an untied or frozen embedding is left as it is."""
    import torch
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    from scale.fsdp import tied_lookup_adds_rows
    torch.manual_seed(0)
    config = tiny_config("llama", 2, vocab=300)
    config.pad_token_id = 7
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_input_embeddings().padding_idx == 7
    ids = torch.tensor([[5, 7, 9, 5, 5, 120, 7, 299], [1, 2, 3, 9, 9, 9, 7, 0]])
    batches = [ids, ids.flip(1)]
    plain, adds = tied_grads(model, batches, False), tied_grads(model, batches, True)
    assert plain.keys() == adds.keys()
    for name in plain:
        torch.testing.assert_close(adds[name], plain[name], rtol=1e-12, atol=1e-14)
    embed = plain["model.embed_tokens.weight"]
    assert embed[[5, 9, 120]].abs().min() > 0 and (embed[7] != 0).any()  # rows the lookup and the head fill

    # scale_grad_by_freq divides each row's lookup gradient by its count in the batch: no adding of
    # rows (plain_lookup), so the lookup stays autograd's and the gradient its
    model.get_input_embeddings().scale_grad_by_freq = True
    plain, adds = tied_grads(model, batches, False), tied_grads(model, batches, True)
    for name in plain:
        torch.testing.assert_close(adds[name], plain[name], rtol=1e-12, atol=1e-14)
    model.get_input_embeddings().scale_grad_by_freq = False

    config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(config)
    forward = untied.get_input_embeddings().forward
    tied_lookup_adds_rows(untied)
    assert untied.get_input_embeddings().forward == forward


def checkpointed_backward(model, ids, mode):
    """A copy of `model` with scale.fsdp's activation checkpointing `mode` (None: none): its gradients,
    and what its backward ran: each layer's input norm again (a recompute), and the matmuls."""
    import copy

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from scale.fsdp import apply_activation_checkpointing
    model = copy.deepcopy(model).train()
    if mode:
        apply_activation_checkpointing(model, mode)
    norms = []
    for layer in model.model.layers:
        layer.input_layernorm.register_forward_hook(lambda *a: norms.append(torch.is_grad_enabled()))

    class Matmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Matmuls.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
            return func(*args, **(kwargs or {}))
    loss = model(input_ids=ids, labels=ids).loss
    forward_norms = len(norms)
    with Matmuls():
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, len(norms) - forward_norms, Matmuls.count


def test_activation_checkpointing_gives_the_plain_gradients():
    """scale.fsdp.apply_activation_checkpointing on a tiny random Llama (float64, one process): "full" and
    "selective" give plain autograd's gradients; both recompute every layer in the backward (its norm runs
    again), full its matmuls too, selective none of them (saved: the backward's matmuls are the plain
    backward's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(0, 128, (2, 16))
    plain, plain_norms, plain_mm = checkpointed_backward(model, ids, None)
    assert plain_norms == 0
    for mode in ("full", "selective"):
        grads, norms, mm = checkpointed_backward(model, ids, mode)
        for name in plain:
            torch.testing.assert_close(grads[name], plain[name], rtol=1e-10, atol=1e-12)
        assert norms == 3, (mode, norms)  # every layer recomputed
        assert mm > plain_mm if mode == "full" else mm == plain_mm, (mode, mm, plain_mm)
    with pytest.raises(ValueError, match="'full' or 'selective'"):
        checkpointed_backward(model, ids, "every other")


def test_add_rows_sums_a_repeated_id_before_rounding():
    """scale.vocab_parallel.add_rows, sync-free (no unique): a bf16 gradient gets each distinct id's
    rows summed in fp32 and rounded once (1,000 rows of 1 at one id among others, the ids in any
    order: 500 with the scale 0.5, which one bf16 rounding keeps), an fp32 one takes them straight
    in; both against float64."""
    import torch

    from scale.vocab_parallel import add_rows
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(1050, generator=g)
    ids = torch.cat([torch.full((1000,), 2), torch.randint(0, 6, (50,), generator=g)])[order]
    rows = torch.cat([torch.ones(1000, 3), torch.randn(50, 3, generator=g)])[order]
    start = torch.randn(6, 3, generator=g)
    for dtype, tol in ((torch.bfloat16, 2 ** -8), (torch.float32, 1e-6)):
        grad = start.to(dtype)
        ref = grad.double().index_add(0, ids, rows.to(dtype).double(), alpha=0.5)
        add_rows(grad, ids, rows.to(dtype), 0.5)
        assert ((grad.double() - ref).abs() <= tol * ref.abs() + 2 * tol).all(), (dtype, grad, ref)


ROWS_UNDER_FSDP = r"""
import contextlib, json, sys
import torch
from torch.distributed.tensor import DTensor
sys.path.insert(0, sys.argv[2])
sys.path.insert(0, sys.argv[2] + "/tests")
import runtime, scale.fsdp
from host_syncs import HostSyncs
scale.fsdp.GLOO_CHUNK_BYTES = 4096  # every unit's collectives in many pieces, the last one short
rank, world, device = runtime.init_distributed()
ids = [torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(10 * r + m)) for r in range(world)
       for m in range(2)]
ref, _ = runtime.load_model(sys.argv[1])  # plain autograd, one process: the mean over the ranks' batches
for x in ids:
    (ref(input_ids=x, labels=x).loss / world).backward()
model, _ = runtime.load_model(sys.argv[1], weights=rank == 0)
if sys.argv[4] != "none":  # activation checkpointing and compile, then FSDP2
    # with it a forward has no KV cache, and transformers' check for packed sequences in the position ids
    # then reads a value back once a forward: transformers' sync, not scale/'s, left out of the count
    import transformers.masking_utils
    transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None
    from scale.compile import compile_layers  # and the layers compiled (AOTAutograd's graphs: seconds)
    compile_layers(model, backend="aot_eager")
    scale.fsdp.apply_activation_checkpointing(model, sys.argv[4])
model = scale.fsdp.parallelize(model, device).train()  # the tied lookup that adds its rows too
# what each unit holds while the backward runs: a DTensor weight = the unit is back to its shards
embed, head = model.get_input_embeddings(), model.get_output_embeddings()
seen = {}
def look(where):
    def hook(*unused):
        seen[where] = (isinstance(embed.weight, DTensor), isinstance(head.weight, DTensor))
    return hook
# on the lookup's output, after FSDP's own pre-backward hook there: just before the lookup's backward
embed.register_forward_hook(lambda mod, inp, out: [out.register_hook(look("embedding backward")), None][1])
model.model.layers[0].register_full_backward_pre_hook(look("layer 0 backward"))
counted = HostSyncs()
for m in range(2):  # two micro-batches, each reduce-scattered: the shards accumulate
    x = ids[2 * rank + m]
    with counted if m else contextlib.nullcontext():  # the second: FSDP's lazy init is done
        loss = model(input_ids=x, labels=x).loss
        # which layers went back to their shards after the forward
        seen["after forward"] = [isinstance(l.self_attn.q_proj.weight, DTensor) for l in model.model.layers]
        loss.backward()
diff = max((p.grad.full_tensor() - r.grad).abs().max().item()
           for p, r in zip(model.parameters(), ref.parameters()))
# one file per rank: two ranks' prints on one pipe can interleave mid-line
with open(f"{sys.argv[3]}/rank{rank}.json", "w") as f:
    json.dump({"diff": diff, "seen": {k: list(v) for k, v in seen.items()}, "syncs": counted.syncs,
               "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}, f)
torch.distributed.barrier()  # no rank closes its connections while another still uses them
torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("tied, checkpointing", [(True, "none"),
                                                 pytest.param(False, "selective", marks=pytest.mark.slow)])
def test_fsdp_gradients_and_what_a_backward_gathers(tokenizer, tmp_path, tied, checkpointing):
    """On 2 gloo ranks, FSDP2's reduce-scattered gradients (a tied lookup that adds its rows, gloo's
    collectives in pieces of 4 KB, two micro-batches; untied, with selective activation checkpointing and
    the layers compiled)
    equal plain autograd's mean over both ranks' micro-batches in one process. And the embedding's weight is
    not held gathered where its values are not needed: tied, the embedding/head unit is back to its shards
    during the layers' backward (it was gathered until the lookup's backward, at the end); untied, the
    embedding is not gathered for its own backward. The last layer, whose backward comes first, stays
    gathered after the forward (it was resharded and gathered again at once), the others do not."""
    import torch
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = tiny_config("llama", 2, vocab=300)
    config.tie_word_embeddings = tied
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    script = tmp_path / "rows.py"
    script.write_text(ROWS_UNDER_FSDP)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", free_port(), str(script),
                           str(tmp_path / "m"), str(ROOT), str(tmp_path), checkpointing], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc.stdout, proc.stderr)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert max(r["diff"] for r in ranks) < 1e-6, ranks
    # (embedding sharded, head sharded) at each moment: nothing gathered (tied, the old code had the unit
    # gathered at both; untied, the embedding gathered for its own backward)
    states = {"embedding backward": [True, True], "layer 0 backward": [True, True], "after forward": [True, False]}
    for r in ranks:
        assert r["seen"] == states, ranks
    # a micro-batch's forward and backward read nothing back to the host (the lookup's id checks,
    # its boolean-mask indexing and unique, the gather's scalar all-reduce of the token count did)
    assert [r["syncs"] for r in ranks] == [[], []], ranks
    assert [r["graphs"] for r in ranks] == ([0, 0] if checkpointing == "none" else [1, 1]), ranks  # compiled


CHUNKED = r"""
import gc, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import runtime, scale.fsdp as parallel
rank, world, device = runtime.init_distributed()
def rss(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field)) / 1024
def extra_mb(fn):  # peak resident memory above what was resident when fn started
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    base = rss("VmRSS"); fn(); return rss("VmHWM") - base
g = torch.Generator().manual_seed(rank)
# exactness: odd sizes, pieces of 100 elements a rank and a short last one
parallel.GLOO_CHUNK_BYTES = 100 * world * 4
for shard in (1, 99, 1001):
    x = torch.randn(world * shard, generator=g)
    want, got = torch.empty(shard), torch.full((shard,), float("nan"))
    dist.reduce_scatter_tensor(want, x.clone())
    parallel.ChunkedReduceScatter()(got, x, None, dist.ReduceOp.SUM)
    same_rs = torch.equal(want, got)
    want, got = torch.empty(world * shard), torch.full((world * shard,), float("nan"))
    dist.all_gather_into_tensor(want, x[:shard].clone())
    parallel.ChunkedAllGather()(got, x[:shard], None)
    os.write(1, f"rank {rank}: shard {shard}: reduce-scatter equal {same_rs}, all-gather equal "
                f"{torch.equal(want, got)}\n".encode())  # one write: the two ranks' lines never interleave
# memory: a 128 MB unit, gloo's own collective against the pieces (16 MB)
parallel.GLOO_CHUNK_BYTES = 16 << 20
n = 32 << 20
x, out, full = torch.randn(n), torch.zeros(n // world), torch.zeros(n)
rs = extra_mb(lambda: dist.reduce_scatter_tensor(out, x))
rs_pieces = extra_mb(lambda: parallel.ChunkedReduceScatter()(out, x, None, dist.ReduceOp.SUM))
ag = extra_mb(lambda: dist.all_gather_into_tensor(full, out))
ag_pieces = extra_mb(lambda: parallel.ChunkedAllGather()(full, out, None))
with open(f"{sys.argv[2]}/extra-{rank}.txt", "w") as f:  # a file each: no lines interleaved
    f.write(f"reduce-scatter {rs:.0f} -> {rs_pieces:.0f}, all-gather {ag:.0f} -> {ag_pieces:.0f}")
dist.barrier()  # no rank closes its connections while another still uses them
dist.destroy_process_group()
"""


def test_gloo_collectives_in_pieces(tmp_path):
    """scale.fsdp.ChunkedReduceScatter / ChunkedAllGather give gloo's own results bit for bit (odd sizes, a
    short last piece), and bound the buffer a collective adds: gloo's own copy the whole 128 MB through
    one (>= 120 MB above input and output), in 16 MB pieces the extra is < 48 MB."""
    script = tmp_path / "chunked.py"
    script.write_text(CHUNKED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", free_port(), str(script), str(ROOT),
                           str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc.stdout, proc.stderr)
    for r in (0, 1):
        for shard in (1, 99, 1001):
            assert f"rank {r}: shard {shard}: reduce-scatter equal True, all-gather equal True" in proc.stdout
    for line in [(tmp_path / f"extra-{r}.txt").read_text() for r in (0, 1)]:
        rs, rs_pieces, ag, ag_pieces = (float(v) for v in re.findall(r"\d+", line))
        assert rs >= 120 and ag >= 120 and rs_pieces < 48 and ag_pieces < 48, line


SHARDED_AFTER_EACH_MICRO_BATCH = r'''
import os, sys
import torch
sys.path.insert(0, sys.argv[1])
import prune
from scale.fused_loss import FusedLoss
calls, seen = [0], []
fused = FusedLoss.__call__
def recording(self, model, *a, **k):
    if torch.is_grad_enabled():
        if calls[0] % 2:  # the step's second micro-batch: the first one's backward is done
            params = [p for p in model.parameters() if p.requires_grad]
            # reduce-scattered: a gradient on every parameter, holding this rank's shard only
            seen.append(all(p.grad is not None and p.grad.to_local().numel() == p.to_local().numel()
                            for p in params))
        calls[0] += 1
    return fused(self, model, *a, **k)
FusedLoss.__call__ = recording
prune.main(sys.argv[2:])
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
os.write(1, f"rank {rank}: sharded after micro-batch 1: {seen}\n".encode())  # one write, one line
'''


@pytest.mark.slow  # more ranks or processes than the default run's one of each
def test_gradients_are_reduce_scattered_after_every_micro_batch(make_tiny, corpus, tmp_path):  # noqa: F811
    """Gradient accumulation under FSDP2 keeps only each rank's shard of the gradients (torchtitan's choice):
    after a step's first micro-batch every parameter holds its sharded gradient. Skipping the reduce-scatter
    until the last micro-batch (no_sync) keeps the whole unsharded gradient on every rank, 4 B/param whatever
    the number of ranks: 27 GB a GPU for Llama-2-7B."""
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_AFTER_EACH_MICRO_BATCH)
    args = tiny_args(make_tiny("llama", 6), corpus, tmp_path / "out", "--steps", "4", "--ckpt-every", "100")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "E3_TEACHER_CACHE": str(tmp_path / "teacher")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", free_port(), str(script), str(ROOT), *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, torchrun_failure(proc.stdout, proc.stderr)
    seen = sorted(line for line in proc.stdout.splitlines() if "sharded after" in line)
    # batch 4 on 2 ranks, micro-batch 1: 2 micro-batches a step, 4 steps (2 in the search, 2 after the cut)
    assert seen == [f"rank {r}: sharded after micro-batch 1: {[True] * 4}" for r in (0, 1)], proc.stdout[-2000:]


VOCAB_PARALLEL_LOSS = r"""
import json, sys
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
import runtime
from host_syncs import HostSyncs
from scale.fused_loss import head_kd_loss
rank, world, device = runtime.init_distributed()
mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
torch.manual_seed(5)  # the same draws on every rank: each rank's tokens and the whole W, b
# 2 ranks: 31 rows, 16 + 15, the last 2 past the vocabulary; 4 ranks: 5 rows, 2 + 2 + 1 + 0
T, d, V, K, vocab, cap = (9, 6, 31, 4, 29, 3.0) if world == 2 else (9, 6, 5, 4, 5, 3.0)
W, b = torch.randn(V, d, dtype=torch.float64), torch.randn(V, dtype=torch.float64)
data = []
for r in range(world):
    lt = torch.log_softmax(torch.randn(1, T, vocab, dtype=torch.float64) * 2, -1)
    lp, ids = lt.topk(K, -1)
    mask = torch.rand(1, T) > 0.2 + 0.3 * r  # the ranks count different numbers of tokens (rank 3: none)
    data.append((torch.randn(1, T, d, dtype=torch.float64), ids, lp, -(lt.exp() * lt).sum(-1), mask))
post = lambda z: cap * torch.tanh(z / cap)
for tail in (False, True):  # eq. 12's top-K, then K + 1 classes (the rest lumped)
  # the reference, float64 in one process: the mean over ranks of each rank's loss on the whole logits
  Wr, br = W.clone().requires_grad_(True), b.clone().requires_grad_(True)
  hs = [x[0].clone().requires_grad_(True) for x in data]
  losses = []
  for (h_, ids, lp, ent, mask), hr in zip(data, hs):
    ls = torch.log_softmax(post(hr @ Wr.t() + br)[..., :vocab], -1)
    per_token = (lp.exp() * (lp - ls.gather(-1, ids))).sum(-1)
    if tail:  # + r_t log(r_t / r_s), r = 1 - the top-K's mass
        r_t, r_s = 1 - lp.exp().sum(-1), 1 - ls.gather(-1, ids).exp().sum(-1)
        per_token = per_token + r_t * (r_t.log() - r_s.log())
    losses.append((per_token * ent)[mask].sum() / max(mask.sum(), 1))
  (sum(losses) / world).backward()
  # vocabulary-parallel: each rank its rows of W and b (DTensors), its own tokens
  Wd = torch.nn.Parameter(distribute_tensor(W.float(), mesh, [Shard(0)]))
  bd = torch.nn.Parameter(distribute_tensor(b.float(), mesh, [Shard(0)]))
  h_, ids, lp, ent, mask = data[rank]
  h = h_.float().requires_grad_(True)
  with HostSyncs() as seen:  # 5 chunks of 2 tokens a rank
    loss = head_kd_loss(h, Wd, bd, ids, lp.float(), ent.float(), mask, post=post, vocab=vocab, chunk_tokens=2,
                        tail=tail)
    loss.backward()
  with torch.no_grad():
    again = head_kd_loss(h, Wd, bd, ids, lp.float(), ent.float(), mask, post=post, vocab=vocab, chunk_tokens=2,
                         tail=tail)
  out = {"rows": Wd.to_local().shape[0], "tokens": int(mask.sum()), "loss": (loss.item() - losses[rank].item()),
         "no_grad": again.item() - loss.item(),
         "dh": (h.grad.double() - world * hs[rank].grad).abs().max().item(),  # its own loss's gradient
         "dW": (Wd.grad.full_tensor().double() - Wr.grad).abs().max().item(),
         "db": (bd.grad.full_tensor().double() - br.grad).abs().max().item(),
         "past_vocab": Wd.grad.full_tensor()[vocab:].abs().sum().item(),
         "syncs": seen.syncs, "collectives": dict(seen.collectives)}
  # the ranks scale their losses differently: refused, not a wrong dW
  try:
    (head_kd_loss(h, Wd, bd, ids, lp.float(), ent.float(), mask, post=post, vocab=vocab, tail=tail)
     * (1 + rank)).backward()
    out["uneven"] = "accepted"
  except RuntimeError as e:
    out["uneven"] = str(e)[:60]
  with open(f"{sys.argv[2]}/rank{rank}{'-tail' if tail else ''}.json", "w") as f:
    json.dump(out, f)
torch.distributed.barrier()  # no rank closes its connections while another still uses them
torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_vocabulary_parallel_loss_equals_float64_whole_logits(tmp_path, world):
    """scale.fused_loss.head_kd_loss with the head's rows split over gloo ranks (DTensors: uneven rows, 2 past the
    vocabulary, a bias, soft-capping, different token counts per rank, chunks smaller than a rank's tokens;
    at 4 ranks one rank with no rows and one with no tokens) against float64 autograd through each rank's
    whole logits in one process: each rank's loss, its dL/dh, and dL/dW, dL/db of the mean over ranks (what
    FSDP's other gradients are); the no-grad path gives the same loss, and ranks that scale their losses
    differently are refused. The same for the K + 1-class loss (--kd-tail)."""
    script = tmp_path / "vp.py"
    script.write_text(VOCAB_PARALLEL_LOSS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                           "--master_port", free_port(), str(script), str(ROOT),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, torchrun_failure(proc.stdout, proc.stderr)
    ranks = [json.loads((tmp_path / f"rank{r}{tail}.json").read_text()) for r in range(world)
             for tail in ("", "-tail")]
    assert [r["rows"] for r in ranks[::2]] == ([16, 15] if world == 2 else [2, 2, 1, 0]), ranks
    assert world == 2 or ranks[6]["tokens"] == 0, ranks
    for r in ranks:
        assert abs(r["loss"]) < 1e-5 and abs(r["no_grad"]) < 1e-6, ranks
        assert r["dh"] < 1e-5 and r["dW"] < 1e-5 and r["db"] < 1e-5 and r["past_vocab"] == 0, ranks
        assert r["uneven"].startswith("vocabulary-parallel head_kd_loss: the ranks scaled"), ranks
        # nothing read back to the host, and one collective a chunk: every rank's tokens gathered (4
        # tensors), each chunk's log-sum-exp and top-K logits (5 chunks), dL/dh back, the scales checked
        assert r["syncs"] == [], r
        assert r["collectives"] == {"_allgather_base_": 4 + 5, "_reduce_scatter_base_": 1, "allreduce_": 1}, r


FREED = r"""
import os, sys
import torch
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "fixed":
    from scale.fsdp import release_freed_memory
    release_freed_memory()
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
big = torch.ones(24 << 20, dtype=torch.uint8)
del big  # glibc's dynamic threshold: freeing a 24 MB mapped block raises it to 24 MB
before = resident_mb()
blocks = [torch.ones(1 << 18) for _ in range(128)]  # 128 x 1 MB: heap memory, under the threshold
keeper = torch.ones(16)  # allocated last: it pins the top of the heap
del blocks
print(round(resident_mb() - before))
"""


def test_freed_tensors_go_back_to_the_os_on_cpu_ranks(tmp_path):
    """glibc keeps freed blocks under its mmap threshold in the heap and raises the threshold as
    large blocks are freed: 128 MB of freed 1 MB tensors stayed resident (the host-memory goal held
    only with MALLOC_MMAP_THRESHOLD_ set by hand). scale.fsdp fixes the threshold on CPU ranks."""
    script = tmp_path / "freed.py"
    script.write_text(FREED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    held = {how: int(subprocess.run([sys.executable, str(script), str(ROOT), how], env=env,
                                    capture_output=True, text=True, check=True).stdout.split()[-1])
            for how in ("default", "fixed")}
    assert held["default"] > 100 and held["fixed"] < 20, held
