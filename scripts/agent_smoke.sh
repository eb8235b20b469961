#!/usr/bin/env bash
# Coding agents against a running jaxserve: OpenAI's Codex CLI (the Responses API), Claude Code
# and the `anthropic` Python SDK (the Messages API), each from its package registry, each
# driving one task through the default model. Outside the default suite: it needs npm.
#
# The check is the protocol, not the answer: each client exits 0 with no protocol error, and
# the server's log shows its calls answered 200. The default model (135M parameters) seldom
# chooses a tool on its own, so the tool round trip is forced where the client lets us
# (the SDK's tool_choice) and reported, not required, for the CLIs.
#
#   bash scripts/agent_smoke.sh            # starts its own server on port 8017
#   PORT=8000 NO_SERVER=1 bash scripts/agent_smoke.sh   # against a server already running
#   MODEL_PATH=/models/Qwen3-8B MODEL=qwen3 bash scripts/agent_smoke.sh  # a model that picks tools
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8017}
MODEL=${MODEL:-SmolLM2-135M-Instruct}
WORK=${WORK:-$(mktemp -d /tmp/jaxserve-agents.XXXXXX)}
LOG="$WORK/server.log"
PYTHON=${PYTHON:-python}
echo "work dir: $WORK"

npm install --silent --prefix "$WORK/npm" @openai/codex @anthropic-ai/claude-code >/dev/null
"$PYTHON" -m pip install -q anthropic >/dev/null

if [ -z "${NO_SERVER:-}" ]; then
  # The CLIs set no temperature: at the default 1.0 a 135M model rambles to the end of the
  # context, which Codex reports as a failed turn. Cooler defaults (--generation-config).
  mkdir -p "$WORK/gen"
  echo '{"temperature": 0.2, "repetition_penalty": 1.15}' >"$WORK/gen/generation_config.json"
  # The default model's whole context (8,192): Claude Code's and Codex's prompts are long.
  model_args=()
  [ -n "${MODEL_PATH:-}" ] && model_args=("$MODEL_PATH" --served-model-name "$MODEL")
  JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} "$PYTHON" -m jaxserve.serve "${model_args[@]}" --port "$PORT" \
    --max-model-len "${MAX_MODEL_LEN:-8192}" --enable-auto-tool-choice --tool-call-parser hermes \
    --generation-config "$WORK/gen" >"$LOG" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -20 "$LOG"; exit 1; }
    sleep 1
  done
fi
BASE="http://127.0.0.1:$PORT"
echo "The secret word is pineapple." >"$WORK/secret.txt"
status=0

echo "== anthropic SDK: a tool round trip, streamed"
"$PYTHON" - "$BASE" "$MODEL" <<'EOF' || status=1
import sys, anthropic
base, model = sys.argv[1:]
c = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
tool = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                         "required": ["path"]}}
ask = [{"role": "user", "content": "Read secret.txt and tell me the secret word."}]
with c.messages.stream(model=model, max_tokens=64, tools=[tool], messages=ask,
                       tool_choice={"type": "any"}) as s:
    first = s.get_final_message()
uses = [b for b in first.content if b.type == "tool_use"]
with c.messages.stream(model=model, max_tokens=64, tools=[tool], messages=[
        *ask, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                      "content": "The secret word is pineapple."}
                                     for u in uses]}]) as s:
    final = s.get_final_message()
print(f"tool_use {[(u.name, u.input) for u in uses]} -> {final.stop_reason}: "
      f"{''.join(b.text for b in final.content if b.type == 'text')[:80]!r}")
EOF

echo "== Claude Code (claude -p, the Read tool only: its full tool set overflows 8,192 tokens)"
(cd "$WORK" && HOME="$WORK" ANTHROPIC_BASE_URL="$BASE" ANTHROPIC_API_KEY=x \
  ANTHROPIC_MODEL="$MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL" DISABLE_TELEMETRY=1 \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 timeout 900 "$WORK/npm/node_modules/.bin/claude" \
  -p --tools Read --output-format json \
  "Use the Read tool to read secret.txt, then tell me the secret word." >"$WORK/claude.json") \
  || { echo "claude exited $?"; status=1; }
"$PYTHON" -c "import json,sys; r=json.load(open(sys.argv[1])); print('claude:', r['subtype'], 'turns', r['num_turns'], repr(r['result'][:80])); sys.exit(r['is_error'])" "$WORK/claude.json" || status=1

echo "== Codex CLI (codex exec, wire_api = responses)"
mkdir -p "$WORK/codex"
cat >"$WORK/codex/config.toml" <<EOF
model = "$MODEL"
model_provider = "jaxserve"
[model_providers.jaxserve]
name = "jaxserve"
base_url = "$BASE/v1"
wire_api = "responses"
EOF
(cd "$WORK" && CODEX_HOME="$WORK/codex" timeout 900 "$WORK/npm/node_modules/.bin/codex" exec \
  --skip-git-repo-check --json "Run: cat secret.txt, then tell me the secret word." \
  </dev/null >"$WORK/codex.jsonl" 2>"$WORK/codex.err") || { echo "codex exited $?"; status=1; }
grep -E '"type":"(turn.completed|turn.failed|error)"' "$WORK/codex.jsonl" | cut -c1-200
grep -q '"type":"turn.completed"' "$WORK/codex.jsonl" || status=1
grep -c '"type":"command_execution"' "$WORK/codex.jsonl" | sed 's/^/codex tool calls: /' || true

if [ -z "${NO_SERVER:-}" ]; then
  echo "== server log: the calls"
  grep -oE '"(POST|GET) /v1/(messages|responses)[^"]*" [0-9]{3}' "$LOG" | sort | uniq -c
  ! grep -qE '"(POST|GET) /v1/(messages|responses)[^"]*" 5[0-9]{2}' "$LOG" || status=1
fi
echo "agent smoke: $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
