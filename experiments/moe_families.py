"""
A survey of every MoE family transformers ships as a causal LM: what a reader of an MoE layer's
per-expert tensors meets in each.

  families   every model_type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES whose text config
             (config.get_text_config()) has a routed-expert count key (COUNT_KEYS, and their
             attribute_map aliases; the keys actually found are reported)
  tiny       a tiny fp32 instance on CPU: 3 decoder layers, hidden 64, heads 4 / kv 2 of 16,
             vocab 256, E = 8 routed experts, top-2, every layer MoE where the config lets it;
             a forward on a (1, 8) batch of random ids. Router weights/biases and every floating
             tensor of E values outside the experts (score corrections) drawn at random.
  per layer  the MoE block (the module holding the experts), every parameter/buffer with a dim of
             size E inside the decoder layer, the router, the F.linear calls of width E (inside the
             router and in the whole block), the experts' call convention (forward pre-hook),
             shared experts, the source lines that use the non-expert per-expert tensors, and what
             the project's experts.routing.moe_layers() says.

    OMP_NUM_THREADS=1 python experiments/moe_families.py --out /tmp/moe_survey/survey.json
    OMP_NUM_THREADS=1 python experiments/moe_families.py --only mixtral,deepseek_v3

The detailed forward uses a (1, 5) batch (T = 5 tokens, so no token dimension equals E = 8); the
"forward runs" check uses (1, 8) as asked.
"""
import argparse
import inspect
import json
import re
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

warnings.filterwarnings("ignore")
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

transformers.logging.set_verbosity_error()

E, K, L = 8, 2, 3
# the routed-expert count, as the configs name it (found by looking at every causal-LM text config)
COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
              "num_experts_per_layer", "n_experts", "num_routed_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts",
             "moe_top_k", "top_k")
NOT_COUNT = re.compile(r"per_tok|per_token|shared|group|topk|top_k|intermediate|hidden|period|offset|"
                       r"zero_expert|layer|capacity|jitter|coef|factor|freq")

SMALL = dict(
    num_hidden_layers=L, num_layers=L, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, expert_ffn_hidden_size=32, ffn_hidden_size=128,
    intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=256, max_position_embeddings=128,
    # MLA (DeepSeek-likes)
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    # groups of experts: 4 groups of 2, 2 groups chosen
    n_group=4, topk_group=2, num_expert_group=4,
    zero_expert_num=2,
    # DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-MoE-DSA, ...)
    index_head_dim=16, index_n_heads=4, index_topk=4,
)
DENSE_KINDS = ("dense", "mlp", "ffn", "none")
EVERY_LAYER_MOE = dict(
    first_k_dense_replace=0, decoder_sparse_step=1, mlp_only_layers=[], moe_layer_freq=1,
    moe_layer_start_index=0, moe_layer_end_index=L - 1, moe_layer_interval=1,
    interleave_moe_layer_step=1, expert_layer_period=1, expert_layer_offset=0,
    moe_layers=list(range(L)), enable_moe_block=True, is_moe=True, num_dense_layers=0,
    first_dense_layers=0, dense_layers=[],
)
# per family: what the generic overrides cannot say (found by trying)
FAMILY_FIX = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"]),
    "zaya": dict(num_experts_per_tok=1),  # "ZAYA currently supports num_experts_per_tok=1 only"
    "dots3_note": dict(num_key_value_heads=4),  # "num_key_value_heads must match num_attention_heads"
    "dots3_note_text": dict(num_key_value_heads=4),
    "qwen4_exp": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                      indexer_compress_ratio=2),  # its QSA indexer's fields: all or none
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
                           indexer_compress_ratio=2),
    "nemotron_h": dict(layers_block_type=["mamba", "moe", "attention"], mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=1, mamba_n_groups=1,
                       moe_shared_expert_intermediate_size=32, chunk_size=16),
}


# composites: what the other sub-configs need to match the tiny text part
COMPOSITE_FIX = {"dots3_note": dict(vision_config=dict(adapter_out_dim=64), audio_config=dict(adapter_out_dim=64))}


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout("timed out")


def one_line(e):
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s[:300]


# -----------------------------------------------------------------------------
# Families

