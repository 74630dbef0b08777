#!/usr/bin/env bash
# The one command a GPU session runs on the device machine (docs/dev/contributing.md, "GPU
# check"), from the checkout:
#
#     bash launch/gpu_run.sh [gpu_check.py arguments]
#
# - installs the checkout (pip install --no-deps --no-build-isolation -e .); if that fails
#   it says so and goes on from the checkout (PYTHONPATH), so the run never ends on the
#   install;
# - sets the Hugging Face hub offline (the device machine reaches no network);
# - runs launch/gpu_check.py (every artefact under $OUT, default out/gpu_check) under an
#   outer time limit, GPU_RUN_LIMIT seconds (480: the sections' own limits add up to 7
#   minutes), stopping it with SIGINT so that its finally blocks and reports run (a
#   KILL follows 30 s later if it does not stop);
# - exits with gpu_check's status (124 when the outer limit stopped it).
#
# CI dry-runs this exact script on CPU (.ci/run step 1b): GPU_RUN_ARGS="--device cpu --smoke".
# GPU_RUN_INSTALL replaces the install command (the tests make it fail on purpose).
set -u
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/out/gpu_check}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
install="${GPU_RUN_INSTALL:-python -m pip install --no-deps --no-build-isolation -e .}"
echo "gpu_run: $install"
set -o pipefail
$install 2>&1 | tail -n 15
status=$?
set +o pipefail
if [ "$status" -ne 0 ]; then
  echo "gpu_run: the install failed (exit $status); running from the checkout"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
limit="${GPU_RUN_LIMIT:-480}"
# shellcheck disable=SC2086
timeout -s INT -k 30 "$limit" python launch/gpu_check.py --out "$OUT" ${GPU_RUN_ARGS:-} "$@"
rc=$?
[ "$rc" -eq 124 ] && echo "gpu_run: stopped at the outer limit of $limit s (SIGINT)"
echo "gpu_run: gpu_check exited $rc"
exit "$rc"
