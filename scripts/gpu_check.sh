#!/usr/bin/env bash
# One call on a machine with an NVIDIA GPU: the GPU tests, the train and sample benchmarks in
# float32 and bfloat16 (XLA and cuDNN attention for training), and speculative sampling of a
# small trained run. JSON lines in OUT_DIR/results.jsonl, a markdown table in OUT_DIR/summary.md,
# each step's output in OUT_DIR/<step>.log. It stops by itself within BUDGET_S seconds (480)
# and says which steps it skipped.
#
#   scripts/gpu_check.sh OUT_DIR            run it (on the GPU machine)
#   scripts/gpu_check.sh OUT_DIR --dry_run  print the plan and check every command's flags
#                                           (AO_MDM_CHECK_ONLY=1: checked, not run), on any CPU
#
# Install: a venv in OUT_DIR that sees the machine's own packages (an image with jax and its
# CUDA plugin keeps them), then the package: from wheels in $WHEELS without the network when
# set, else `pip install -e '.[cuda]'`. Env: PYTHON (python3; for --dry_run, the checkout's
# .venv/bin/python when there is one), BUDGET_S, WHEELS.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [--dry_run]}
dry=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
start=$(date +%s)
budget=${BUDGET_S:-480}
skipped=()

if [[ $dry == --dry_run ]]; then  # this checkout's .venv (as `make` makes it), else python3
  python=${PYTHON:-$([[ -x .venv/bin/python ]] && echo "$PWD/.venv/bin/python" || echo python3)}
  aomdm=(env AO_MDM_CHECK_ONLY=1 "$python" -m ao_mdm.cli.main)
else
  "${PYTHON:-python3}" -m venv --system-site-packages "$out/venv" || exit 1
  if [[ -n ${WHEELS:-} ]]; then
    "$out/venv/bin/pip" install -q --no-index --find-links "$WHEELS" -e . > "$out/install.log" 2>&1
  else
    "$out/venv/bin/pip" install -q -e '.[cuda]' > "$out/install.log" 2>&1
  fi || { echo "install failed: $out/install.log"; exit 1; }
  python=$out/venv/bin/python
  aomdm=(env JAX_PLATFORMS=cuda "$python" -m ao_mdm.cli.main)
fi

# step NAME SECONDS COMMAND...: runs it within its own limit and what is left of the budget;
# its last JSON line goes to results.jsonl under "step". A dry run checks an ao-mdm command's
# flags and only prints any other command.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$(( budget - ($(date +%s) - start) ))
  if [[ $dry == --dry_run ]]; then
    echo "plan: $name (at most ${limit} s): $*"
    [[ $1 == env && $2 == AO_MDM_CHECK_ONLY=1 ]] || return 0
    if [[ $name == demo_train ]]; then  # demo_speculative reads its run: one step, for real
      shift 2
      "$@" --config.train.num_steps=1 > "$out/$name.log" 2>&1
    else
      "$@" > "$out/$name.log" 2>&1
    fi || { echo "  flags refused: $(tail -1 "$out/$name.log")"; return 1; }
    return 0
  fi
  if (( left < 30 )); then
    skipped+=("$name")
    return 0
  fi
  (( limit > left )) && limit=$left
  echo "== $name (at most ${limit} s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local line
  line=$(grep '^{' "$out/$name.log" | tail -1)
  [[ -n $line ]] && echo "{\"step\": \"$name\", \"rc\": $rc, \"result\": $line}" >> "$out/results.jsonl"
  [[ -z $line ]] && echo "{\"step\": \"$name\", \"rc\": $rc}" >> "$out/results.jsonl"
  (( rc == 124 )) && echo "   stopped at its limit"
  return 0
}

failed=0
run_dir="$out/demo_run"
train_bench=(--config=configs/bench_train.py)
step gpu_tests 120 env JAX_PLATFORMS=cuda "$python" -m pytest -q -m gpu tests || failed=1
for dtype in float32 bfloat16; do
  for attention in xla cudnn; do
    step "bench_train_${dtype}_${attention}" 90 "${aomdm[@]}" bench train "${train_bench[@]}" \
      --config.model.dtype=$dtype --config.model.attention=$attention || failed=1
  done
  step "bench_sample_$dtype" 90 "${aomdm[@]}" bench sample --config=configs/bench_sampler.py \
    --dtype=$dtype || failed=1
done
step demo_train 120 "${aomdm[@]}" train --config=configs/demo.py --workdir="$run_dir" \
  --config.train.num_steps=300 --config.train.eval_every=0 || failed=1
step demo_speculative 60 "${aomdm[@]}" sample --checkpoint="$run_dir" --num_samples=2 \
  --mode=speculative --draft=4 --seed=4 || failed=1

if [[ $dry == --dry_run ]]; then
  (( failed )) && { echo "dry run: some commands' flags were refused (above)"; exit 1; }
  echo "dry run: every command's flags were accepted"
  exit 0
fi
{
  echo "| step | exit | figures |"
  echo "| --- | --- | --- |"
  "$python" - "$out/results.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
  r = json.loads(line)
  res = r.get("result", {})
  keys = [k for k in ("tokens_per_s", "mfu", "torch_tokens_per_s", "summary") if k in res]
  figures = "; ".join(f"{k}: {json.dumps(res[k])[:120]}" for k in keys) or "see the log"
  print(f"| {r['step']} | {r['rc']} | {figures} |")
EOF
} > "$out/summary.md"
cat "$out/summary.md"
(( ${#skipped[@]} )) && echo "skipped (budget of ${budget} s spent): ${skipped[*]}"
exit 0