def text_config_of(model_type, **kwargs):
    cfg = CONFIG_MAPPING[model_type](**kwargs)
    return cfg, cfg.get_text_config()


def count_keys_of(tc):
    """{key: value} of the text config's routed-expert counts (and their aliases)."""
    d = tc.to_dict()
    found = {k: d[k] for k in d if re.search(r"experts?$|^n_experts|num_experts$", k)
             and not NOT_COUNT.search(k) and (d[k] is None or (isinstance(d[k], int) and not isinstance(d[k], bool)))}
    aliases = {a: t for a, t in getattr(type(tc), "attribute_map", {}).items() if t in found}
    return found, aliases


def families():
    out, skipped = {}, {}
    for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cfg, tc = text_config_of(mt)
        except Exception as e:
            skipped[mt] = one_line(e)
            continue
        found, aliases = count_keys_of(tc)
        if found:
            out[mt] = dict(config=CONFIG_MAPPING_NAMES.get(mt), text_config=type(tc).__name__,
                           composite=tc is not cfg, model=MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt],
                           count_keys=found, count_aliases=aliases,
                           topk_keys={k: v for k, v in tc.to_dict().items() if k in TOPK_KEYS})
    return out, skipped


# -----------------------------------------------------------------------------
# A tiny instance

def overrides_for(mt, tc, every_layer=True):
    d = tc.to_dict()
    keys = set(d) | set(getattr(type(tc), "attribute_map", {}))
    ov = {k: v for k, v in SMALL.items() if k in keys}
    count_keys, _ = count_keys_of(tc)
    for k in count_keys:
        ov[k] = E
    for k in TOPK_KEYS:
        if k in d:
            ov[k] = K
    if every_layer:
        ov.update({k: v for k, v in EVERY_LAYER_MOE.items() if k in keys})
    # per-layer lists of the default length: cut to L
    n0 = d.get("num_hidden_layers")
    for k, v in d.items():
        if isinstance(v, list) and n0 and len(v) == n0 and k not in ov:
            ov[k] = layer_list(k, v, every_layer)
    for k in ("n_shared_experts", "num_shared_experts"):
        if k in d and d[k] is None:
            ov[k] = 1
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(d.get(k), int) and d[k] >= SMALL["vocab_size"]:
            ov[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[k]
    if "qk_rope_head_dim" in ov and "head_dim" in ov:  # MLA: rope on qk_rope_head_dim
        ov["head_dim"] = ov["qk_rope_head_dim"]
    if "kv_lora_rank" in ov and "num_key_value_heads" in ov:  # MLA: one kv head a query head
        ov["num_key_value_heads"] = ov["num_attention_heads"]
    if "n_group" in ov and E % ov["n_group"]:
        ov["n_group"] = 1
    ov.update({k: v for k, v in FAMILY_FIX.get(mt, {}).items()})
    return ov


def layer_list(key, v, every_layer):
    """A per-layer list of the default length cut to L: an MLP-kind list all sparse (every layer
    MoE), any other (attention kinds) keeping each kind of the original where L allows."""
    if not all(isinstance(x, str) for x in v):
        return v[:L]
    kinds = list(dict.fromkeys(v))
    if re.search(r"mlp|moe|ffn", key) and every_layer:
        sparse = [x for x in kinds if x.lower() not in DENSE_KINDS]
        if sparse:
            return [sparse[-1]] * L
    out = list(v[:L])
    missing = [x for x in kinds if x not in out]
    for j, x in enumerate(missing[:L]):
        out[L - 1 - j] = x
    return out


def make_config(mt, ov):
    cls = CONFIG_MAPPING[mt]
    cfg0 = cls()
    if cfg0.get_text_config() is not cfg0:  # composite: the text part gets the overrides
        sub = next(k for k, v in vars(cfg0).items() if v is cfg0.get_text_config())
        return cls(**{sub: ov}, **COMPOSITE_FIX.get(mt, {}))
    return cls(**ov)


def build(mt):
    """(model, config, attempts): the overrides tried in turn, the first that builds and runs."""
    _, tc = text_config_of(mt)
    attempts = []
    for label, every in (("every-layer-moe", True), ("family-default-layout", False)):
        ov = overrides_for(mt, tc, every)
        try:
            cfg = make_config(mt, ov)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        except Exception as e:
            attempts.append(dict(label=label, stage="build", error=one_line(e)))
            continue
        attempts.append(dict(label=label, stage="built"))
        return model, cfg, attempts, ov
    return None, None, attempts, None


# -----------------------------------------------------------------------------
# The MoE layers

def decoder_layers(model):
    try:
        from surgery import decoder_layers as project
        return project(model)
    except Exception:
        best = None
        for name, m in model.named_modules():
            if isinstance(m, nn.ModuleList) and (best is None or len(m) > len(best[1])):
                best = (name, m)
        return best[1]


def is_experts(module):
    if isinstance(module, nn.ModuleList) and len(module) == E:
        return True
    return any(p.dim() == 3 and p.shape[0] == E for p in module.parameters(recurse=False))


def expert_sets(layer):
    """Paths of every module holding routed experts in a decoder layer (not nested in another)."""
    found = []
    for name, m in layer.named_modules():
        if name and is_experts(m) and not any(sub_of(name, f) for f in found):
            found.append(name)
    return found


def find_moe(layer):
    """(block path, experts path) of the first module holding the routed experts in a layer."""
    sets = expert_sets(layer)
    return (sets[0].rpartition(".")[0], sets[0]) if sets else (None, None)


def sub_of(path, root):
    if root is None:
        return False
    return path == root or path.startswith(root + ".") if root else True


def find_router(block, experts_rel):
    """(path rel. to block, module, param name) of the module beside the experts owning a 2-D
    parameter/buffer with a dim of size E; the nearest such."""
    cands = []
    for name, m in block.named_modules():
        if experts_rel and sub_of(name, experts_rel):
            continue
        for pn, p in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            if p.dim() == 2 and E in p.shape and p.is_floating_point():
                cands.append((name, m, pn))
    if cands:
        return cands[0] + (E,)
    # a router scoring E + a few more (zero / skip experts, shared experts): rows E+1 .. E+7
    for name, m in block.named_modules():
        if experts_rel and sub_of(name, experts_rel):
            continue
        for pn, p in m.named_parameters(recurse=False):
            if p.dim() == 2 and E < p.shape[0] < E + 8 and p.is_floating_point():
                return name, m, pn, p.shape[0]
    return None, None, None, None


def e_tensors(layer, block_path, experts_path, sizes=(E,)):
    rows = []
    for kind, it in (("parameter", layer.named_parameters()), ("buffer", layer.named_buffers())):
        for name, t in it:
            dims = [i for i, s in enumerate(t.shape) if s in sizes]
            if not dims:
                continue
            where = ("experts" if sub_of(name, experts_path) else
                     "block" if block_path is not None and sub_of(name, block_path) else "layer")
            rel = name[len(block_path) + 1:] if block_path and where != "layer" else name
            rows.append(dict(name=rel, where=where, kind=kind, shape=list(t.shape), E_dims=dims,
                             size=[t.shape[i] for i in dims][0],
                             dtype=str(t.dtype).replace("torch.", "")))
    return rows


def randomize(layer, block_path, experts_path, router_rel, gen):
    """Router weights/biases and every floating tensor of E values outside the experts: random."""
    done = []
    with torch.no_grad():
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if not t.is_floating_point() or sub_of(name, experts_path):
                continue
            in_router = router_rel is not None and sub_of(name, ".".join(x for x in (block_path, router_rel) if x))
            in_block = sub_of(name, block_path) if block_path else True
            if (in_router and t.dim() >= 1 and E <= t.shape[0] < E + 8) or \
                    (in_block and t.dim() == 1 and E <= t.shape[0] < E + 8) or \
                    re.search(r"correction|statics|expert_bias|score", name):
                scale = 1.0 if t.dim() >= 2 else 0.5
                t.copy_(torch.randn(t.shape, generator=gen) * scale)
                done.append(name)
    return done


def describe(x):
    if torch.is_tensor(x):
        return dict(shape=list(x.shape), dtype=str(x.dtype).replace("torch.", ""))
    if isinstance(x, (tuple, list)):
        return [describe(v) for v in x]
    return type(x).__name__


class Calls(TorchFunctionMode):
    """Every torch function whose output's last dim is E, with the module it ran in."""

    def __init__(self, stack):
        super().__init__()
        self.stack, self.calls = stack, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]) else out
        if self.stack and torch.is_tensor(first) and first.dim() and E <= first.shape[-1] < E + 8:
            name = getattr(func, "__name__", str(func))
            self.calls.append(dict(func=name, linear=func is F.linear, module=self.stack[-1],
                                   shape=list(first.shape)))
        return out


