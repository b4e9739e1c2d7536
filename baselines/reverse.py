"""
Reverse-order pruning and the partial fine-tune of Lu et al., "Reassessing Layer Pruning in LLMs: New
Insights and Methods" (ICLR 2026, arXiv 2411.15558; code: github.com/yaolu-zjut/Navigation_LLM_layer_pruning):
remove the final layers, then fine-tune only the LM head, the final norm and the last three kept
layers. On Llama-3.1-8B it beat the importance metrics and LoRA.

Which layers. Their prune_llm.py, `--pr_method tail`, keeps `remained = [i for i in range(remain_num)]`:
the FIRST remain_num layers, so the very last layer goes with the others (remain_num is written
into the script: 24 of Llama-3.1-8B's 32, 20 of Gemma-2-2B's 26; no rounding, and --remove_layer
is not read by this branch). Here k is --keep, and the importance

    s_l = -l          (the deeper, the less important)

has that set as its top-k when nothing is protected: Lu et al.'s set is

    prune.py --init reverse --search none --protect-last 0

With prune.py's default --protect-last 1 the last layer stays and layers k-1 .. L-2 go instead, a
variant, not theirs. The first layer is kept either way.

The fine-tune. Their partial_fine-tuning.py (`--partial_layer_name last3`) freezes every parameter,
then unfreezes `model.model.norm`, `lm_head` and `model.model.layers[-1], [-2], [-3]`: the final norm
belongs to the trained set, the embedding and every earlier layer do not. prune.py --train-last N
does the same after the cut (train_only_last below; N = 3 is theirs), with this project's loss
(--loss, AKD by default) where they used next-token cross-entropy on Alpaca.

A tied LM head (SmolLM2, Gemma, Qwen2.5 < 7B: one V x d matrix E, the embedding and the head) is
trained here as the head it is, tied: E's gradient is the whole model's (the head's and the
lookup's), as in an unfrozen run, and the export stays tied, the size it was. Lu et al.'s Gemma
script unties instead (`tie_word_embeddings=False` when it loads), so that the input embedding stays
frozen; its export then carries a second V x d matrix (28M parameters on SmolLM2-135M, ~28% of the
20-layer model), which a method that prunes to save memory should not add. Their main model,
Llama-3.1-8B, is untied: there the two choices are the same.
"""
import torch

from runtime import E3Error
from surgery import decoder_layers


def check_args(args, config=None):
    """prune.check_args' part for --train-last N, before any work."""
    if args.train_last < 1:
        raise E3Error(f"--train-last takes the number of last layers to train, at least 1 (0 would "
                      f"train every weight: leave it out); got {args.train_last}")
    if args.lora_rank:
        raise E3Error("--train-last trains the last layers' own weights, --lora-rank freezes every "
                      "base weight for adapters: use one of them")


def reverse_order(model, batches=None, vocab=None, generator=None):
    """(L,) scores s_l = -l: the top-k is the first k layers (prune.IMPORTANCE's signature; the
    calibration batches are not read)."""
    return -torch.arange(len(decoder_layers(model)), dtype=torch.float64)


def trained_by_last(model, n):
    """The parameters Lu et al.'s partial fine-tune trains: the LM head's, the final norm's and the
    last n decoder layers' (a tied head: the shared matrix)."""
    from architectures.logits import final_norm
    layers = decoder_layers(model)
    modules = [model.get_output_embeddings(), final_norm(model), *layers[max(0, len(layers) - n):]]
    return {id(p) for m in modules if m is not None for p in m.parameters()}


def train_only_last(model, n):
    """Freezes every parameter but trained_by_last(model, n); returns the names of those trained."""
    trained = trained_by_last(model, n)
    for p in model.parameters():
        p.requires_grad_(id(p) in trained)
    return [name for name, p in model.named_parameters() if p.requires_grad]
