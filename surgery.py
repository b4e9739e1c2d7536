"""
Model surgery on Hugging Face causal LMs: what E3-Pruner does to a model, each step one function.

  decoder_layers(model)           the decoder-layer ModuleList: the paper's "layers"
  LayerGates(model)               eq. 1, the masked forward X_{l+1} = X_l + m_l (f(X_l) - X_l)
  kl_importance(model, batches)   Sec. 3.2, s_l = E_x KL(p_{-l} || p), with prefix reuse
  LayerSearch                     the protocol every layer search implements; itself the top-k of S
  remove_layers(model, keep)      eq. 2, the cut: the ModuleList, layer_idx, the per-layer config
  check_removable(config, kept)   refuses, before any work, a layout the pruned config cannot express
  export_pruned(source, state..)  the pruned model as the user gave the source: dtype, generation
                                  config, tokenizer files, chat template, pruning.json

HF decoder layers add their own residuals, so f(X_l) in eq. 1 is `layer(x) - x`.
"""
import copy
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from runtime import E3Error, load_model, mean_over_ranks

# the decoder layers: Llama-likes, multimodal (Gemma-3), OPT, GPT-2/Falcon/Bloom, GPT-NeoX, MPT
LAYER_PATHS = ("model.layers", "model.language_model.layers", "model.decoder.layers",
               "transformer.h", "gpt_neox.layers", "transformer.blocks")


def layers_owner(model):
    """(the module holding the decoder-layer list, its attribute name)."""
    for path in LAYER_PATHS:
        *parents, attr = path.split(".")
        owner = model
        for p in parents:
            owner = getattr(owner, p, None)
        if isinstance(getattr(owner, attr, None), nn.ModuleList):
            return owner, attr
    raise E3Error(f"{type(model).__name__} has no decoder-layer list (looked for "
                  f"{', '.join(LAYER_PATHS)}); add its path to surgery.LAYER_PATHS")


def decoder_layers(model):
    owner, attr = layers_owner(model)
    return getattr(owner, attr)


def hidden_in(args, kwargs):
    """A decoder layer's input hidden state: by position or by keyword, as the family passes it."""
    return args[0] if args else kwargs["hidden_states"]


def hidden_out(output):
    """A decoder layer's output hidden state: the tensor (transformers >= 5) or a tuple's first."""
    return output if torch.is_tensor(output) else output[0]


def with_hidden(output, new):
    return new if torch.is_tensor(output) else (new, *output[1:])


# -----------------------------------------------------------------------------
# Eq. 1: the gates of the search

class LayerGates:
    """Forward hooks that make every decoder layer l compute  out = x + m_l (layer(x) - x).

    As torch.lerp(x, layer(x), m): value and gradient d out / d m = layer(x) - x in one kernel, exact
    at the ends (m = 1: the layer's output bit for bit, m = 0: the input; hard-masked == pruned). A
    layer with m_l = 0 still runs: its delta is its score's gradient (straight-through, Sec. 3.2).
    mask = None switches the gates off; the hooks leave state-dict keys and FSDP units as they are."""

    def __init__(self, model):
        self.mask = None
        self.handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True)
                        for i, layer in enumerate(decoder_layers(model))]

    def _hook(self, i):
        def gate(module, args, kwargs, output):
            if self.mask is None:
                return None  # a forward hook returning None leaves the output as it is
            y = hidden_out(output)
            return with_hidden(output, torch.lerp(hidden_in(args, kwargs), y, self.mask[i].to(y.dtype)))
        return gate

    def remove(self):
        for h in self.handles:
            h.remove()


# -----------------------------------------------------------------------------
# Sec. 3.2: the initial layer importance

class LayerRecorder:
    """Records every decoder layer's call (args, kwargs) and raw output during the forwards inside
    `with LayerRecorder(layers) as rec:`."""

    def __init__(self, layers):
        self.layers, self.calls, self.outputs = layers, {}, {}

    def __enter__(self):
        def pre(i):
            return lambda module, args, kwargs: self.calls.__setitem__(i, (args, kwargs))

        def post(i):
            return lambda module, args, output: self.outputs.__setitem__(i, output)
        self.handles = [h for i, layer in enumerate(self.layers) for h in (
            layer.register_forward_pre_hook(pre(i), with_kwargs=True),
            layer.register_forward_hook(post(i)))]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@contextmanager
