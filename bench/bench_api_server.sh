#!/usr/bin/env bash
# The vLLM API server's own CPU per request and per streamed token (bench/RESULTS_fidelity.md, session 21):
# closed loops of servelab bench against the vLLM CPU server of .ci/vllm.sh, the API server process's
# CPU time (utime + stime, /proc/PID/stat) read before and after each run.
#
#   bash bench/bench_api_server.sh            # prints one line per run; fit them with
#                                             # servelab.fidelity.client_model.api_server_token_s
set -u
cd "$(dirname "$0")/.."
source .ci/vllm.sh || exit 1
pid=$(cat "${SERVELAB_VLLM_DIR:-/tmp/servelab-vllm}/server.pid")
out=$(mktemp -d)
echo "api server pid $pid at $SERVELAB_TEST_ENDPOINT (frontend CPUs $SERVELAB_VLLM_FRONTEND_CPUS); runs in $out"
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
tck=$(getconf CLK_TCK)
for spec in "8 16" "64 16" "256 16" "64 4" "256 4"; do
  set -- $spec; L=$1; U=$2
  .venv/bin/servelab trace synth -o "$out/t_$L.arrow" -n 96 --rate 100 --prompt 32 --output-len "$L" --seed 1 \
    >/dev/null 2>&1 || true
  for rep in 1 2; do
    c0=$(cpu "$pid"); t0=$(date +%s.%N)
    taskset -c "$SERVELAB_VLLM_FRONTEND_CPUS" .venv/bin/servelab bench "$SERVELAB_TEST_ENDPOINT" "$out/t_$L.arrow" \
      -o "$out/run_${L}_${U}_$rep" --force --shape closed --users "$U" --model tiny >"$out/bench_${L}_${U}_$rep.log" 2>&1
    rc=$?
    c1=$(cpu "$pid"); t1=$(date +%s.%N)
    echo "output_tokens=$L users=$U rep=$rep rc=$rc api_cpu_s=$(python3 -c "print(($c1 - $c0) / $tck)")" \
         "wall_s=$(python3 -c "print(round($t1 - $t0, 4))") tokens=$((96 * L)) requests=96"
  done
done
bash .ci/vllm.sh stop
