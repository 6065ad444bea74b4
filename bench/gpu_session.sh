#!/usr/bin/env bash
# The GPU figures of issues 9, 10 and 11 on a lent GPU machine, in three calls of about 4, 5 and 4 minutes.
#
#   bash bench/gpu_session.sh OUT 1    # GPU tests; profile of the paper's architectures on CUDA and this
#                                      # box's CPU (-> OUT/profile/gpu.json); llm bench (e) and (b) on CUDA
#   bash bench/gpu_session.sh OUT 2    # the profile again without plots; bench --real --device cuda (3
#                                      # repetitions, scheduling on estimates); llm bench (c) on CUDA
#   bash bench/gpu_session.sh OUT 3    # line A's architectures profiled on CUDA and the CPU (-> OUT/line-A.json),
#                                      # then bench --real --device cuda scheduling on those measured costs,
#                                      # at the task's arrival rate and saturated (--arrival-ms 0.5)
#   bash bench/gpu_session.sh OUT 4    # a re-check in one call of about 8 minutes: the split's GPU test and
#                                      # llm bench (e) with the in-place cost that includes taking the weights,
#                                      # and phase 3's saturated run through --arrival-ms
#   bash bench/gpu_session.sh OUT 5    # the split alone, in about 2 minutes: its GPU tests and llm bench (e)
#   bash bench/gpu_session.sh OUT 6    # about 7 minutes: the split's and the prefill stream's GPU tests, the
#                                      # memory cgroup's tests, llm bench (e), then (c) on CUDA with host memory
#                                      # bounded by a cgroup (the same-memory GPU comparison)
#   bash bench/gpu_session.sh OUT 7    # about 7 minutes: the GPU tests, (c) on CUDA bounded as in phase 6 (with
#                                      # the 'ram' run's host memory as the baseline), (e), and (b) on CUDA
#   bash bench/gpu_session.sh OUT 8    # about 4 minutes: (c) on CUDA as in phase 7 with 128 tokens (past the
#                                      # cold start)
#   bash bench/gpu_session.sh OUT 9    # about 2 minutes: the GPU tests of the pinned buffers, the split and the
#                                      # prefill stream, then (e) (the host tier keeping the stream's bytes)
#   bash bench/gpu_session.sh OUT 10   # about 9 minutes: the GPU test of the token-wise prefetch into a CUDA pool,
#                                      # then issue 11's (d) ablation on CUDA (prefetch, substitution and the oracle
#                                      # rows with a GPU pool behind the pinned host tier; each row is logged as it
#                                      # ends), then (b) on CUDA for a third GPU run of the 1.3x target
#   bash bench/gpu_session.sh OUT 11   # about 7 minutes: the GPU tests of the exclusive host tier and the CUDA
#                                      # prefetch, then (b) on CUDA with the inclusive and the exclusive host tier one
#                                      # after the other, then (d) on CUDA with the exclusive one
#   bash bench/gpu_session.sh OUT 12   # about 7 minutes: (b) on CUDA with the inclusive and the exclusive host tier,
#                                      # then (c) with the exclusive one at 128 tokens (against accelerate, as phase 8)
#   bash bench/gpu_session.sh OUT 13   # about 8 minutes: every GPU test; line A profiled on CUDA and the CPU, then
#                                      # bench --real --device cuda saturated (read-ahead, fill, hold and the
#                                      # prefetch decided at dispatch, none measured on a GPU before); (b) on CUDA
#                                      # with the inclusive tier (its predicted+admission row: declined experts on
#                                      # the CPU beside a GPU pool) and with the exclusive tier (its buffers reused)
#
# The phases that profile (1, 2, 3, 4, 13) need zstandard on the box: put its wheel in .gpu/whl beside the others
# (docs/gpu-runs/README.md has the pip download line).
# Run it after `bash .gpu/on-device.sh` installed the wheels (see ../shared/gpu/README.md), e.g.
#   bash .gpu/on-device.sh 'bash bench/gpu_session.sh $OUT 1'
# with var/llm/trained-40x32.trace, var/llm/trained-hf/config.json and var/llm/trained/llm.json carried
# (the trained small MoE's trace: (b) replays its routing; training it takes 8 minutes).
# Every step has its own time limit and writes its whole output to OUT/<step>.log; a step that fails or
# runs out of time does not stop the next.  Nothing here is a test: the figures are read off the logs.
set -u
OUT=${1:?usage: bash bench/gpu_session.sh OUT 1|2|...|13}
PHASE=${2:?usage: bash bench/gpu_session.sh OUT 1|2|...|13}
case "$PHASE" in 1|2|3|4|5|6|7|8|9|10|11|12|13) ;; *) echo "phase must be 1 to 13, got '$PHASE'" >&2; exit 2 ;; esac
mkdir -p "$OUT"
export YOLO_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export COE_DATA_DIR="${COE_DATA_DIR:-var/line-paper}"
W=var/llm