def layer_bypassed(layers, rec, skip):
    """Inside the block a forward is that of the model without layer `skip`, computing only the
    layers after it: the input of layer `skip` is the same with and without it, so the layers before
    return what `rec` recorded and `skip` returns its input (prefix reuse). The model's own forward
    still runs around them: the embedding, the masks, the final norm, the head and what follows it
    (soft-capping, logit scales): the logits are the model's own."""
    found = [vars(layers[i]).get("forward") for i in range(skip + 1)]  # checkpointing's wrapper
    for i in range(skip):
        layers[i].forward = lambda *a, _out=rec.outputs[i], **k: _out
    layers[skip].forward = lambda *a, _out=rec.outputs[skip], **k: with_hidden(_out, hidden_in(a, k))
    try:
        yield
    finally:  # each layer's forward as found: its own (a wrapper's), else the class's again
        for layer, forward in zip(layers, found):
            vars(layer).update(forward=forward) if forward else vars(layer).pop("forward")


@torch.no_grad()
def kl_importance(model, batches, vocab, generator=None, chunk=1024):
    """s_l = mean over the valid tokens of KL(p_{-l} || p), p the model's next-token distribution and
    p_{-l} that of the model with layer l bypassed (Sec. 3.2), float64, length L; larger = more
    important. batches: (input_ids, attention_mask or None); pad positions never count. One full
    forward records every layer's input, then each bypassed model starts at its layer (~L^2/2 layer
    calls, not L (L + 1)). The KL: `chunk` tokens at a time in fp32, over the tokenizer's `vocab` ids.
    Eval mode: the model's scores, not a dropout sample's. `generator` (the registry's) is not used."""
    layers = decoder_layers(model)
    L, training = len(layers), model.training
    model.eval()
    sums, count = torch.zeros(L, dtype=torch.float64), 0
    try:
        for ids, attn in batches:
            dev = next(model.parameters()).device
            ids, attn = ids.to(dev), None if attn is None else attn.to(dev)
            valid = (torch.ones_like(ids) if attn is None else attn).bool().flatten()
            with LayerRecorder(layers) as rec:
                logits_p = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            logp = None  # one chunk holds every token: log p made once, not once a layer
            if valid.numel() <= chunk:
                logp = F.log_softmax(logits_p.flatten(0, -2)[:, :vocab].float(), dim=-1)
            for skip in range(L):
                with layer_bypassed(layers, rec, skip):
                    logits_q = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
                sums[skip] += _kl_sum(logits_q, logits_p, valid, vocab, chunk, logp)
            count += int(valid.sum())
    finally:
        model.train(training)
    return sums / max(count, 1)


def _kl_sum(logits_q, logits_p, valid, vocab, chunk, logp=None):
    """sum over the valid tokens of KL(q || p) = sum_v q_v (log q_v - log p_v), `chunk` tokens at a
    time in fp32 (bf16 logits lose the small probabilities the KL sums over); columns past the
    tokenizer's vocabulary (embedding padding rows) go. logp: log p of every token, if made."""
    q, p, total = logits_q.flatten(0, -2), logits_p.flatten(0, -2), 0.0
    for a in range(0, q.shape[0], chunk):
        logq = F.log_softmax(q[a:a + chunk, :vocab].float(), dim=-1)
        logp_c = logp if logp is not None else F.log_softmax(p[a:a + chunk, :vocab].float(), dim=-1)
        kl = (logq.exp() * (logq - logp_c)).sum(-1)
        total += (kl.double().cpu() * valid[a:a + chunk].cpu()).sum().item()
    return total


# -----------------------------------------------------------------------------
# Which layers stay: the protected ones, the top-k, the layer-search protocol, its steps' batches

def protected_layers(L, n_first=1, n_last=1):
    """Never pruned (the paper's ablation protects the first and the last)."""
    return sorted(set(range(n_first)) | set(range(L - n_last, L)))


def top_k_layers(scores, k, protected=()):
    """The k layers to keep: every protected layer, then the highest-scoring others, sorted."""
    s = torch.as_tensor(scores, dtype=torch.float64).detach().cpu().clone()
    s[list(protected)] = float("inf")
    return sorted(torch.topk(s, k).indices.tolist())


def keep_mask(kept, L, device):
    return torch.zeros(L, device=device).index_fill_(0, torch.tensor(kept, device=device), 1.0)


def sequences_read(step, args):
    """The sequences steps 1..step read: --batch-size a step, --search-batch-size in the search's."""
    return step * args.batch_size + min(step, args.search_steps) * (args.search_batch_size - args.batch_size)


