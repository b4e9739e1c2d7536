#!/usr/bin/env bash
# Experts against experts, and experts against layers (issue 58), on a small MoE that routes for real:
# experiments/moe_model.py's Qwen3-MoE (6 layers, 16 experts, top-2, trained on this CPU on the
# paper-corpus; rebuilt by that script when runs/moe-small is missing). Every run: the same teacher
# cache (the MoE's own targets on the paper-corpus: hybrid, its top-10 exactly and 12 draws from the
# rest, unbiased where the top-10 alone holds little of a ppl-100 teacher's mass), the same budget (80
# steps x 8 x 128 tokens, a 10% search: 8 steps), AKD after the cut; scored on the held-out end of the
# plays and on the two other domains (experiments/domains.py), recorded as the series is
# (experiments/seeds.py).
#
#   bash experiments/moe_compare.sh          # every method at 25% and 50% of the experts removed,
#                                            # seeds 0-4 (SEEDS), then the table
#   bash experiments/moe_compare.sh table    # the table from RESULTS (default experiments/results-moe)
#
# Methods, with N = 3E/4 (25% removed) or E/2 (50%) of the E experts kept in every MoE layer (12 or 8
# of the small MoE's 16):
#   x-random-P       a random expert set (--expert-init random --search none) + AKD
#   x-frequency-P    the most often routed experts (routing frequency, one-shot) + AKD
#   x-reap-oneshot-P REAP's own setting: its saliency's top-N, no training
#   x-reap-P         REAP's top-N + AKD
#   x-kl-P           the paper's KL importance per expert, one-shot, + AKD
#   x-e3-P           E3 on experts: KL init, the Gumbel-TopK search over each layer's experts in the
#                    first 10% of the steps, AKD throughout
#   l-kl-50          layers instead (ModelOpt's finding, on our model): half the layers (6 -> 3) by KL
#                    one-shot + AKD, about the parameters x-*-50 remove (3 layers 10.1M, half the experts 9.4M)
# Knobs: SEEDS, METHODS, JOBS (runs at once, one thread each), RUNS, RESULTS, MODEL, TINY=1 (toy).
#
# MIX=1: which experts for every served text (issue 67), on experiments/moe_model.py's domain MoE
# (8 experts of width 512, trained on prose and code: runs/moe-domains, built when missing), the KD
# text and the calibration text the same half-and-half mix of its two domains (16 sequences: 8 a
# domain), scored on each domain's held-out end (prose: the paper-corpus's, code: torch-train's),
# on unseen code files (torch-code) and on a text none of them saw (python-docs). Its methods, beside
# x-reap, x-kl, x-e3, x-reap-oneshot and l-kl-50 (scored with the same pooled calibration tokens):
#   x-reap-max-P      REAP on each domain apart, each normalised within it, the max of the shares
#   x-reap-minimax-P  REAP per domain, the set whose worst domain loses the least share (minimax)
#   x-kl-minimax-P    the same on the expert KL
#   x-merge-P         REAP's set, each dropped expert merged into its most alike kept one
#                     (experts/merge.py), + AKD
set -euo pipefail
cd "$(dirname "$0")/.."
R=${RUNS:-runs/moe-compare} O=${RESULTS:-experiments/results-moe} D=${DOMAINS:-runs/domains}
if [ -n "${MIX:-}" ]; then
  R=${RUNS:-runs/moe-domains-compare} O=${RESULTS:-experiments/results-moe-domains} MODEL=${MODEL:-runs/moe-domains}
  TRAIN="$D/paper-corpus.jsonl:1,$D/torch-train.jsonl:1" TEXTS="prose code torch-code python-docs"
fi
[ "${1:-}" = table ] && { python experiments/seeds.py table $O; exit; }
if [ -n "${MIX:-}" ]; then
  [ -f $D/torch-train.jsonl ] || python experiments/domains.py $D paper-corpus torch-train > /dev/null
  [ -f $MODEL/config.json ] || python experiments/moe_model.py --out $MODEL --data-dir $D --data paper-corpus:1,torch-train:1 \
    --experts 8 --expert-width 512 --steps 700