def source_uses(cls, leaves):
    """Lines of the family's modeling file that mention each leaf name."""
    try:
        path = inspect.getsourcefile(cls)
        lines = Path(path).read_text().splitlines()
    except Exception:
        return None, {}
    uses = {}
    for leaf in leaves:
        hits = [f"{i + 1}: {ln.strip()}" for i, ln in enumerate(lines)
                if re.search(rf"\b{re.escape(leaf)}\b", ln)]
        uses[leaf] = hits[:12]
    return str(Path(path).relative_to(Path(transformers.__file__).parent)), uses


def routing_kind(src):
    """A guess from the router's and the block's source; the report checks it by reading."""
    s = src
    bits = []
    i_soft = min([s.find(t) for t in ("softmax(",) if s.find(t) >= 0] or [-1])
    i_sig = s.find("sigmoid(")
    i_top = s.find("topk(")
    if i_sig >= 0 and (i_soft < 0 or i_sig < i_soft):
        bits.append("sigmoid")
    elif i_soft >= 0:
        bits.append("softmax-then-topk" if i_top < 0 or i_soft < i_top else "topk-then-softmax")
    if re.search(r"correction|expert_bias|moe_statics", s):
        bits.append("+correction for choice")
    if re.search(r"n_group|num_group|topk_group|group_scores", s):
        bits.append("groups")
    if re.search(r"norm_topk_prob|renormal|/ .*sum\(|\.sum\(dim=-1, keepdim=True\)", s):
        bits.append("renorm")
    if re.search(r"routed_scaling_factor|route_scale|router_scale", s):
        bits.append("scaled")
    return " ".join(bits) or "?"