def micro_batch_problem(args, ranks, micro_batch):
    """Why `micro_batch` sequences a forward cannot run every step on `ranks` ranks, or None: they
    divide the batch on a rank of each kind of step the run takes, and split among --masks-per-step."""
    for flag, batch, taken in (("--batch-size", args.batch_size, args.steps > args.search_steps),
                               ("--search-batch-size", args.search_batch_size, args.search_steps > 0)):
        if taken and batch % (ranks * micro_batch):
            return f"{flag} {batch} must be a multiple of ranks x --micro-batch ({ranks} x {micro_batch})"
    if args.search_steps and (args.search_batch_size // micro_batch) % args.masks_per_step:
        return (f"--masks-per-step {args.masks_per_step} must divide a search step's "
                f"{args.search_batch_size // micro_batch} micro-batches")


class LayerSearch:
    """What prune.py asks of a layer search, its whole protocol; by itself, no search (--search none:
    the top-k of S_0). The paper's, each baseline's and a fork's subclass it, in prune.SEARCHES, built
    as cls(S0, args, L, T, protected, device):

        in_loop, steps         whether it runs in the first T_M training steps, and T_M (or 0)
        tokens_read(args)      static: the training tokens it reads (--search-data's cache)
        plan(args, L)          optional static: a line for --plan (evo, random: forward tokens)
        prepare(model, cache, losses, log)   before training: evo and random choose their set here
        begin_step(t)          Alg. 1 l.2: this step's schedules and random draw
        sample_mask(j)         Alg. 1 l.4: the (L,) mask global micro-batch j runs, differentiable
        step()                 Alg. 1 l.5: the scores' update (average_grad(): over the ranks)
        kept()                 Alg. 1's return: the k layers to keep, were it to stop now
        cut(model)             the search is over (experts/search.py freezes the experts here)
        reshape(model, moments)  after the layer cut, the cut beyond the layers (experts/: the
                               N-expert model), the optimizer state carried; the export's too
        state_dict(), load_state_dict(state), log_fields(), summary()   checkpoint, log, summary"""
    in_loop = False  # whether it runs in the first T_M training steps (Gumbel-TopK, l0)

    def __init__(self, S0, args, L, T, protected, device):
        # a copy: S moves, S_0 stays what the importance gave (logged, exported)
        self.S = nn.Parameter(S0.detach().float().clone().to(device))
        self.args, self.L, self.protected = args, L, protected
        self.steps = args.search_steps if self.in_loop else 0

    @staticmethod
    def tokens_read(args):
        """The training tokens the search reads (its --search-data cache holds as many)."""
        return sequences_read(args.search_steps, args) * args.seq_len

    def prepare(self, model, cache, losses, log):
        pass

    def kept(self):
        return top_k_layers(self.S, self.args.keep, self.protected)

    def cut(self, model):
        pass

    def reshape(self, model, moments=None):
        return model

    def log_fields(self):
        return {}

    def summary(self):
        return {}

    def average_grad(self):
        """Each rank's dL/dS comes from its own micro-batches: the mean over the ranks is the whole
        batch's (FSDP averages only the model's weights). S.grad is None when the mask did not
        depend on S (k'_t = the protected layers)."""
        if self.S.grad is None:
            self.S.grad = torch.zeros_like(self.S)
        mean_over_ranks(self.S.grad)

    def state_dict(self):
        return {"S": self.S.detach().cpu()}

    def load_state_dict(self, state):
        self.S.data.copy_(state["S"])


# -----------------------------------------------------------------------------
# Eq. 2: the cut. Removal renumbers the layers, so every config setting keyed by a layer's index is
# rewritten for the kept ones: per-layer lists sliced (Gemma's `layer_types`), `*_layers` index lists
# renumbered (Qwen-MoE's `mlp_only_layers`), the families' index RULES (a dense prefix, a MoE step, a
# period) turned into the kept layout (architectures/layouts.py, imported for a config with one)

INDEX_RULES = ("decoder_sparse_step", "moe_layer_interval", "first_k_dense_replace",
               "num_dense_layers", "max_window_layers", "interleave_moe_layer_step",
               "_sliding_window_pattern", "num_nextn_predict_layers")
PER_LAYER = ("layer_types", "no_rope_layers")  # one value a layer, even where they read like ids
INDEX_NAMES = ("layer_idx", "layer_id", "layer_index", "layer_number")  # renumbered, no layout


def layer_configs(config, L):
    """The config objects that describe these L layers: the model's or a multimodal wrapper's
    text_config (Gemma-3), or both; never a vision tower's, though it may have L layers too."""
    found = [config.get_text_config()] + [config] * (config is not config.get_text_config())
    return [cfg for cfg in found if getattr(cfg, "num_hidden_layers", None) == L]


def _is_index_list(key, value, L):  # moe_layers, hybrid_layer_ids (Zamba2), full_attn_idxs (LFM2)
    return (key.endswith(("_layers", "_layer_ids", "_idxs")) and key not in PER_LAYER
            and type(value) in (list, tuple) and all(type(i) is int and 0 <= i < L for i in value)
            and len(set(value)) == len(value))


def rewrite_layer_settings(cfg, keep, L):
    """Rewrite, in place, every per-layer setting of `cfg` (which describes L layers) for `keep`."""
    rules = None
    if any(isinstance(getattr(cfg, key, None), int) for key in INDEX_RULES):
        from architectures import layouts  # read before the loop rewrites what it reads
        rules = layouts.read_rules(cfg, L)
    new_index = {i: j for j, i in enumerate(keep)}
    for key, value in list(vars(cfg).items()):
        if key.startswith("_") or key in INDEX_RULES:
            continue
        if _is_index_list(key, value, L):
            setattr(cfg, key, type(value)(new_index[i] for i in value if i in new_index))
        elif isinstance(value, (list, tuple)) and len(value) == L:
            setattr(cfg, key, type(value)(value[i] for i in keep))
    if rules is not None:
        layouts.write_rules(cfg, keep, rules)
    cfg.num_hidden_layers = len(keep)


def _layer_signature(layer):
    """What a layer's constructor made of its index: each submodule's type, scalar attributes
    (`sliding_window`, `is_moe_layer`, ...) or maps of them, parameter shapes; not the index."""
    sig = {}
    for name, mod in layer.named_modules():
        sig[name] = type(mod).__name__
        for k, v in vars(mod).items():
            flat = v.values() if isinstance(v, dict) else [v]
            if (not k.startswith("_") and k not in INDEX_NAMES + ("training",)
                    and all(x is None or isinstance(x, (bool, int, float, str)) for x in flat)):
                sig[f"{name}:{k}"] = v
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        sig[f"{name}:shape"] = tuple(t.shape)
    return sig


def _meta_layers(config):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # shapes and types only: no memory, no initialisation
        return decoder_layers(AutoModelForCausalLM.from_config(copy.deepcopy(config)))


def pruned_config(config, keep):
    """A copy of `config` for the model that keeps layers `keep`, checked: built on the meta device,
    its layer j must be built as layer keep[j] was. A layout it cannot express is one E3Error."""
    L = (text := config.get_text_config()).num_hidden_layers
    if text.model_type == "zaya" or "shared" in (getattr(text, "indexer_types", None) or ()):
        raise E3Error(f"{text.model_type} cannot be pruned: a layer passes on more than its output")
    new = copy.deepcopy(config)
    for cfg in layer_configs(new, L):
        rewrite_layer_settings(cfg, keep, L)
    before, after = _meta_layers(config), _meta_layers(new)
    for j, i in enumerate(keep):
        a, b = _layer_signature(before[i]), _layer_signature(after[j])
        if a != b:
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            raise E3Error(f"{config.model_type}: after removal, layer {i} (now {j}) would be built "
                          f"differently ({', '.join(diff[:3])}): its config keys this layer's "
                          f"layout to its index in a way surgery.rewrite_layer_settings does not "
                          f"know; this architecture cannot be pruned")
    return new


# the families a serving engine computes differently once pruned off its fixed periods (llama.cpp,
# vLLM): architectures/engines.py says where, imported only for these
SERVING_FAMILIES = ("smollm3", "llama4", "llama4_text", "qwen2_moe", "qwen3_moe", "deepseek_v2",
                    "deepseek_v3", "gpt_oss", "olmoe", "gemma3_text", "afmoe", "exaone4", "glm4_moe_lite")


def serving_notes(config, kept=None):
    """Warnings, 'engine: what differs', for a kept set (or, None, the family's rule)."""
    if config.get_text_config().model_type not in SERVING_FAMILIES:
        return []
    from architectures.engines import notes
    return notes(config, kept)


def check_removable(config, kept=None):
    """Refuse before any work a model whose layers cannot be removed consistently: `kept` as given,
    or (the search has not chosen yet) two probes that shift every index (drop layer 0) and halve
    it (every other layer), which break any index rule left unrewritten."""
    L = config.get_text_config().num_hidden_layers
    for keep in [sorted(kept)] if kept is not None else [list(range(1, L)), list(range(0, L, 2))]:
        if keep:
            pruned_config(config, keep)


def remove_layers(model, keep):
    """Keep only the decoder layers `keep` (original indices), in place: the ModuleList, every
    module's layer_idx or layer_id (the KV cache's index: a kept layer still saying 27 would index
    past the k slots), and every per-layer setting of the config."""
    keep = sorted(keep)
    owner, attr = layers_owner(model)
    layers = getattr(owner, attr)
    L = len(layers)
    if not keep or keep[-1] >= L or len(set(keep)) != len(keep):
        raise ValueError(f"bad layer list {keep} for {L} layers")
    pruned_config(model.config, keep)  # raises before anything changes
    setattr(owner, attr, nn.ModuleList([layers[i] for i in keep]))
    for new_idx, layer in enumerate(getattr(owner, attr)):
        for m in layer.modules():
            for name in (n for n in INDEX_NAMES if isinstance(getattr(m, n, None), int)):
                setattr(m, name, new_idx)  # layer_idx, or GPT-Neo's layer_id: its cache's index
    for cfg in layer_configs(model.config, L):  # in place: the layers hold these config objects
        rewrite_layer_settings(cfg, keep, L)
    return model


# -----------------------------------------------------------------------------
# Export: what the user gave, pruned; these copied byte for byte from a local source, not re-serialised
SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                "merges.txt", "chat_template.jinja", "chat_template.json")


