"""The distributed pieces on 2 gloo ranks: the cut frees the removed layers' FSDP units, a launch as
2 "nodes" equals 1 process, and --plan from a config.json alone (the meta device, no weights)."""
import json
import os
import subprocess
import sys

from test_prune import ROOT, assert_same_weights, tiny_args
from test_prune import corpus, single_run  # noqa: F401

AFTER_THE_CUT = r'''
import gc, sys, weakref
from types import SimpleNamespace
import torch
sys.path.insert(0, sys.argv[2])
import common, parallel, prune
from surgery import decoder_layers
rank, world, device = common.init_distributed()
model, _ = common.load_model(sys.argv[1], weights=rank == 0)
model = parallel.distribute(model, device, rank, world).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(rank))
def step():
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()
step()  # FSDP's lazy init: the root lists every unit
removed = decoder_layers(model)[2]
dead = weakref.ref(removed)
del removed
args = SimpleNamespace(keep=4, lr=1e-3, weight_decay=0.0)
scores = torch.tensor([9., 9., 0., 0., 9., 9.])
kept, opt = prune.prune_to_top_k(model, opt, scores, args, [])
gc.collect()
units = len(model._get_fsdp_state()._state_ctx.all_states)
step()  # the k-layer model trains on
print(f"rank {rank}: kept {kept} units {units} removed_alive {dead() is not None}", flush=True)
torch.distributed.destroy_process_group()
'''


def test_the_cut_frees_the_removed_layers_fsdp_units(make_tiny, tmp_path):
    """After prune_to_top_k under FSDP2 the root lists k + 2 units (the kept layers, the tied embedding
    and LM head, itself), and a removed layer is garbage: before parallel.drop_removed_layers it listed
    L + 2, the removed layers alive."""
    script = tmp_path / "cut.py"
    script.write_text(AFTER_THE_CUT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", str(script), make_tiny("llama", 6), str(ROOT)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):
        assert f"rank {r}: kept [0, 1, 4, 5] units 6 removed_alive False" in proc.stdout, proc.stdout


def test_two_nodes_on_one_host_match_one_process(single_run, make_tiny, corpus, tmp_path):  # noqa: F811
    """torchrun --nnodes 2 --node-rank 0|1 (one rank each, a static rendezvous at node 0's address) is
    the README's multi-node launch; on one host it must train the same model as one process."""
    out = tmp_path / "run"
    port = str(29700 + os.getpid() % 1000)
    env = {**os.environ, "E3_TEACHER_CACHE": str(tmp_path / "teacher"), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(n), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                               port, str(ROOT / "prune.py"), *tiny_args(make_tiny("llama", 6), corpus, out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), logs[0][-3000:] + logs[1][-3000:]
    assert_same_weights(single_run, out, atol=1e-4)


LLAMA_2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                  intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)


def test_plan_from_a_config_alone(tmp_path):
    """Llama-2-7B x 8 ranks from its config.json alone (no weights, no tokenizer): the parameter count
    written out here, 16 B per parameter over 8 ranks, the paper's schedule (5% warm-up of T = 1200)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    proc = subprocess.run([sys.executable, str(ROOT / "prune.py"), "--model", str(tmp_path), "--keep", "13",
                           "--plan", "8"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d, ff, V, L = 4096, 11008, 32000, 32
    layer = 4 * d * d + 3 * d * ff + 2 * d  # q k v o, gate up down, two RMSNorms
    params = 2 * V * d + L * layer + d  # embedding, LM head (untied), layers, final norm
    assert params == 6_738_415_616  # the published Llama-2-7B size
    line = proc.stdout
    assert f"{params / 1e6:,.1f}M params" in line, line
    assert f"{16 * params / 8 / 1e9:.3g} GB/rank in the search" in line, line
    assert f"{16 * (params - (L - 13) * layer) / 8 / 1e9:.3g} GB/rank after the cut" in line, line
    assert "T 1200 (search T_M 120, warm-up 60)" in line, line
    tokens = 1200 * 128 * 4096
    assert f"{tokens:,} tokens" in line and f"cache {46 * tokens / 1e9:.3g} GB on disk" in line, line


def test_short_budget_keeps_the_schedule_shape(tmp_path):
    """A 58-step budget with the paper's settings warms up for 5% of it (3 steps), not for 60."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_2_7B))
    proc = subprocess.run([sys.executable, str(ROOT / "prune.py"), "--model", str(tmp_path), "--keep", "13",
                           "--plan", "8", "--steps", "58"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert "T 58 (search T_M 6, warm-up 3)" in proc.stdout, proc.stdout + proc.stderr[-2000:]
