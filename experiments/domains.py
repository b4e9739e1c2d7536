"""
Held-out text of two other domains than the training corpus (Shakespeare), from files every
install of this project already has, so that they need no download:

  python-docs   technical English: the Python language reference's topics as shipped with the
                interpreter (pydoc_data/topics.py, the text behind `help("if")`), one topic a document
  torch-code    source code: the Python files of torch/nn/modules in the pinned torch
                (requirements.txt), one file a document

  python experiments/domains.py runs/domains   # writes python-docs.jsonl, torch-code.jsonl, and
                                                # domains.json (sizes, sha256, versions)

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


def python_docs():
    from pydoc_data.topics import topics  # the interpreter's own reference manual
    return [topics[k] for k in sorted(topics)]


def torch_code():
    root = Path(torch.__file__).parent / "nn" / "modules"
    return [p.read_text(encoding="utf-8") for p in sorted(root.glob("*.py"))]


DOMAINS = {"python-docs": python_docs, "torch-code": torch_code}


def write(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "torch": torch.__version__, "files": {}}
    for name, read in DOMAINS.items():
        path = out / f"{name}.jsonl"
        lines = "".join(json.dumps({"text": doc}) + "\n" for doc in read() if doc.strip())
        path.write_text(lines, encoding="utf-8")
        meta["files"][name] = {"path": str(path), "documents": lines.count("\n"),
                               "chars": len(lines),
                               "sha256": hashlib.sha256(lines.encode()).hexdigest()}
    (out / "domains.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


if __name__ == "__main__":
    print(json.dumps(write(sys.argv[1] if len(sys.argv) > 1 else "runs/domains"), indent=1))