def write_atomically(out_dir, write):
    """write(tmp) then rename tmp to out_dir: a crash never leaves a folder that looks done; an
    existing out_dir (a resumed run exporting again) is replaced only once the new one is whole."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = (out.with_name(f".{out.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def cast_as_saved(model, dtype):
    """Cast to `dtype` as from_pretrained(dtype=...) holds a model, so as save_pretrained wrote the
    source: all of it but the tensors its class keeps in fp32 at that dtype (transformers' rule,
    PreTrainedModel._get_dtype_plan: `_keep_in_fp32_modules_strict` at fp16 and bf16, e.g.
    DeepSeek-V3's router; `_keep_in_fp32_modules` at fp16; each a glob searched in the name)."""
    keep = set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    pattern = re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in sorted(keep)))
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():  # each cast once, straight to its own dtype
            t.data = t.data.to(torch.float32 if keep and pattern.search(name) else dtype)
    return model


def saved_dtype(source):
    """The source's dtype as from_pretrained(dtype="auto") reads it: its config.json's, else (one that
    names none) the first floating-point tensor's in its first safetensors file."""
    from transformers import AutoConfig
    dtype = getattr(AutoConfig.from_pretrained(source), "dtype", None)
    for file in sorted(Path(source).glob("*.safetensors"))[:1] if dtype is None else ():
        with safe_open(file, "pt") as f:  # dtype codes: "BF16", "F16", "F32", "I64" ...
            code = next((c for c in map(lambda k: f.get_slice(k).get_dtype(), f.keys())
                         if c[0] == "F" or c == "BF16"), "F32")
        dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}.get(code)
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