step() {   # step NAME SECONDS CMD...: run CMD with a time limit, log to OUT/NAME.log, print its tail
  local name=$1 secs=$2 t0=$SECONDS rc
  shift 2
  echo "=== $name (limit ${secs} s): $*"
  timeout --kill-after=10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  grep -v -e '^\s*$' -e 'it/s\]' -e 'step/s\]' "$OUT/$name.log" | tail -n "${TAIL:-25}"
}

big_model() {   # the generated 2.2 GB model of the trained trace's shape, imported: what llm bench makes
  python3 - <<'EOF'
from pathlib import Path
from routing.moe_trace import Trace
from edge_agent.llm_models import generated_model
from storage.llm_import import import_checkpoint
t = Trace.load("var/llm/trained-40x32.trace")
hf, store = Path("var/llm/big-hf"), Path("var/llm/big")
if not (hf / "config.json").is_file():
    generated_model(hf, expert_gb=2.2, layers=len(t.layers), experts=t.num_experts, top_k=t.top_k)
if not (store / "llm.json").is_file():
    import_checkpoint(hf, store, name="big")
print("big model ready")
EOF
}

model_start() {   # make the big model in the background while untimed steps run
  big_model >"$OUT/big-model.log" 2>&1 &
  maker=$!
}

model_ready() {   # wait for model_start's maker; never beside a timed step
  wait "$maker"; echo "=== big model: $(tail -n 1 "$OUT/big-model.log")"
}

llm_gpu_tests() {   # llm_gpu_tests SECONDS: the GPU tests of the pinned buffers, the split and the prefill stream
  TAIL=8 step gpu-tests "$1" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pinned.py \
    tests/test_moe_fiddler.py tests/test_moe_prefill.py
}

line_a_config() {   # line A with a GPU executor and a CPU executor (the systems `bench --real --device cuda`
  # compares), so the real run's scheduler reads measured costs of its architectures on both devices
  python3 -c '
import os, yaml
cfg = yaml.safe_load(open("configs/line-A.yaml"))
cfg.update(spec=os.path.abspath("configs/specs/line-A.coe.yaml"), data_dir="var/line-A-gpu", cpu_tier="400MB",
           executors=[{"device": "cuda", "memory": "400MB"}, {"device": "cpu", "memory": "400MB"}])
cfg["metrics"] = {"enabled": False}
yaml.safe_dump(cfg, open("/tmp/line-A-gpu.yaml", "w"))'
}

if [ "$PHASE" = 1 ]; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
  # the model is made on the CPU while the (untimed) GPU tests and the zoo build run
  model_start
  TAIL=8 step gpu-tests 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_moe_prefill.py tests/test_moe_fiddler.py tests/test_simdevice.py
  step zoo 60 coe-agent zoo build --config configs/line-paper.yaml
  model_ready
  mkdir -p "$OUT/profile"
  TAIL=30 step profile 150 coe-agent profile --config configs/line-paper.yaml --out "$OUT/profile/gpu.json"
  TAIL=12 step llm-e 90 coe-agent llm bench --work $W --part e
  TAIL=16 step llm-b 130 coe-agent llm bench --work $W --part b --device cuda
elif [ "$PHASE" = 5 ]; then
  model_start
  TAIL=8 step gpu-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_fiddler.py
  model_ready
  TAIL=12 step llm-e 110 coe-agent llm bench --work $W --part e
elif [ "$PHASE" = 6 ]; then
  { nvidia-smi; mount | grep cgroup; cat /proc/self/cgroup; free -m; nproc; } >"$OUT/box.txt" 2>&1
  model_start
  llm_gpu_tests 100
  TAIL=8 step cgroup-tests 40 python3 -m pytest -q -p no:cacheprovider tests/test_memory_cgroup.py -k "not end_to_end"
  model_ready
  TAIL=12 step llm-e 110 coe-agent llm bench --work $W --part e
  TAIL=20 step llm-c 210 coe-agent llm bench --work $W --part c --device cuda
elif [ "$PHASE" = 7 ]; then
  model_start
  llm_gpu_tests 90
  model_ready
  TAIL=20 step llm-c 210 coe-agent llm bench --work $W --part c --device cuda
  TAIL=12 step llm-e 60 coe-agent llm bench --work $W --part e
  TAIL=16 step llm-b 130 coe-agent llm bench --work $W --part b --device cuda