fi
MODEL=${MODEL:-runs/moe-small} TRAIN=${TRAIN:-$D/paper-corpus.jsonl} TEXTS=${TEXTS:-shakespeare python-docs torch-code}
[ -f $MODEL/config.json ] || python experiments/moe_model.py --out $MODEL
mkdir -p $R
[ -f $D/search-shakespeare.jsonl ] || python experiments/domains.py $D > /dev/null
[ -f $D/paper-corpus.jsonl ] || python experiments/domains.py $D paper-corpus > /dev/null
read E L <<< "$(python -c "import sys; from transformers import AutoConfig; from experts.search import expert_count
c = AutoConfig.from_pretrained(sys.argv[1]); print(expert_count(c)[1], c.get_text_config().num_hidden_layers)" $MODEL)"
P="--model $MODEL --data $TRAIN --seq-len 128 --batch-size 8 --micro-batch 8 --tokens 81920 --warmup 4 --n-calib 16 --eval-every 1000 --ckpt-every 20 --targets hybrid"
EVAL=${EVAL_TOKENS:-16384}
[ -n "${MIX:-}" ] && P="$P --calib-data $TRAIN"  # every method's calibration: the same mix
if [ -n "${TINY:-}" ]; then P="$P --steps 4 --n-calib 2"; EVAL=256; fi
declare -A METHOD
for pct in 25 50; do
  n=$([ $pct = 25 ] && echo $((3 * E / 4)) || echo $((E / 2)))
  METHOD+=([x-random-$pct]="--experts-keep $n --expert-init random --search none --loss akd"
           [x-frequency-$pct]="--experts-keep $n --expert-init frequency --search none --loss akd"
           [x-reap-oneshot-$pct]="--experts-keep $n --expert-init reap --search none --steps 0"
           [x-reap-$pct]="--experts-keep $n --expert-init reap --search none --loss akd"
           [x-kl-$pct]="--experts-keep $n --expert-init kl --search none --loss akd"
           [x-e3-$pct]="--experts-keep $n --expert-init kl --search gumbel --loss akd"
           [x-reap-max-$pct]="--experts-keep $n --expert-init reap --expert-domains max --search none --loss akd"
           [x-reap-minimax-$pct]="--experts-keep $n --expert-init reap --expert-domains minimax --search none --loss akd"
           [x-kl-minimax-$pct]="--experts-keep $n --expert-init kl --expert-domains minimax --search none --loss akd"
           [x-merge-$pct]="--experts-keep $n --expert-init reap --expert-merge --search none --loss akd")
done
METHOD+=([l-kl-50]="--keep $((L / 2)) --init kl --search none --loss akd")
ORDER="x-e3-50 x-kl-50 x-reap-50 x-frequency-50 x-random-50 l-kl-50 x-e3-25 x-kl-25 x-reap-25 x-frequency-25 x-random-25"
[ -n "${MIX:-}" ] && ORDER="x-reap-50 x-reap-minimax-50 x-reap-max-50 x-kl-minimax-50 x-merge-50 x-kl-50 x-e3-50 l-kl-50
  x-reap-25 x-reap-minimax-25 x-reap-max-25 x-kl-minimax-25 x-merge-25 x-kl-25 x-e3-25"
ONESHOT="x-reap-oneshot-50 x-reap-oneshot-25"  # no training, no draws: one run, seed 0

one() {  # NAME SEED FLAGS...: train, score on the three corpora, record
  local m=$1 s=$2 name=$1-s$2; shift 2; local out=$O/$name.json
  [ -f "$out" ] && return
  mkdir -p $R/claims; mkdir $R/claims/$name 2> /dev/null || return 0  # claimed: drivers share the queue
  [ -f "$R/$name/model/pruning.json" ] || python prune.py $P "$@" --seed $s --out $R/$name --resume > "$R/$name.out" 2>&1
  for c in $TEXTS; do  # a domain's held-out end (the --data's own split), or a whole held-out file
    local data; case $c in shakespeare) data="";; prose) data="--data $D/paper-corpus.jsonl";;
      code) data="--data $D/torch-train.jsonl";; *) data="--data $D/$c.jsonl --val-frac 1";; esac
    python evaluate.py --model $R/$name $data --no-speed --no-figures --seq-len 128 \
      --max-tokens $EVAL --dtype float32 --report $R/$name/eval-$c >> "$R/$name.out" 2>&1
  done
  python experiments/seeds.py record $R/$name $m $s $out $R/$name/eval-*.json > /dev/null
  echo "$(date +%H:%M) $name: $(python -c "import json, sys; r = json.load(open(sys.argv[1]))
print({c: round(v['ppl'], 2) for c, v in r['corpora'].items()})" $out)"
}
queue() {  # the runs, one a line: NAME SEED FLAGS (the trained ones first: the first builds the cache)
  for s in ${SEEDS:-0 1 2 3 4}; do
    for m in ${METHODS:-$ORDER}; do [[ " $ONESHOT " == *" $m "* ]] || echo "$m $s ${METHOD[$m]}"; done
  done
  for m in ${METHODS:-$ONESHOT}; do [[ " $ONESHOT " != *" $m "* ]] || echo "$m 0 ${METHOD[$m]}"; done
}
export -f one; export P R O D EVAL TEXTS
# the first run alone (it builds the teacher cache every run reads), then JOBS at once, a thread each
Q=$(queue)  # (not `queue | head -1`: under pipefail the writer's SIGPIPE would end the script)
head -1 <<< "$Q" | xargs -r -L 1 bash -c 'one "$@"' _
tail -n +2 <<< "$Q" | OMP_NUM_THREADS=$([ "${JOBS:-1}" -gt 1 ] && echo 1 || echo "${OMP_NUM_THREADS:-}") \
  xargs -r -P ${JOBS:-1} -L 1 bash -c 'one "$@"' _
python experiments/seeds.py table $O
