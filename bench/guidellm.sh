#!/usr/bin/env bash
# GuideLLM (the load generator vLLM and Ray users run) against a running app, as the served
# benchmark measures it: streamed greedy chat completions on Spec-Bench questions, 128 tokens,
# 1, 4 and 16 streams (8, 16 and 32 requests), speculation as deployed, then speculation off.
# GuideLLM lives in a venv of its own: python3 -m venv /tmp/gllm && /tmp/gllm/bin/pip install guidellm
# usage: bench/guidellm.sh [TARGET] [OUT_DIR]   (run from the repository root, `make serve` running)
set -euo pipefail
TARGET=${1:-http://127.0.0.1:8000}; OUT=${2:-.}; GUIDELLM=${GUIDELLM:-/tmp/gllm/bin/guidellm}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 GUIDELLM__MAX_WORKER_PROCESSES=1
DATA="$OUT/guidellm-prompts.jsonl"
.venv/bin/python -c "
import json, sys
from bench.specbench import DEFAULT_QUESTIONS, load_questions
for q in load_questions(DEFAULT_QUESTIONS)[:32]: print(json.dumps({'prompt': q['turns'][0]}))" > "$DATA"

# each setting its own cache_salt: a keyless deployment is one tenant, and the plain run would be
# handed the speculative run's prompts by the prefix cache (the levels still share each setting's)
RUN=$(date +%s)
for setting in deployed off; do
  body="{\"temperature\":0,\"cache_salt\":\"guidellm-$RUN-$setting\"}"
  [ "$setting" = off ] && body="{\"temperature\":0,\"cache_salt\":\"guidellm-$RUN-$setting\",\"speculation\":{\"method\":\"off\"}}"
  # extras as JSON: GuideLLM's key=value form would turn the string off into false
  nice "$GUIDELLM" run \
    --backend "{\"kind\":\"openai_http\",\"target\":\"$TARGET\",\"model\":\"smollm2-135m\",\"request_format\":\"/v1/chat/completions\",\"stream\":true,\"max_tokens\":128,\"extras\":{\"body\":$body}}" \
    --data "kind=json_file,path=$DATA" \
    --data-column-mapper '{"kind":"generative_column_mapper","column_mappings":{"text_column":"prompt"}}' \
    --profile kind=concurrent --override profile.streams 1,4,16 \
    --constraint kind=max_requests,count=8 --override 'constraints[0].count' 8,16,32 \
    --output "kind=json,path=$OUT/guidellm-$setting.json" --disable-progress
done

.venv/bin/python - "$OUT/guidellm-deployed.json" "$OUT/guidellm-off.json" <<'PY'
import json, sys
def levels(path):
    return {b["config"]["strategy"]["streams"]: b["metrics"] for b in json.load(open(path))["benchmarks"]}
spec, plain = levels(sys.argv[1]), levels(sys.argv[2])
print("| streams | plain tokens/s | speculative tokens/s | speedup | TTFT p50 ms (spec, plain) | ITL p50 ms (spec, plain) |")
print("|---:|---:|---:|---:|---|---|")
for streams in sorted(spec):
    s, p = spec[streams], plain[streams]
    rate = lambda m: m["output_tokens_per_second"]["total"]["mean"]
    p50 = lambda m, name: m[name]["successful"]["percentiles"]["p50"]
    print(f"| {streams} | {rate(p):.1f} | {rate(s):.1f} | {rate(s) / rate(p):.2f}x | "
          f"{p50(s, 'time_to_first_token_ms'):.0f}, {p50(p, 'time_to_first_token_ms'):.0f} | "
          f"{p50(s, 'inter_token_latency_ms'):.1f}, {p50(p, 'inter_token_latency_ms'):.1f} |")
PY
