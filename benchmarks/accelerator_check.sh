#!/usr/bin/env bash
# One prepared check for a machine with GPUs or Trainium (run it whenever a device is lent; record what it prints
# in docs/benchmarks.md). From a fresh checkout of the repo:
#
#   bash benchmarks/accelerator_check.sh              # ~1.2B Llama (Llama 3.2 1B shape), bf16, 200 steps
#   bash benchmarks/accelerator_check.sh --steps 100  # shorter
#   bash benchmarks/accelerator_check.sh --dry-run    # print the environment and every command; run nothing
#   bash benchmarks/accelerator_check.sh --cpu-tiny   # the whole flow on CPU with a tiny model (minutes)
#   DEVICE=cuda NDEV=8 HARDWARE=p5en.48xlarge bash benchmarks/accelerator_check.sh --dry-run  # another machine's plan
#
# What it runs, in bf16 (fp32 master weights, train.dtype = "bf16"):
#   1. paratrain train on one device           (autocast path)
#   2. a bare PyTorch loop of the same model    (benchmarks/accelerator_check.py bare)
#   3. paratrain train, FSDP2 over all devices  (MixedPrecisionPolicy path; skipped with one device)
# and prints tokens/s (median step after 10 warm-up steps), MFU against the hardware catalog's peak of this
# chip, peak memory, and paratrain / bare throughput per device. Sized to finish in ~8 minutes on one H200
# (about 0.3 s a step for 16k tokens at ~40% MFU, plus setup); HARDWARE=<catalog system> overrides the match.
#
# Setup (nothing is installed when the python in use already has torch, pydantic and tokenizers):
#   - torch with an accelerator importable: a venv with --system-site-packages, then `make install TORCH=`
#     (keeps that torch: the Makefile's CPU pin is skipped);
#   - otherwise: a venv, torch 2.13 from PyTorch's CUDA index, then `make install TORCH=`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STEPS=200
DRY_RUN=0
TINY=0
PYTHON="${PYTHON:-python3}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
OUT="${OUT:-runs/accelerator_check}"

usage() { sed -n '2,23p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --cpu-tiny) TINY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "accelerator_check.sh: unknown argument '$1' (allowed: --steps N, --dry-run, --cpu-tiny)" >&2; exit 2 ;;
  esac
done
case "$STEPS" in ''|*[!0-9]*) echo "accelerator_check.sh: --steps '$STEPS': allowed: a whole number > 10" >&2; exit 2 ;; esac
if [ "$STEPS" -le 10 ]; then echo "accelerator_check.sh: --steps $STEPS: allowed: > 10 (10 warm-up steps)" >&2; exit 2; fi

run() {  # print, then run unless --dry-run
  echo "+ $*" >&2
  if [ "$DRY_RUN" = 0 ]; then "$@"; fi
}

# ---- setup -------------------------------------------------------------------------------------------------
# one probe of the python in use: "<torch sees an accelerator: 0|1> <all dependencies importable: 0|1>"
PROBE="$("$PYTHON" -c '
import importlib.util as u
try:
    import torch
    accel = int(torch.accelerator.is_available())
except ImportError:
    accel = 0
print(accel, int(all(u.find_spec(m) for m in ("torch", "pydantic", "tokenizers", "numpy"))))' 2>/dev/null || echo "0 0")"
read -r ACCEL DEPS <<< "$PROBE"

if [ "$TINY" = 0 ] && ! { [ "$DEPS" = 1 ] && [ "$ACCEL" = 1 ]; }; then
  if [ "$ACCEL" = 1 ]; then
    run "$PYTHON" -m venv --system-site-packages .venv
  else
    run "$PYTHON" -m venv .venv
    run .venv/bin/pip install -q "torch==2.13.0" --index-url "$TORCH_INDEX"
  fi
  run make install TORCH=
  if [ "$DRY_RUN" = 0 ]; then PYTHON=.venv/bin/python; fi
elif [ "$TINY" = 1 ] && [ "$DEPS" = 0 ]; then
  run make install
  if [ "$DRY_RUN" = 0 ]; then PYTHON=.venv/bin/python; fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PT=("$PYTHON" -m paratrain)

# ---- device, ranks, catalog system ----------------------------------------------------------------------------
if [ "$TINY" = 1 ]; then
  DEVICE=cpu; NDEV=2; HARDWARE="${HARDWARE:-}"
  export OMP_NUM_THREADS=1
