#!/usr/bin/env bash
# Regenerates docs/benchmarks/precise.md (the tables between its markers) and
# docs/benchmarks/precise/*.json: precise mode (epp_precise) against approximate mode
# (epp) in virtual time, 4 seeds per scenario (about 5 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
D=docs/benchmarks/precise
R="--routers epp,epp_precise,epp_precise_fixed2,epp_precise_fixed30,epp_approx_engine_tok,round_robin,oracle"
E=".venv/bin/epp bench virtual --pods 8 --preset llama-8b-a100 --out .bench/precise --json-outcomes none --no-progress $R"
for S in 0 1 2 3; do
    # The standard shape at its two headline points (docs/benchmarks/virtual.md).
    $E --seed $S --name sp-kv0.7-s$S  --json $D/sp-kv0.7-s$S.json  --workload shared-prefix --kv-fraction 0.7  --rates 3.5
    $E --seed $S --name sp-kv1.37-s$S --json $D/sp-kv1.37-s$S.json --workload shared-prefix --kv-fraction 1.37 --rates 5.5
    $E --seed $S --name multi-turn-s$S --json $D/multi-turn-s$S.json --workload multi-turn --rates 8
    # Churny: the pods' KV holds much less than the prefixes.
    $E --seed $S --name sp-kv0.2-s$S  --json $D/sp-kv0.2-s$S.json  --workload shared-prefix --kv-fraction 0.2  --rates 3.5
    $E --seed $S --name multi-turn-kv0.15-s$S --json $D/multi-turn-kv0.15-s$S.json --workload multi-turn --kv-fraction 0.15 --rates 8
done
.venv/bin/epp bench precise-report --out docs/benchmarks/precise.md --from \
    $D/sp-kv0.7-s{0,1,2,3}.json $D/sp-kv1.37-s{0,1,2,3}.json $D/multi-turn-s{0,1,2,3}.json \
    $D/sp-kv0.2-s{0,1,2,3}.json $D/multi-turn-kv0.15-s{0,1,2,3}.json
