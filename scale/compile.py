"""
torch.compile a decoder layer at a time (torchtitan's apply_compile): the layers are one repeated
block, so one compiled graph serves them all, and what runs between them (the embedding, the gates
of eq. 1, the fused head's chunks, FSDP2's collectives) stays eager. Each layer is compiled in
place (`layer.compile()`: the module itself stays, so its state-dict names, the cut and the export
see the model they saw). prune.py: after activation checkpointing, before parallelize (fully_shard).
"""
from surgery import decoder_layers


def compile_layers(model, layers=None, **options):
    """Compile every decoder layer of `model` (or `layers`) in place (options: torch.compile's, e.g.
    backend); returns the model. Compilation happens at each layer's first call."""
    for layer in decoder_layers(model) if layers is None else layers:
        layer.compile(**options)
    return model