def analyse(mt, model, info):
    layers = decoder_layers(model)
    gen = torch.Generator().manual_seed(1)
    per_layer, moe_idx = [], []
    for i, layer in enumerate(layers):
        block_path, experts_path = find_moe(layer)
        if experts_path is None:
            if i == 0:
                info["layer0_e_tensors_no_experts_found"] = e_tensors(layer, None, None)
            continue
        moe_idx.append(i)
        block = layer.get_submodule(block_path) if block_path else layer
        experts_rel = experts_path[len(block_path) + 1:] if block_path else experts_path
        router_rel, router, router_param, rows = find_router(block, experts_rel)
        sizes = tuple(sorted({E, rows or E}))
        randomized = randomize(layer, block_path, experts_path, router_rel, gen)
        experts = block.get_submodule(experts_rel)
        per_layer.append(dict(
            index=i, block_path=block_path, block_class=type(block).__name__,
            experts_path=experts_rel, experts_class=type(experts).__name__,
            all_expert_sets=[dict(path=n, cls=type(layer.get_submodule(n)).__name__)
                             for n in expert_sets(layer)],
            experts_is_modulelist=isinstance(experts, nn.ModuleList),
            router_path=router_rel, router_class=type(router).__name__ if router is not None else None,
            router_param=router_param, router_rows=rows, randomized=randomized,
            e_tensors=e_tensors(layer, block_path, experts_path, sizes),
            shared=[dict(name=n, shape=list(p.shape)) for n, p in layer.named_parameters()
                    if "shared" in n],
            _modules=(layer, block, experts, router)))
    info["moe_layer_indices"] = moe_idx
    info["decoder_layers"] = len(layers)

    # the detailed forward: (1, 5) ids, hooks on every module in the MoE blocks
    stack, handles, experts_calls, router_calls = [], [], {}, {}
    for rec in per_layer:
        layer, block, experts, router = rec["_modules"]
        for name, m in block.named_modules():
            tag = f"L{rec['index']}:{name or '<block>'}"
            handles.append(m.register_forward_pre_hook(lambda mod, a, tag=tag: stack.append(tag)))
            handles.append(m.register_forward_hook(lambda mod, a, o: (stack.pop(), None)[1]))
        target = experts[0] if isinstance(experts, nn.ModuleList) else experts

        def pre(mod, args, kwargs, i=rec["index"]):
            experts_calls.setdefault(i, []).append(dict(
                n_tensor_args=sum(torch.is_tensor(a) for a in args),
                args=[describe(a) for a in args], kwargs={k: describe(v) for k, v in kwargs.items()}))
        handles.append(target.register_forward_pre_hook(pre, with_kwargs=True))
        if router is not None and router is not block:
            def rpost(mod, args, out, i=rec["index"]):
                router_calls.setdefault(i, []).append(dict(inputs=[describe(a) for a in args],
                                                           output=describe(out)))
            handles.append(router.register_forward_hook(rpost))
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    mode = Calls(stack)
    try:
        with torch.no_grad(), mode:
            model(ids, use_cache=False)
        info["detailed_forward"] = "ok"
    except Exception as e:
        info["detailed_forward"] = one_line(e)
    for h in handles:
        h.remove()

    for rec in per_layer:
        layer, block, experts, router = rec.pop("_modules")
        tag = f"L{rec['index']}:"
        mine = [c for c in mode.calls if c["module"].startswith(tag)]
        rpath = rec["router_path"]
        in_router = [c for c in mine if rpath is not None and
                     sub_of(c["module"][len(tag):], rpath if rpath else "<block>")]
        R = rec["router_rows"] or E
        rec["linear_E_in_router"] = sum(c["linear"] and c["shape"][-1] == E for c in in_router)
        rec["linear_E_in_block"] = sum(c["linear"] and c["shape"][-1] == E for c in mine)
        rec["linear_R_in_router"] = sum(c["linear"] and c["shape"][-1] == R for c in in_router)
        rec["width_E_calls"] = [f"{c['func']}@{c['module'][len(tag):]}{c['shape']}" for c in mine][:25]
        calls = experts_calls.get(rec["index"], [])
        rec["experts_calls"] = len(calls)
        rec["experts_call"] = calls[0] if calls else None
        rc = router_calls.get(rec["index"], [])
        rec["router_call"] = rc[0] if rc else None
        rw = f"{rpath}.{rec['router_param']}" if rpath else rec["router_param"]
        rb = rw.rpartition(".")[0] + ".bias" if "." in (rw or "") else "bias"
        other = [t for t in rec["e_tensors"] if t["where"] != "experts"
                 and not (rpath is not None and t["name"] in (rw, rb))]
        rec["other_e_tensors"] = other
        leaves = sorted({t["name"].rpartition(".")[2] for t in other})
        src_file, uses = source_uses(type(block), leaves)
        rec["modeling_file"], rec["source_uses"] = src_file, uses
        src = ""
        for cls in {type(block), type(router)} if router is not None else {type(block)}:
            try:
                src += inspect.getsource(cls.forward) + "\n"
                for n in ("route_tokens_to_experts", "route", "get_topk_indices", "_route"):
                    if hasattr(cls, n):
                        src += inspect.getsource(getattr(cls, n)) + "\n"
            except Exception:
                pass
        rec["routing_guess"] = routing_kind(src)
        rec["router_source"] = src[:6000]
    info["layers"] = per_layer


