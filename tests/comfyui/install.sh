#!/usr/bin/env bash
# The environment tests/test_comfyui.py runs ComfyUI from: a venv at .venv-comfyui/ with ComfyUI's
# requirements (requirements.txt here, pinned) and the vendored ComfyUI source unpacked beside it, at
# .venv-comfyui/ComfyUI. `bash tests/comfyui/install.sh` from anywhere; .ci/run runs it in the background.
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .venv-comfyui
python3 -m venv .venv-comfyui
.venv-comfyui/bin/python -m pip install --quiet -r tests/comfyui/requirements.txt
tar -xzf tests/comfyui/ComfyUI-a125cd84.tar.gz -C .venv-comfyui
.venv-comfyui/bin/python -m compileall -q .venv-comfyui/ComfyUI > /dev/null
