#!/usr/bin/env bash
# GuideLLM (PyPI, a third-party client, unchanged) runs a short sweep against `servelab serve`, and its
# report is imported with `servelab run import --format guidellm` (bench/RESULTS_serve.md).
#
# Usage: bash bench/guidellm_serve.sh OUT_DIR [GUIDELLM_VENV]
#   GUIDELLM_VENV (default .guidellm-venv in the checkout, as `source .ci/guidellm.sh` installs it) is
#   apart from the project's venv (GuideLLM brings torch, transformers, datasets, httpx).
# Nothing is downloaded at run time: GuideLLM's synthetic prompts need a tokenizer ("processor"); it gets
# a local directory (tokenizer.json + tokenizer_config.json) made from a small BPE trained here, and
# `servelab serve --tokenizer` counts prompts with the same tokenizer.json.
set -euo pipefail
out=$(realpath -m "$1")
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${2:-$here/.guidellm-venv}
py="$here/.venv/bin/python"
port=${PORT:-18431}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$py" -c "import sys; sys.path.insert(0, '$here/tests'); from helpers_serve import train_tokenizer; train_tokenizer('$out/tokenizer.json')"
"$venv/bin/python" -c "
from tokenizers import Tokenizer, decoders
from transformers import PreTrainedTokenizerFast
tok = Tokenizer.from_file('$out/tokenizer.json')
tok.decoder = decoders.ByteLevel()  # GuideLLM decodes sampled ids into its prompts: plain text, not byte symbols
PreTrainedTokenizerFast(tokenizer_object=tok, bos_token='<s>').save_pretrained('$out/tok')"

"$py" -m servelab serve --port "$port" --runner "linear:base=0.04,prefill_token=0.0004,decode_seq=0.0005" \
    --num-gpu-blocks 4096 --time-scale "${SCALE:-10}" --tokenizer "$out/tokenizer.json" --served-model-name sim \
    > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 0.1; done

"$venv/bin/guidellm" run --backend "kind=openai_http,target=http://127.0.0.1:$port,model=sim" \
    --tokenizer "kind=hf_auto,model=$out/tok" \
    --data "kind=synthetic_text,prompt_tokens=256,output_tokens=32" \
    --profile "kind=sweep,sweep_size=${SWEEP:-4}" --constraint "kind=max_duration,seconds=${SECONDS_EACH:-5}" \
    --output "kind=json,path=$out/benchmarks.json" --disable-progress > "$out/guidellm.log" 2>&1
curl -s "http://127.0.0.1:$port/metrics" > "$out/metrics.txt"

rm -rf "$out/imported"
"$py" -m servelab run import --format guidellm "$out/benchmarks.json" -o "$out/imported" \
    --setting model=llama-3.1-8b --setting gpu=h100-80gb
