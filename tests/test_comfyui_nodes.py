"""The ComfyUI node pack's own parts without ComfyUI (integrations/comfyui/klein_nodes): IMAGE and MASK
tensors to and from klein's PNGs in both programs' conventions, the text inputs as request fields, klein's
JSON errors as the exception ComfyUI shows, reference sets reused by id and uploaded again when the server
forgot them, a job's steps on the progress bar; and the pack imports nothing ComfyUI lacks."""

import ast
import io
import json
import pathlib
import sys

import numpy as np
import PIL.Image
import pytest
import torch

from integrations.comfyui.klein_nodes import convert, nodes
from integrations.comfyui.klein_nodes.client import Client, KleinError, answered
from integrations.comfyui.klein_nodes.references import ReferenceSets
from klein import masks
from tests.support.serve_process import free_port

PACK = pathlib.Path(nodes.__file__).parent


def test_an_image_goes_to_png_and_back_level_for_level():
    levels = np.random.default_rng(0).integers(0, 256, (2, 24, 40, 3), dtype=np.uint8)
    image = torch.from_numpy(levels.astype(np.float32) / 255.0)  # ComfyUI's IMAGE: [B, H, W, C] in 0..1
    pngs = convert.image_pngs(image)
    assert len(pngs) == 2
    assert all(
        np.array_equal(np.asarray(PIL.Image.open(io.BytesIO(p))), levels[i]) for i, p in enumerate(pngs)
    )
    back = convert.images_of(pngs)
    assert back.shape == (2, 24, 40, 3) and back.dtype == torch.float32
    assert torch.equal(back, image)


def test_an_rgba_or_gray_image_becomes_rgb():
    rgba = torch.rand(1, 8, 8, 4)
    assert np.array_equal(convert.to_uint8(rgba[0]), convert.to_uint8(rgba[0, ..., :3]))
    gray = torch.rand(8, 8, 1)
    assert convert.to_uint8(gray).shape == (8, 8, 3)
    with pytest.raises(ValueError, match="C 1, 3 or 4"):
        convert.to_uint8(torch.rand(8, 8, 2))


def _comfyui_mask(picture: PIL.Image.Image) -> torch.Tensor:
    """What ComfyUI's LoadImage makes of a picture's alpha (nodes.py: 1 - alpha / 255)."""
    return 1.0 - torch.from_numpy(np.asarray(picture.getchannel("A"), np.float32) / 255.0)


def test_loadimage_masks_repaint_where_klein_repaints_openai_masks():
    # A painted-out (transparent) area: ComfyUI's mask 1 there, klein's from_alpha white there.
    alpha = np.full((16, 24), 255, np.uint8)
    alpha[4:10, 6:18] = 0
    picture = PIL.Image.new("RGBA", (24, 16), (10, 20, 30, 255))
    picture.putalpha(PIL.Image.fromarray(alpha, "L"))
    sent = PIL.Image.open(io.BytesIO(convert.mask_png(_comfyui_mask(picture), 24, 16)))
    assert sent.mode == "L"
    assert np.array_equal(np.asarray(masks.from_alpha(sent)), np.asarray(masks.from_alpha(picture)))
    assert np.asarray(sent)[5, 7] == 255 and np.asarray(sent)[0, 0] == 0


def test_soft_masks_keep_their_levels_as_klein_reads_arrays():
    mask = torch.from_numpy(np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8))
    sent = np.asarray(PIL.Image.open(io.BytesIO(convert.mask_png(mask, 8, 8))))
    assert np.array_equal(sent, np.asarray(masks.as_mask(mask.numpy())))


def test_a_mask_of_another_size_is_resized_to_the_image():
    mask = torch.zeros(1, 8, 8)
    mask[:, :, 4:] = 1.0  # the right half
    sent = np.asarray(PIL.Image.open(io.BytesIO(convert.mask_png(mask[0], 32, 16))))
    assert sent.shape == (16, 32)
    assert (sent[:, :14] == 0).all() and (sent[:, 18:] == 255).all()


def test_masks_are_matched_to_the_images():
    one, three = torch.rand(1, 4, 4), torch.rand(3, 4, 4)
    assert all(torch.equal(m, one[0]) for m in convert.masks_for(one, 3))
    assert [torch.equal(m, three[i]) for i, m in enumerate(convert.masks_for(three, 3))] == [True] * 3
    assert torch.equal(convert.masks_for(one[0], 1)[0], one[0])
    with pytest.raises(ValueError, match="2 masks for 3 images"):
        convert.masks_for(torch.rand(2, 4, 4), 3)


def test_text_inputs_become_request_fields():
    assert convert.loras(" ink:0.8, pen\nwash:-0.5 ,, ") == ["ink:0.8", "pen", "wash:-0.5"]
    assert convert.loras("  ") == []
    assert convert.size(0, 512) == "auto" and convert.size(768, 512) == "768x512"
    fields = nodes._fields("a fox", 7, 4, loras="ink", step_cache=" on ", guidance=0.0)
    assert fields == {"prompt": "a fox", "seed": 7, "num_inference_steps": 4, "loras": ["ink"], "cache": "on"}
    assert nodes._fields("a fox", 7, 4, guidance=3.5)["guidance_scale"] == 3.5


def test_set_keys_follow_the_bytes_and_their_order():
    a, b = b"first", b"second"
    assert convert.set_key([a, b]) == convert.set_key([a, b])
    assert convert.set_key([a, b]) != convert.set_key([b, a])
    assert convert.set_key([a + b]) != convert.set_key([a, b])


