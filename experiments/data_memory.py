"""
Peak host memory of building a teacher cache against corpus size: the same 64K-token cache built
from a ~12 MB and from a ~180 MB JSONL corpus (the Shakespeare plays cut into ~2 KB documents and
repeated), with a tiny random Llama (SmolLM2's tokenizer) so that the data path, not the model, is
what is measured. Each run is a fresh process with a fresh token-file folder; it reports that
process's Max RSS (its own rusage, what /usr/bin/time -v prints as "Maximum resident set size"): the
tokenisation alone (data.corpus_blocks, which writes the token file), then the whole
`cache_teacher.py` build.

    python experiments/data_memory.py                    # this checkout
    python experiments/data_memory.py --repo /tmp/old    # another checkout (a git archive)
    python experiments/data_memory.py --sizes 12          # only the ~12 MB corpus
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_CHARS = 2000


def shakespeare_documents():
    sys.path.insert(0, str(ROOT))
    import runtime
    for play in sorted(Path(runtime.default_corpus()).rglob("*.md")):
        text = play.read_text(encoding="utf-8")
        yield from (text[i:i + DOC_CHARS] for i in range(0, len(text), DOC_CHARS))


def synthetic_jsonl(path, megabytes):
    """A JSONL corpus of about `megabytes` MB: the plays' ~2 KB documents, repeated (tagged)."""
    with open(path, "w") as f:
        copy = 0
        while f.tell() < megabytes * 2**20:
            for doc in shakespeare_documents():
                f.write(json.dumps({"text": f"[{copy}] {doc}"}) + "\n")
                if f.tell() >= megabytes * 2**20:
                    break
            copy += 1
    return path.stat().st_size / 2**20


def tiny_llama(path):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    sys.path.insert(0, str(ROOT))
    import demo
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(demo.default_model()).save_pretrained(path)


FLOOR = "import sys, torch, transformers; transformers.AutoTokenizer.from_pretrained(sys.argv[1])"
TOKENISE_ONLY = """import sys; sys.path.insert(0, ".")
import cache_teacher as data; from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
data.corpus_blocks(tok, sys.argv[2], int(sys.argv[4]), int(sys.argv[3]))"""


def peak_mb(cmd, repo, token_dir, log, malloc_env):
    """(peak RSS in MB, seconds) of one command in a fresh child process (os.wait4: that child's
    own rusage)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "E3_TOKEN_CACHE": str(token_dir), **malloc_env}
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status:
        sys.exit(Path(log).read_text()[-3000:])
    return usage.ru_maxrss / 1024, time.time() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=str(ROOT), help="checkout whose cache_teacher.py is measured")
    p.add_argument("--sizes", type=int, nargs="+", default=[12, 180], help="corpus sizes in MB")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--glibc-default", action="store_true",
                   help="leave glibc's dynamic mmap threshold on")
    a = p.parse_args()
    # With glibc's dynamic mmap threshold the teacher's LM-head chunks (1024 x vocabulary fp32,
    # freed and reallocated every chunk) leave the peak anywhere between 0.9 and 2.7 GB from run to
    # run, whatever the corpus; a fixed threshold makes it repeatable, so that the runs compare the
    # corpus.
    malloc_env = {} if a.glibc_default else {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny_llama(tmp / "model")
        for mb in a.sizes:
            corpus = tmp / f"corpus-{mb}.jsonl"
            size = synthetic_jsonl(corpus, mb)
            model, budget = str(tmp / "model"), [str(a.max_tokens), str(a.seq_len)]
            py = sys.executable
            runs = {"floor (import torch, load the tokenizer)": [py, "-c", FLOOR, model],
                    "tokenise (data.corpus_blocks)": [py, "-c", TOKENISE_ONLY, model, str(corpus),
                                                      *budget],
                    "build the cache (cache_teacher.py)": [
                        py, "cache_teacher.py", "--model", model, "--data", str(corpus),
                        "--out", str(tmp / f"cache-{mb}"), "--max-tokens", budget[0],
                        "--seq-len", budget[1]]}
            if not any((Path(a.repo) / f).exists() for f in ("data.py", "cache_teacher.py")):
                del runs["tokenise (data.corpus_blocks)"]
            for what, cmd in runs.items():
                token_dir = tmp / f"tokens-{mb}-{len(what)}"  # fresh: every run tokenises
                peak, seconds = peak_mb(cmd, a.repo, token_dir, tmp / "log.txt", malloc_env)
                print(f"corpus {size:6.1f} MB, {what}: peak RSS {peak:6.0f} MB, {seconds:5.1f} s",
                      flush=True)
            corpus.unlink()


if __name__ == "__main__":
    main()
