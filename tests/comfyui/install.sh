#!/usr/bin/env bash
# The environment tests/test_comfyui.py runs ComfyUI from: a venv at .venv-comfyui/ with ComfyUI's
# requirements (requirements.txt here, pinned) and the vendored ComfyUI source unpacked beside it, at
# .venv-comfyui/ComfyUI. `bash tests/comfyui/install.sh` from anywhere; .ci/run runs it in the background,
# beside the suite: .venv-comfyui/installed says it is complete (tests/support/comfyui_process.py waits for
# it), .venv-comfyui/failed that it stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .venv-comfyui
mkdir .venv-comfyui
trap '[ -e .venv-comfyui/installed ] || touch .venv-comfyui/failed' EXIT
python3 -m venv .venv-comfyui
.venv-comfyui/bin/python -m pip install --quiet -r tests/comfyui/requirements.txt
tar -xzf tests/comfyui/ComfyUI-a125cd84.tar.gz -C .venv-comfyui
.venv-comfyui/bin/python -m compileall -q .venv-comfyui/ComfyUI > /dev/null
touch .venv-comfyui/installed
