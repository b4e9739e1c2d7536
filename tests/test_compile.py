"""scale/compile.py: decoder layers compiled in place train as the eager model does (losses and gradients
within 1e-3 on a tiny random Llama, alone and under selective and full activation checkpointing), one graph for all
the layers, the state-dict names unchanged. The default run compiles with aot_eager (AOTAutograd's graphs,
no code generation: seconds); `-m slow` with inductor, the backend a GPU run uses."""
import copy

import pytest
import torch

from scale.compile import compile_layers
from scale.fsdp import apply_activation_checkpointing
from surgery import decoder_layers


def tiny_llama(layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64))


def train(model, steps=3):
    """Each step's loss and the first step's gradients, AdamW on one fixed batch."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    losses, grads = [], None
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads


def check_compiled_trains_as_eager(backend, checkpointing=None):
    eager = tiny_llama()
    if checkpointing:
        apply_activation_checkpointing(eager, checkpointing)
    compiled = copy.deepcopy(eager)
    layers = list(decoder_layers(compiled))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_layers(compiled, backend=backend) is compiled
    assert list(decoder_layers(compiled)) == layers  # the same modules, compiled in place
    assert list(compiled.state_dict()) == list(eager.state_dict())  # the export's tensor names
    (want, want_grads), (got, got_grads) = train(eager), train(compiled)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph, every layer
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-3)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("checkpointing", [None, "selective", "full"])
def test_compiled_layers_train_as_eager(checkpointing):
    check_compiled_trains_as_eager("aot_eager", checkpointing)


@pytest.mark.slow  # inductor's code generation: ~20 s a graph on a 2-core CPU
@pytest.mark.parametrize("checkpointing", [None, "selective"])
def test_inductor_compiled_layers_train_as_eager(checkpointing):
    check_compiled_trains_as_eager("inductor", checkpointing)


def test_a_compiled_layer_compiles_its_checkpoint():
    """scale.fsdp's checkpoint wraps a layer's forward, so the compiled layer holds it: one captured
    graph with the checkpoint in it (a higher-order op whose selective policy the compiler's
    partitioner applies), never a checkpoint around a compiled call (inductor fails under selective
    there: transformers <= 5.17's switch, which wrapped the layer's __call__). It needs no switch of
    transformers': a model whose own switch refuses (custom code) is checkpointed the same; training
    it gives the eager model's losses."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    model = tiny_llama(2)
    model.supports_gradient_checkpointing = False  # transformers' gradient_checkpointing_enable refuses
    eager = copy.deepcopy(model)
    apply_activation_checkpointing(model, "selective")
    torch._dynamo.reset()
    compile_layers(model, backend=capture)
    got, want = train(model, 2)[0], train(eager, 2)[0]
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and any("tag_activation_checkpoint" in op for op in ops), ops
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