def export_pruned(source, state, kept, layers_before, tok, out_dir, info, reshape=None):
    """Write the pruned model as the user gave `source`: its model built on the meta device, cut to
    `kept` (and reshape(model): a search's cut beyond the layers, experts/cut.py's), handed `state`
    (the kept layers' full tensors) with assign=True, re-tied, cast back to the source's dtype (bf16
    stays bf16), with its generation config, tokenizer files and chat template, and pruning.json
    (`info`, the layer lists: original indices)."""
    from transformers import GenerationConfig, PretrainedConfig
    model, _ = load_model(source, "cpu", torch.float32, weights=False)
    dtype = saved_dtype(source)
    remove_layers(model, kept)
    if reshape is not None:
        reshape(model)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign replaced the shared embedding / head tensor by two copies
    cast_as_saved(model, dtype)
    for c in (model.config, *(v for v in vars(model.config).values() if isinstance(v, PretrainedConfig))):
        c.dtype = dtype  # a composite's text and vision configs too
    try:  # the source's EOS list, temperature, top_p ...
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:
        pass
    meta = {**info, "layers_before": layers_before, "kept_layers": sorted(kept),
            "removed_layers": sorted(set(range(layers_before)) - set(kept))}

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        for name in SOURCE_FILES if Path(source).is_dir() else ():  # a hub id: what was saved
            if (Path(source) / name).exists():
                shutil.copyfile(Path(source) / name, tmp / name)
        (tmp / "pruning.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_atomically(out_dir, write)
    return meta