def project_moe_layers(model):
    try:
        from experts.routing import moe_layers
        found = moe_layers(model)
        return dict(ok=True, found=[dict(index=m.index, block=type(m.block).__name__,
                                         router=type(m.router).__name__,
                                         experts=type(m.experts).__name__, E=m.E) for m in found])
    except Exception as e:
        return dict(ok=False, error=one_line(e))


def survey(mt, meta):
    info = dict(meta)
    t0 = time.time()
    model, cfg, attempts, ov = build(mt)
    info["attempts"], info["overrides"] = attempts, ov
    info["builds"] = model is not None
    if model is None:
        return info
    tc = cfg.get_text_config()
    info["config_after"] = {k: v for k, v in tc.to_dict().items()
                            if re.search(r"expert|moe|sparse|dense|group|layer_types|topk|top_k|mlp_only", k)}
    info["model_class"] = type(model).__name__
    info["params"] = sum(p.numel() for p in model.parameters())
    try:
        analyse(mt, model, info)
    except Exception as e:
        info["analyse_error"] = one_line(e)
        info["analyse_tb"] = traceback.format_exc()[-2000:]
    try:
        with torch.no_grad():
            out = model(torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(4)), use_cache=False)
        info["forward"] = "ok" if torch.isfinite(out.logits).all() else "non-finite logits"
    except Exception as e:
        info["forward"] = one_line(e)
    info["moe_layers"] = project_moe_layers(model)
    info["seconds"] = round(time.time() - t0, 1)
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/moe_survey/survey.json")
    p.add_argument("--only", default="", help="comma-separated model types")
    p.add_argument("--timeout", type=int, default=120, help="seconds a family")
    args = p.parse_args()
    fams, skipped = families()
    only = [s for s in args.only.split(",") if s]
    keys_seen = sorted({k for f in fams.values() for k in f["count_keys"]})
    result = dict(transformers=transformers.__version__, torch=torch.__version__, E=E, top_k=K, layers=L,
                  count_keys=keys_seen, config_failures=skipped, families={})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGALRM, _alarm)
    for mt, meta in fams.items():
        if only and mt not in only:
            continue
        print(f"{mt} ...", end=" ", flush=True)
        signal.alarm(args.timeout)
        try:
            info = survey(mt, meta)
        except (Exception, Timeout) as e:
            info = dict(meta, builds=False, error=one_line(e))
        finally:
            signal.alarm(0)
        result["families"][mt] = info
        print(info.get("builds"), info.get("forward"), info.get("moe_layers", {}).get("ok"), flush=True)
        out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}")