def test_kleins_json_error_is_the_exception_message():
    body = {
        "error": {
            "message": "loras: no LoRA named 'x'",
            "type": "invalid_request_error",
            "code": "invalid_value",
        }
    }
    error = answered(400, json.dumps(body).encode())
    assert str(error) == "loras: no LoRA named 'x'" and error.code == "invalid_value" and error.status == 400
    other = answered(502, b"<html>Bad Gateway</html>")
    assert str(other) == "HTTP 502 from the server, not klein's JSON error: <html>Bad Gateway</html>"


def test_the_server_url_and_key():
    with pytest.raises(KleinError, match="must start with http"):
        Client("127.0.0.1:8000")
    assert Client("http://h:1/ ", "k").url == "http://h:1" and Client("http://h:1", " k ").api_key == "k"


def test_the_key_comes_from_the_environment_when_empty(monkeypatch):
    monkeypatch.setenv("KLEIN_API_KEY", "from-env")
    assert Client("http://h:1", "").api_key == "from-env" and Client("http://h:1", "given").api_key == "given"


class FakeServer:
    """A `Client` stand-in: uploads get ids in turn; `forget()` makes every known id unknown."""

    url, api_key = "http://fake", ""

    def __init__(self):
        self.uploads, self.known = [], set()

    def post_files(self, path, fields, files):
        assert path == "/v1/references" and all(name == "image" for name, _ in files)
        self.uploads.append([data for _, data in files])
        set_id = f"set{len(self.uploads)}"
        self.known.add(set_id)
        return {"id": set_id}

    def use(self, set_id):
        if set_id not in self.known:
            raise KleinError(f"unknown reference id {set_id!r}", "unknown_reference", 404)
        return {"used": set_id}


def test_a_reference_set_is_uploaded_once_and_again_when_forgotten():
    sets, server = ReferenceSets(), FakeServer()
    pngs = [b"cat", b"hat"]
    assert sets.run(server, pngs, convert.set_key(pngs), server.use) == {"used": "set1"}
    assert sets.run(server, pngs, convert.set_key(pngs), server.use) == {"used": "set1"}
    assert server.uploads == [pngs]
    other = [b"hat", b"cat"]
    assert sets.run(server, other, convert.set_key(other), server.use) == {"used": "set2"}
    server.known.clear()  # evicted, or the server restarted
    assert sets.run(server, pngs, convert.set_key(pngs), server.use) == {"used": "set3"}
    assert len(server.uploads) == 3 and sets.uploads == 3


def test_other_errors_are_not_retried():
    sets, server = ReferenceSets(), FakeServer()

    def refused(set_id):
        raise KleinError("prompt: too long", "invalid_value", 400)

    sets.run(server, [b"x"], "k", server.use)
    with pytest.raises(KleinError, match="too long"):
        sets.run(server, [b"x"], "k", refused)
    assert len(server.uploads) == 1


def test_a_jobs_steps_and_result(monkeypatch):
    events = [("queued", {"position": 0}), ("stage", {"stage": "text"}), ("step", {"step": 1, "steps": 2})]
    events += [("step", {"step": 2, "steps": 2}), ("done", {"data": []})]
    client = Client("http://fake")
    monkeypatch.setattr(client, "post_json", lambda path, body: {"id": "j1", "status": "queued"})
    monkeypatch.setattr(client, "events", lambda path: iter(events))
    steps = []
    assert client.run_job({}, lambda step, total: steps.append((step, total)), lambda: False) == {"data": []}
    assert steps == [(1, 2), (2, 2)]
    monkeypatch.setattr(client, "events", lambda path: iter([("error", {"message": "boom", "code": "x"})]))
    with pytest.raises(KleinError, match="^boom$"):
        client.run_job({}, lambda step, total: None, lambda: False)


def test_an_interrupted_job_is_cancelled_on_the_server(monkeypatch):
    client, deleted = Client("http://fake"), []
    monkeypatch.setattr(client, "post_json", lambda path, body: {"id": "j1"})
    monkeypatch.setattr(client, "events", lambda path: iter([("step", {"step": 1, "steps": 4})] * 4))
    monkeypatch.setattr(client, "delete", deleted.append)
    with pytest.raises(InterruptedError):
        client.run_job({}, lambda step, total: None, lambda: True)
    assert deleted == ["/v1/jobs/j1"]


def test_an_unreachable_server_is_named():
    port = free_port()
    with pytest.raises(KleinError, match=f"^cannot reach klein serve at http://127.0.0.1:{port}: "):
        Client(f"http://127.0.0.1:{port}").post_json("/v1/jobs", {})


ALLOWED = {"torch", "numpy", "PIL", "comfy"}


def test_the_pack_imports_only_what_comfyui_has():
    for path in sorted(PACK.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in ALLOWED or top in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_the_nodes_are_declared_as_comfyui_reads_them():
    from integrations.comfyui import klein_nodes

    assert set(klein_nodes.NODE_CLASS_MAPPINGS) == set(klein_nodes.NODE_DISPLAY_NAME_MAPPINGS)
    for cls in klein_nodes.NODE_CLASS_MAPPINGS.values():
        declared = cls.INPUT_TYPES()
        assert callable(getattr(cls, cls.FUNCTION)) and isinstance(cls.RETURN_TYPES, tuple)
        assert set(declared) <= {"required", "optional"}
