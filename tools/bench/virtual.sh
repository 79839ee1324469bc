#!/usr/bin/env bash
# Regenerates docs/benchmarks/virtual.md and docs/benchmarks/virtual/ (about 4 minutes on
# 2 cores). The same commands are listed in that page's "Reproduce" section.
set -euo pipefail
cd "$(dirname "$0")/../.."
E=".venv/bin/epp bench virtual --pods 8 --preset llama-8b-a100 --out .bench/virtual --json-outcomes none --no-progress"
D=docs/benchmarks/virtual
$E --name sp-kv0.7      --json $D/sp-kv0.7.json      --workload shared-prefix --kv-fraction 0.7  --rates 2,3,3.5,4,5,6,8
$E --name sp-kv1.37     --json $D/sp-kv1.37.json     --workload shared-prefix --kv-fraction 1.37 --rates 2,4,5,5.5,6,8,10,12
$E --name no-reuse      --json $D/no-reuse.json      --workload no-reuse --rates 10,25,50,100,200,400
$E --name no-reuse-tiny --json $D/no-reuse-tiny.json --workload no-reuse --preset tiny --rates 50,100,150,200,300
$E --name multi-lora    --json $D/multi-lora.json    --workload multi-lora --rates 10,50,100,200
$E --name multi-turn    --json $D/multi-turn.json    --workload multi-turn --rates 2,8,16
$E --name burst         --json $D/burst.json         --workload burst
$E --name burst-lookup-at-admission --json $D/burst-lookup-at-admission.json --workload burst \
    --engine lookup_at_admission=true
$E --name overload      --json $D/overload.json      --workload no-reuse --rates 50,100,200 \
    --routers epp,round_robin,least_outstanding --sheddable-fraction 0.3
.venv/bin/epp bench report --from $D/sp-kv0.7.json $D/sp-kv1.37.json $D/no-reuse.json \
    $D/no-reuse-tiny.json $D/multi-lora.json $D/multi-turn.json $D/burst.json \
    $D/burst-lookup-at-admission.json $D/overload.json --out docs/benchmarks/virtual.md

W="--routers epp,epp_spec,round_robin"; Q="--epp-config $D/max-queue-100.yaml"
$E --name whatif-sp-kv0.7       --json $D/whatif-sp-kv0.7.json       --workload shared-prefix --kv-fraction 0.7  --rates 3.5,4,5,8 $W
$E --name whatif-sp-kv0.7-q100  --json $D/whatif-sp-kv0.7-q100.json  --workload shared-prefix --kv-fraction 0.7  --rates 3.5,4,5,8 $W $Q
$E --name whatif-sp-kv1.37      --json $D/whatif-sp-kv1.37.json      --workload shared-prefix --kv-fraction 1.37 --rates 5.5,8,10,12,16 $W
$E --name whatif-sp-kv1.37-q100 --json $D/whatif-sp-kv1.37-q100.json --workload shared-prefix --kv-fraction 1.37 --rates 5.5,8,10,12,16 $W $Q
$E --name whatif-no-reuse       --json $D/whatif-no-reuse.json       --workload no-reuse --rates 10,25,50,100,200,400 $W
$E --name whatif-no-reuse-q100  --json $D/whatif-no-reuse-q100.json  --workload no-reuse --rates 10,25,50,100,200,400 $W $Q
