#!/usr/bin/env bash
# The paper's claim in stages that fit a 2-core CPU: does E3's Gumbel-TopK search, at the paper's step
# count, move the layer set away from its own KL initialisation, and does the move pay after equal
# fine-tunes? The schedule is the paper's T = 1200-step run (prune.py's defaults with --model: warm-up
# T/20, cosine, a 10% search T_M = 120, tau 1 -> 0.1, k' from L to k, score lr 0.05, top-10 AKD,
# 40 calibration sequences) at 1K (or 4K) tokens a search step on experiments/domains.py's
# paper-corpus; the GPU grid (compare.sh paper-regime) is the same schedule at 16K.
#
#   bash experiments/paper_cpu.sh search     # stage 1: the 120 search steps alone (prune.py --until cut)
#   bash experiments/paper_cpu.sh finetune   # stage 2: E3 and KL one-shot fine-tuned alike from step 120
#   bash experiments/paper_cpu.sh table      # both stages' tables
#
# Stage 1 runs each arm (MODEL:SEARCH_SEQS:SEED, 128-token sequences) to the cut and stops: S_0, S_T,
# the kept set and the score trajectory in RUN/stopped.json, recorded into RESULTS (seeds.py record;
# `seeds.py search RESULTS` tables |S_T - S_0| against S_0's gaps and the Gumbel noise, and the set's
# Jaccard with KL one-shot's). prune.py caches the teacher once over the whole run's tokens (120 x
# SEARCH_SEQS + 1,080 x 8 sequences, the corpus's first), so that the two stages read what one
# uninterrupted run reads. Stage 2 runs KL one-shot (--search none, the same cache) to step 120 too,
# then resumes both runs without --until to T: the fine-tune's 1,080 steps of 1K tokens, scored and
# recorded as the series is. Both stages resume where they stopped: checkpoints every CKPT steps,
# the records made, arms claimed by a mkdir under RUNS/claims (after a kill: rm -r RUNS/claims).
# JOBS drivers side by side, one thread each, at nice 19 (beside other work). Knobs: ARMS, JOBS,
# RUNS, RESULTS, CKPT; TINY=1: toy size.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-search}
R=${RUNS:-runs/paper-cpu} O=${RESULTS:-experiments/results-paper-cpu} D=${RUNS:-runs/paper-cpu}/domains
ARMS=${ARMS:-smollm2:8:0 gemma3:8:0 smollm2:8:1 smollm2:8:2 smollm2:32:0}
T=1200 G="--ckpt-every ${CKPT:-20}"
E=${EVAL_TOKENS:-16384}  # held-out tokens scored a text
if [ -n "${TINY:-}" ]; then T=20 G="--n-calib 2 --eval-every 10 --ckpt-every 5" E=256; fi
if [ $stage = table ]; then
  for o in $O $O-gemma3; do [ -d $o ] && python experiments/seeds.py search $o && python experiments/seeds.py table $o; done
  exit 0
fi
[ -n "${TINY:-}" ] || renice -n 19 $$ > /dev/null
mkdir -p $R/claims
[ -f $D/paper-corpus.jsonl ] || python experiments/domains.py $D paper-corpus > /dev/null
[ -f $D/python-docs.jsonl ] || python experiments/domains.py $D > /dev/null  # the held-out domains

arm_run() {  # MODEL SEQS SEED: the arm's prune.py flags (the schedule of the whole T-step run)
  local model=$1 seqs=$2 seed=$3 mp keep
  if [ $model = smollm2 ]; then mp=${SMOLLM2:-$(python -c "import demo; print(demo.default_model())")} keep=20
  else mp=${GEMMA3:-$(python experiments/gemma.py)} keep=12; fi
  [ -n "${TINY:-}" ] && keep=${KEEP:-4}  # the toy models of the test
  echo "--model $mp --keep $keep --data $D/paper-corpus.jsonl --seq-len 128 --steps $T --batch-size 8 \
    --search-batch-size $seqs --micro-batch ${MICRO:-8} --seed $seed $G"
}

one() {  # STAGE MODEL SEQS SEED, claimed: one driver runs it
  local stage=$1 model=$2 seqs=$3 seed=$4 o=$O; [ $model = gemma3 ] && o=$O-gemma3
  local e3=e3-sb$(( seqs / 8 ))k-search-s$seed kl=kl-oneshot-sb$(( seqs / 8 ))k-search-s$seed
  local flags; flags=$(arm_run $model $seqs $seed)
  mkdir $R/claims/$stage-$model-$e3 2> /dev/null || return 0
  if [ $stage = search ]; then
    [ -f $o/$e3.json ] && return 0
    python prune.py $flags --out $R/$model-$e3 --until cut --resume > $R/$model-$e3.out 2>&1
    python experiments/seeds.py record $R/$model-$e3 ${e3%-s$seed} $seed $o/$e3.json > /dev/null
  else  # stage 2: KL one-shot to the same step on the same cache, then both on to T, scored
    [ -f $o/${e3/search/paired}.json ] && return 0
    python prune.py $flags --init kl --search none --out $R/$model-$kl --until $(( T / 10 )) --resume > $R/$model-$kl.out 2>&1
    for run in $e3 $kl; do
      local method=""; [ $run = $kl ] && method="--init kl --search none"
      python prune.py $flags $method --out $R/$model-$run --resume >> $R/$model-$run.out 2>&1
      for c in shakespeare python-docs torch-code; do
        local data=""; [ $c = shakespeare ] || data="--data $D/$c.jsonl --val-frac 1"
        python evaluate.py --model $R/$model-$run $data --no-speed --no-figures --seq-len 128 --max-tokens $E \
          --dtype float32 --report $R/$model-$run/eval-$c >> $R/$model-$run.out 2>&1
      done
      local paired=${run/search/paired}
      python experiments/seeds.py record $R/$model-$run ${paired%-s$seed} $seed $o/$paired.json \
        $R/$model-$run/eval-*.json > /dev/null
    done
  fi
  echo "$(date +%H:%M) $stage $model $e3: done"
}

drive() { for arm in $ARMS; do IFS=: read -r model seqs seed <<< "$arm"; OMP_NUM_THREADS=1 one $stage $model $seqs $seed; done; }
for j in $(seq ${JOBS:-2}); do drive & sleep 5; done
wait