# -----------------------------------------------------------------------------
# The Markdown table (python experiments/moe_families.py --table /tmp/moe_survey/survey.json)

# routing, read from each family's modeling file (the heuristic routing_guess is kept in the JSON)
ROUTING = {
    "mixtral": "softmax -> top-k -> renorm", "minimax": "softmax -> top-k -> renorm",
    "qwen2_moe": "softmax -> top-k (-> renorm if norm_topk_prob)", "qwen3_moe": "softmax -> top-k -> renorm",
    "qwen3_next": "softmax -> top-k -> renorm", "olmoe": "softmax -> top-k (renorm opt.)",
    "flex_olmo": "softmax -> top-k (renorm opt.)", "jamba": "softmax -> top-k",
    "hunyuan_v1_moe": "softmax -> top-k (router gate.wg: nn.Linear)",
    "deepseek_v2": "softmax -> group-limited top-k -> x routed_scaling_factor",
    "gpt_oss": "linear(+bias) -> top-k -> softmax over k", "granitemoe": "top-k -> softmax over k",
    "granitemoe_swa": "top-k -> softmax over k", "granitemoehybrid": "top-k -> softmax over k",
    "granitemoeshared": "top-k -> softmax over k", "jetmoe": "top-k -> softmax over k (router.layer Linear)",
    "cohere2_moe": "top-k on logits -> softmax over k (or sigmoid, expert_selection_fn)",
    "llama4": "top-k on logits -> sigmoid of the k; gate scales the experts' INPUT",
    "llama4_text": "top-k on logits -> sigmoid of the k; gate scales the experts' INPUT",
    "phimoe": "sparsemixer (masked softmax, top-2 via jitter threshold)",
    "gemma4": "softmax -> top-k -> renorm -> x per_expert_scale[idx]",
    "gemma4_text": "softmax -> top-k -> renorm -> x per_expert_scale[idx]",
    "afmoe": "sigmoid; top-k on sigmoid + block.expert_bias; renorm; x route_scale",
    "ernie4_5_moe": "softmax; top-k on softmax + moe_statics.e_score_correction_bias; renorm",
    "longcat_flash": "softmax over E+Z (Z zero/identity experts); top-k on softmax + correction; x scale",
    "inkling_text": "sigmoid over E+S rows; top-k on routed sigmoid + correction; logsigmoid-normalised over k routed + S shared; x route_scale x global_scale",
    "zaya": "3-layer router MLP over E+1 classes (skip expert); softmax; top-k on softmax + balancing_biases",
    "deepseek_v4": "score_fn(logits) (sqrt-softplus); top-k on score + correction; renorm; x scale; hash_moe layers: choice = tid2eid[input_ids]",
    "flint": "sigmoid -> top-k -> renorm",
    "qwen4_exp": "softmax -> top-k (-> renorm)", "qwen4_exp_text": "softmax -> top-k (-> renorm)",
    "aria_text": "top-k on logits -> softmax over k",
    "hy_v3": "sigmoid; top-k on sigmoid + block.e_score_correction_bias (passed into the router); renorm; x scale",
    "minimax_m2": "sigmoid; top-k on sigmoid + block.e_score_correction_bias (passed into the router); renorm",
    "laguna": "sigmoid; top-k on sigmoid + gate.e_score_correction_bias (a Parameter); renorm; x scale",
    "qwen3_5_moe": "softmax -> top-k -> renorm", "qwen3_5_moe_text": "softmax -> top-k -> renorm",
}


