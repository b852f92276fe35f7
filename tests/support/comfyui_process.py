"""A real ComfyUI, headless on the CPU, for the node pack's tests: started from the environment that
tests/comfyui/install.sh makes (.venv-comfyui/, the vendored source in it) with a base directory of the
test's own, the pack linked into its custom_nodes/; API-format workflows submitted to /prompt and followed
on its websocket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import subprocess
import tempfile
import time
import uuid

import aiohttp
import httpx

from tests.support.serve_process import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-comfyui"
SOURCE = VENV / "ComfyUI"
PACK = ROOT / "integrations" / "comfyui" / "klein_nodes"
WORKFLOWS = ROOT / "integrations" / "comfyui" / "workflows"


def installed() -> bool:
    """Whether tests/comfyui/install.sh has completed here."""
    return (VENV / "installed").exists()


def wait_installed(seconds: float = 900) -> None:
    """Return once the environment is complete: CI installs it while the suite runs (.ci/run); an install
    that stopped, or none within `seconds`, raises."""
    deadline = time.monotonic() + seconds
    while not installed():
        if (VENV / "failed").exists() or time.monotonic() > deadline:
            raise RuntimeError(
                f"ComfyUI's environment {VENV} is not installed: bash tests/comfyui/install.sh"
            )
        time.sleep(1)


def start(base: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """(process, URL) of ComfyUI with `base` as its --base-directory and the pack in its custom_nodes/,
    started, not yet ready (`wait_ready`): the caller may start other things meanwhile."""
    wait_installed()
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / PACK.name).symlink_to(PACK, target_is_directory=True)
    port = free_port()
    command = [str(VENV / "bin" / "python"), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port)]
    command += [
        "--disable-auto-launch",
        "--base-directory",
        str(base),
        "--database-url",
        "sqlite:///:memory:",
        "--disable-api-nodes",  # ComfyUI's nodes for paid online APIs: a third of its start, unused here
    ]
    log = tempfile.TemporaryFile("w+")
    env = {name: value for name, value in os.environ.items() if name != "KLEIN_API_KEY"}
    process = subprocess.Popen(command, cwd=SOURCE, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    process.log = log
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen, url: str, seconds: float = 180) -> None:
    """Until /system_stats answers and the pack's nodes are loaded (a pack that fails to import leaves
    ComfyUI running without them: its log says why)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {process.returncode}:\n{log_of(process)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/system_stats", timeout=2).status_code == 200:
                if httpx.get(url + "/object_info/KleinGenerate", timeout=10).json():
                    return
                raise RuntimeError(f"ComfyUI started without the klein nodes:\n{log_of(process)}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"ComfyUI did not answer within {seconds} s:\n{log_of(process)}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def log_of(process: subprocess.Popen) -> str:
    process.log.seek(0)
    return process.log.read()


def workflow(name: str) -> dict:
    """A workflow the docs show (integrations/comfyui/workflows/NAME.json), API format."""
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def run(url: str, prompt: dict, seconds: float = 120) -> tuple[dict, list[dict]]:
    """(history entry, progress messages) of one workflow submitted to /prompt, followed on the websocket
    until ComfyUI says the prompt finished."""
    return asyncio.run(_run(url, prompt, seconds))


async def _run(url: str, prompt: dict, seconds: float) -> tuple[dict, list[dict]]:
    client_id = uuid.uuid4().hex
    progress = []
    timeout = aiohttp.ClientTimeout(total=seconds)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.ws_connect(f"{url}/ws?clientId={client_id}") as socket:
            body = {"prompt": prompt, "client_id": client_id}
            async with session.post(url + "/prompt", json=body) as response:
                answer = await response.json()
                assert response.status == 200, answer
            prompt_id = answer["prompt_id"]
            async for message in socket:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue  # binary: preview images
                event = json.loads(message.data)
                data = event.get("data", {})
                if data.get("prompt_id") != prompt_id:
                    continue
                if event["type"] == "progress":
                    progress.append(data)
                if event["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                    break
        # The history entry is written just after the websocket's last message.
        while True:
            async with session.get(f"{url}/history/{prompt_id}") as response:
                history = await response.json()
            if prompt_id in history:
                return history[prompt_id], progress
            await asyncio.sleep(0.05)