elif [ "$PHASE" = 9 ]; then
  model_start
  llm_gpu_tests 60
  model_ready
  TAIL=12 step llm-e 70 coe-agent llm bench --work $W --part e
elif [ "$PHASE" = 10 ]; then
  model_start
  TAIL=8 step gpu-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_pooled.py -k cuda_pool
  model_ready
  TAIL=40 step llm-d 330 coe-agent llm bench --work $W --part d --device cuda
  TAIL=16 step llm-b 110 coe-agent llm bench --work $W --part b --device cuda
elif [ "$PHASE" = 11 ]; then
  model_start
  TAIL=8 step gpu-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_host_tier.py \
    tests/test_moe_pooled.py -k "cuda"
  model_ready
  TAIL=16 step llm-b-inclusive 100 coe-agent llm bench --work $W --part b --device cuda --host-mode inclusive
  TAIL=16 step llm-b-exclusive 100 coe-agent llm bench --work $W --part b --device cuda --host-mode exclusive
  TAIL=40 step llm-d-exclusive 200 coe-agent llm bench --work $W --part d --device cuda --host-mode exclusive
elif [ "$PHASE" = 12 ]; then
  model_start
  model_ready
  TAIL=16 step llm-b-inclusive 100 coe-agent llm bench --work $W --part b --device cuda --host-mode inclusive
  TAIL=16 step llm-b-exclusive 100 coe-agent llm bench --work $W --part b --device cuda --host-mode exclusive
  TAIL=20 step llm-c-exclusive 240 coe-agent llm bench --work $W --part c --device cuda --e2e-tokens 128 \
    --host-mode exclusive
elif [ "$PHASE" = 8 ]; then
  model_start
  model_ready
  TAIL=20 step llm-c 240 coe-agent llm bench --work $W --part c --device cuda --e2e-tokens 128
elif [ "$PHASE" = 3 ] || [ "$PHASE" = 4 ]; then
  if [ "$PHASE" = 4 ]; then
    model_start
    TAIL=8 step gpu-tests 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_moe_fiddler.py
  fi
  line_a_config
  export COE_DATA_DIR=var/line-A-gpu
  step zoo-A 90 coe-agent zoo build --config /tmp/line-A-gpu.yaml
  # the model is made while the untimed steps run, never beside a profile or a timed run
  [ "$PHASE" = 4 ] && model_ready
  TAIL=14 step profile-A 150 coe-agent profile --config /tmp/line-A-gpu.yaml --out var/line-A-gpu/profile.json \
    --no-plots
  cp var/line-A-gpu/profile.json "$OUT/line-A.json"
  [ "$PHASE" = 3 ] && TAIL=30 step real-profiled 170 coe-agent bench --real --device cuda --repeats 3
  TAIL=30 step real-saturated 120 coe-agent bench --real --device cuda --repeats 3 --arrival-ms 0.5
  if [ "$PHASE" = 4 ]; then
    TAIL=12 step llm-e 110 coe-agent llm bench --work $W --part e
  fi
elif [ "$PHASE" = 13 ]; then
  model_start
  TAIL=10 step gpu-all 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests
  line_a_config
  export COE_DATA_DIR=var/line-A-gpu
  step zoo-A 90 coe-agent zoo build --config /tmp/line-A-gpu.yaml
  model_ready
  TAIL=14 step profile-A 140 coe-agent profile --config /tmp/line-A-gpu.yaml --out var/line-A-gpu/profile.json \
    --no-plots
  cp var/line-A-gpu/profile.json "$OUT/line-A.json"
  TAIL=30 step real-saturated 110 coe-agent bench --real --device cuda --repeats 3 --arrival-ms 0.5
  export COE_DATA_DIR=var/line-paper
  TAIL=16 step llm-b-inclusive 100 coe-agent llm bench --work $W --part b --device cuda --host-mode inclusive
  TAIL=16 step llm-b-exclusive 100 coe-agent llm bench --work $W --part b --device cuda --host-mode exclusive
else
  # the profile again, without plots (a call brings back a few files only; phase 1's profile dir was too many)
  TAIL=8 step profile2 150 coe-agent profile --config configs/line-paper.yaml --out "$OUT/gpu.json" --no-plots
  TAIL=30 step real 150 coe-agent bench --real --device cuda --repeats 3
  TAIL=20 step llm-c 170 coe-agent llm bench --work $W --part c --device cuda
fi