else
  # DEVICE / NDEV from the environment override the detection (e.g. a --dry-run of another machine's plan)
  DEVICE="${DEVICE:-$("$PYTHON" -c 'from paratrain.device import available_accelerator as a; print(a() or "")' 2>/dev/null || true)}"
  NDEV="${NDEV:-$("$PYTHON" -c 'from paratrain.device import accelerator_count as c; print(c())' 2>/dev/null || echo 0)}"
  if [ -z "$DEVICE" ]; then
    if [ "$DRY_RUN" = 1 ]; then DEVICE="(none found)"; NDEV=0; else
      echo "accelerator_check.sh: torch sees no accelerator here; allowed: a GPU or Trainium machine, or --cpu-tiny" >&2
      exit 2
    fi
  fi
  HARDWARE="${HARDWARE:-$("$PYTHON" benchmarks/accelerator_check.py system 2>/dev/null || true)}"
fi
echo "device: ${DEVICE} x ${NDEV}; catalog system for MFU: ${HARDWARE:-(none: MFU not reported)}; steps ${STEPS}"

# ---- the job ------------------------------------------------------------------------------------------------
if [ "$TINY" = 1 ]; then  # the tiny shape: the same flow in seconds per step on a CPU
  SHAPE=(--layers 2 --hidden 128 --heads 4 --kv-heads 2 --ffn-hidden 352 --vocab 4096 --seq 64 --batch 4)
  L=2 H=128 A=4 KV=2 F=352 V=4096 SEQ=64 BATCH=4
else  # Llama 3.2 1B: 16 layers, 2048 wide, GQA 32/8, SwiGLU 8192, vocab 128256, tied embeddings (1.24B)
  SHAPE=(--layers 16 --hidden 2048 --heads 32 --kv-heads 8 --ffn-hidden 8192 --vocab 128256 --seq 2048 --batch 8)
  L=16 H=2048 A=32 KV=8 F=8192 V=128256 SEQ=2048 BATCH=8
fi
mkdir -p "$OUT"
SETS=(--set "model.layers=$L" --set "model.hidden=$H" --set "model.heads=$A" --set "model.kv_heads=$KV"
      --set "model.ffn_hidden=$F" --set "model.vocab=$V" --set "model.max_seq=$SEQ" --set "model.tie_embeddings=true"
      --set "train.seq_len=$SEQ" --set "train.microbatch=$BATCH" --set 'train.dtype="bf16"'
      --set "train.steps=$STEPS" --set "train.eval_every=0" --set "train.progress=false" --set "train.log_every=50"
      --set "checkpoint.save_final=false" --set 'checkpoint.resume="none"' --set "metrics.tensorboard=false"
      --set "data.prepared_dir=\"$OUT/data\"" --set "train.device=\"$DEVICE\"")
if [ -n "$HARDWARE" ]; then SETS+=(--set "metrics.hardware=\"$HARDWARE\""); fi
"$PYTHON" -c "import json; print(json.dumps(dict(name='check', layers=$L, hidden=$H, heads=$A, kv_heads=$KV,
  ffn_hidden=$F, vocab=$V, max_seq=$SEQ, tie_embeddings=True)))" > "$OUT/model.json"

echo "+ ${PT[*]} config ... (checks the job's config, also in a dry run)" >&2
"${PT[@]}" config "${SETS[@]}" --set "train.global_batch=$BATCH" > /dev/null
run "${PT[@]}" data prepare "${SETS[@]}"

run "${PT[@]}" train "${SETS[@]}" --set "train.global_batch=$BATCH" --set "metrics.run_dir=\"$OUT/paratrain1\"" \
  --summary-json "$OUT/paratrain1/summary.json"
run "$PYTHON" benchmarks/accelerator_check.py paratrain --run-dir "$OUT/paratrain1" --label "paratrain, 1 device" \
  --out "$OUT/paratrain1.json"
run "$PYTHON" benchmarks/accelerator_check.py bare "${SHAPE[@]}" --steps "$STEPS" --device "$DEVICE" \
  --out "$OUT/bare.json"
RUNS=("$OUT/paratrain1.json" "$OUT/bare.json")
if [ "$NDEV" -gt 1 ]; then
  run "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NDEV" -m paratrain train "${SETS[@]}" \
    --set "train.global_batch=$((BATCH * NDEV))" --set 'parallel.dp_kind="fsdp"' \
    --set "metrics.run_dir=\"$OUT/fsdp\"" --summary-json "$OUT/fsdp/summary.json"
  run "$PYTHON" benchmarks/accelerator_check.py paratrain --run-dir "$OUT/fsdp" \
    --label "paratrain FSDP2, $NDEV devices" --out "$OUT/fsdp.json"
  RUNS+=("$OUT/fsdp.json")
else
  echo "(one device: FSDP over all devices skipped)"
fi
run "$PYTHON" benchmarks/accelerator_check.py report "${RUNS[@]}" --model-json "$OUT/model.json" --seq "$SEQ" \
  --hardware "$HARDWARE"
