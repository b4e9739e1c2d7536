"""
ShortGPT's Block Influence (Men et al. 2024), a layer's importance as how much it turns its input:

    s_l = mean over tokens of 1 - cos(x_l, x_{l+1}),   x_l the layer's input, x_{l+1} its output

read with forward hooks on the decoder layers. The last layer's x_{l+1} is its raw output, before
the final norm; ShortGPT's code reads HF's hidden_states, whose last entry is after the final norm.
The two differ for the last layer only, which prune.py protects by default (--protect-last 1).
"""
import torch
import torch.nn.functional as F

from surgery import LayerRecorder, decoder_layers, hidden_in, hidden_out


@torch.no_grad()
def block_influence(model, batches, vocab=None, generator=None):
    """(L,) float64 BI scores over the valid tokens of `batches` ((input_ids, attention_mask or
    None)); larger = more important. In eval mode: no dropout in the scores. vocab, generator:
    not used (prune.IMPORTANCE's signature)."""
    layers = decoder_layers(model)
    sums, count, training = torch.zeros(len(layers), dtype=torch.float64), 0, model.training
    model.eval()
    try:
        for ids, attn in batches:
            dev = next(model.parameters()).device
            ids, attn = ids.to(dev), None if attn is None else attn.to(dev)
            valid = (torch.ones_like(ids) if attn is None else attn).bool()
            with LayerRecorder(layers) as rec:
                model(input_ids=ids, attention_mask=attn, use_cache=False)
            for i in range(len(layers)):
                x, y = hidden_in(*rec.calls[i]), hidden_out(rec.outputs[i])
                bi = 1 - F.cosine_similarity(x.float(), y.float(), dim=-1)
                sums[i] += (bi.double() * valid).sum().cpu()
            count += int(valid.sum())
    finally:
        model.train(training)
    return sums / max(count, 1)


def random_scores(model, batches, vocab, generator):
    """i.i.d. N(0, 1) scores, the same on every rank (a seeded generator): an ablation."""
    return torch.randn(len(decoder_layers(model)), generator=generator, dtype=torch.float64)
