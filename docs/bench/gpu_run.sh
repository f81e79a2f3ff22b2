#!/bin/bash
# How the README's GPU table was measured on the lent device machine (an NVIDIA H100/H200 that
# OpenVINO's GPU plugin sees through PoCL). Carried there in three calls (64 MiB each, the machine
# kept warm between them): .carry/a = site.tar.xz (cp312 wheels of OpenVINO, GenAI, tokenizers,
# NNCF, aiohttp, zeroconf, cryptography ... unpacked, unused frontends and the NPU plugin left out)
# + the smollm2-135m store entry without its GGUF + the GGUF's first part; .carry/b and .carry/c
# the GGUF's other parts.
#   docs/bench/gpu_run.sh setup | model | tests | probe | streams | mixedtest | parity | pipeline | pipeline2 | pipeline2r | mixed | spec   (several in one call)
# Logs and JSON lines go to $OUT (or ./gpu_out).
set -u
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/.carry/site PYTHONUNBUFFERED=1 LAKESHARD_MODELS_DIR=$PWD/.carry/models PYTHONWARNINGS=ignore
t0=$(date +%s)
left() { echo $(( ${BUDGET:-590} - ($(date +%s) - t0) )); }
for phase in "$@"; do
  echo "== $phase at +$(( $(date +%s) - t0 ))s"
  case $phase in
    setup)
      python3 -c "import tarfile, os; os.makedirs('.carry/site', exist_ok=True); tarfile.open('.carry/a/site.tar.xz').extractall('.carry/site', filter='data')"
      mkdir -p .carry/models && cp -r .carry/a/smollm2-135m .carry/models/
      python3 -c "import openvino as ov; c=ov.Core(); print(ov.__version__, c.available_devices, [c.get_property(d,'FULL_DEVICE_NAME') for d in c.available_devices])"
      python3 -c "import openvino_genai, aiohttp, cryptography, zeroconf, msgpack, nncf, transformers, torch, platformdirs, jinja2, tqdm, tokenizers; print('transformers', transformers.__version__, 'torch', torch.__version__)" ;;
    model)
      cat .carry/d/gguf.aa .carry/b/gguf.ab .carry/c/gguf.ac > .carry/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
      sha256sum .carry/models/smollm2-135m/*.gguf ;;
    tests)
      timeout $(left) python3 -m pytest tests/test_gpu.py -p no:cacheprovider -rA -s 2>&1 | tee "$OUT/test_gpu.log" | tail -40 ;;
    probe)  # why streams stepped in turn on one GPU stage differ from their solo runs
      timeout $(left) python3 docs/bench/gpu_interleave_probe.py GPU CPU 2>&1 | tee "$OUT/interleave_probe.log" | grep '^{' ;;
    mixedtest)
      timeout $(left) python3 -m pytest tests/test_gpu.py -k mixed -p no:cacheprovider -rA 2>&1 | tee "$OUT/test_gpu_mixed.log" | tail -15 ;;
    parity)
      timeout $(left) python3 -m agent bench parity --device GPU --runs 3 --tokens 64 --json 2>&1 | tee "$OUT/parity_gpu.log" | tail -8 ;;
    pipeline)
      timeout $(left) python3 -m agent bench pipeline --device GPU --stages 1,2 --streams 1,2 --runs 2 --json 2>&1 | tee "$OUT/pipeline_gpu.log" | tail -12 ;;
    pipeline2)  # 2 GPU stages, 1 and 2 streams (each stream its own compiled model on the GPU)
      timeout $(left) python3 -m agent bench pipeline --device GPU --stages 2 --streams 1,2 --runs 2 --json 2>&1 | tee "$OUT/pipeline_gpu2.log" | tail -12 ;;
    streams)  # no model store needed: random weights (std 0.4) from the bundled config
      timeout $(left) python3 docs/bench/gpu_streams_check.py GPU 2>&1 | tee "$OUT/streams_check.log" | grep '^{' ;;
    pipeline2r)  # pipeline2 on random weights (speed only; no model store needed)
      timeout $(left) python3 -m agent bench pipeline --device GPU --random-weights --stages 2 --streams 1,2 --runs 2 --json 2>&1 | tee "$OUT/pipeline_gpu2_random.log" | tail -12 ;;
    mixed)
      timeout $(left) python3 -m agent bench pipeline --device GPU,CPU --stages 2 --streams 1,2 --cores-per-node 4 --runs 2 --json 2>&1 | tee "$OUT/pipeline_mixed.log" | tail -8 ;;
    spec)
      timeout $(left) python3 -m agent bench spec --device GPU --stages 1 --k auto,3,5 --prompts code --json 2>&1 | tee "$OUT/spec_gpu.log" | tail -12 ;;
  esac
done
echo "== done at +$(( $(date +%s) - t0 ))s"
