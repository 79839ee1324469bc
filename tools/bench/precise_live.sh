#!/usr/bin/env bash
# Regenerates docs/benchmarks/precise-live.md (the tables between its markers) and
# docs/benchmarks/precise-live/: precise mode (epp_precise) against approximate mode
# (epp_approx) and Envoy's round robin, LIVE: real Envoy, real `epp serve`, 4 simulated
# pods publishing KV events over real ZMQ on ports of their own, our open-loop client.
# Interleaved: A B C, C B A, A B C per scenario (REPEATS, default 3). About 27 minutes
# on 2 cores (20 without churn-light).
#
#   tools/bench/precise_live.sh                          # every scenario, at HEAD
#   CODE=<commit> SCENARIOS="standard churn" tools/bench/precise_live.sh
#
# Pods and EPP share one tokenizer (a BPE trained on the workloads' text, under
# .bench/precise-live-tokenizer): precise mode needs the engine's token ids.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=docs/benchmarks/precise-live
REPEATS=${REPEATS:-3}
# One commit for every scenario, resolved once: HEAD may move while the campaign runs.
CODE=$(git rev-parse "${CODE:-HEAD}")
SCENARIOS=${SCENARIOS:-"standard multi-turn churn churn-light"}
SIM="--max-num-seqs 4 --prefill-overhead-ms 5 --prefill-per-token-ms 0.2 --decode-per-token-ms 10"
# --quiet-wait-s 3: the box is shared; each run records how busy it was before starting.
E=".venv/bin/epp bench live --routers epp_precise,epp_approx,envoy_round_robin --pods 4
  --repeats $REPEATS --code $CODE --tokenizer .bench/precise-live-tokenizer
  --duration-s 90 --drain-s 60 --quiet-wait-s 3 --out $OUT"
for S in $SCENARIOS; do
    case $S in
    # The standard shape (shared-prefix-small: 30 groups x 5, docs/benchmarks/live.md),
    # KV for every prefix: 2,048 blocks a pod.
    standard) $E --name shared-prefix-small --workload shared-prefix-small --rates 8 \
        --sim-args "$SIM --num-gpu-blocks 2048" ;;
    # Multi-turn chat (64 conversations x 4 turns over 8 system prompts), KV for all.
    multi-turn) $E --name multi-turn --workload multi-turn --rates 2 \
        --sim-args "$SIM --num-gpu-blocks 2048" ;;
    # Churny: 480 blocks a pod (7,680 tokens, about 4 prompts, nearly all of it held by
    # the 4 running requests), while each pod gets about 7 of the 30 groups' prefixes.
    churn) $E --name shared-prefix-small-churn --workload shared-prefix-small --rates 8 \
        --sim-args "$SIM --num-gpu-blocks 480" ;;
    # The same KV at half the rate: short queues, so a decision's prefill starts soon.
    churn-light) $E --name shared-prefix-small-churn-4rps --workload shared-prefix-small \
        --rates 4 --sim-args "$SIM --num-gpu-blocks 480" ;;
    *) echo "unknown scenario $S" >&2; exit 2 ;;
    esac
done
.venv/bin/epp bench live --precise-report $OUT --out docs/benchmarks/precise-live.md