def table(path):
    d = json.loads(Path(path).read_text())
    rows = ["| family | builds? | block path | router (name, class) | per-expert tensors outside "
            "experts+router.weight/bias (name: shape, dim) | routing kind | experts call convention | "
            "moe_layers() result |", "|" + "---|" * 8]
    for mt, f in d["families"].items():
        ml = f.get("moe_layers") or {}
        mres = (f"ok: {len(ml['found'])} layers" if ml.get("ok") else
                (ml.get("error", "")[:140] if ml else "-"))
        if not f.get("builds"):
            why = (f.get("attempts") or [{}])[-1].get("error") or f.get("error")
            rows.append(f"| {mt} | no: {why} | | | | | | |")
            continue
        fwd = "yes" if f.get("forward") == "ok" else f"builds; forward: {f.get('forward')}"
        layers = f.get("layers") or []
        if not layers:
            et = "; ".join(f"{t['name']}: {t['shape']}" for t in f.get("layer0_e_tensors_no_experts_found", []))
            rows.append(f"| {mt} | {fwd} | (no experts module found) | | {et} | | | {mres} |")
            continue
        r = layers[0]
        sets = r.get("all_expert_sets", [])
        block = f"{r['block_path'] or '(the decoder layer)'}: {r['block_class']} / {r['experts_path']}: {r['experts_class']}"
        if len(sets) > 1:
            block += " (+" + ", ".join(s["path"] for s in sets[1:]) + ")"
        rows_ = f" [{r['router_rows']} rows]" if r.get("router_rows") not in (None, f["E"] if "E" in f else 8) else ""
        router = f"{r['router_path']}.{r['router_param']}: {r['router_class']}{rows_}" if r["router_path"] is not None \
            else "(none found)"
        router += f"; F.linear width E in router/block: {r['linear_E_in_router']}/{r['linear_E_in_block']}"
        if r.get("router_rows") and r["router_rows"] != 8:
            router += f", width {r['router_rows']}: {r.get('linear_R_in_router')}"
        other = "; ".join(f"{t['name']}: {t['shape']} dim {t['E_dims']} {t['kind']}" for t in r["other_e_tensors"]) or "-"
        call = r.get("experts_call")
        conv = ("-" if not call else
                "(" + ", ".join((f"{a['shape']}{'' if a['dtype'] == 'float32' else ' ' + a['dtype']}"
                                 if isinstance(a, dict) else str(a)) for a in call["args"]) + ")"
                + (f" kw {list(call['kwargs'])}" if call["kwargs"] else ""))
        shared = "; shared: " + ", ".join(f"{s['name'].split('.', 1)[-1]} {s['shape']}" for s in r["shared"][:2]) if r["shared"] else ""
        rows.append(f"| {mt} | {fwd}; MoE layers {f['moe_layer_indices']} | {block}{shared} | {router} | {other} | "
                    f"{ROUTING.get(mt, r['routing_guess'] + ' (auto)')} | {conv} | {mres} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if "--table" in sys.argv:
        src = sys.argv[sys.argv.index("--table") + 1]
        md = table(src)
        Path(src).with_name("table.md").write_text(md)
        print(md)
    else:
        main()
