"""Without Ray installed, the commands that need it say so (exit 2, naming `pip install 'klein[ray]'`)
and nothing else changes."""

import importlib.util

import pytest
import ray  # noqa: F401  (in the test extra: a broken install fails here rather than skipping a test)

from klein.cli import main as cli

REAL = importlib.util.find_spec


@pytest.mark.parametrize(
    "argv", [["serve", "--replicas", "2"], ["batch", "{requests}", "--out", "{out}", "--ray"]]
)
def test_ray_commands_name_the_extra_when_ray_is_missing(argv, monkeypatch, capsys, tmp_path):
    (tmp_path / "requests.jsonl").write_text('{"prompt": "x"}\n')
    argv = [word.format(requests=tmp_path / "requests.jsonl", out=tmp_path / "out") for word in argv]
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else REAL(name, *a)
    )
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert "pip install 'klein[ray]'" in error and "Traceback" not in error


def test_ray_flags_go_with_replicas_and_ray(capsys, tmp_path):
    assert cli.main(["serve", "--ray-address", "auto"]) == 2
    assert "--replicas" in capsys.readouterr().err
    (tmp_path / "requests.jsonl").write_text('{"prompt": "x"}\n')
    assert (
        cli.main(["batch", str(tmp_path / "requests.jsonl"), "--out", str(tmp_path), "--workers", "2"]) == 2
    )
    assert "--ray" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["serve", "--replicas", "2"], ["batch", "{requests}", "--out", "{out}", "--ray"]]
)
def test_a_wrong_model_is_refused_before_ray_starts(argv, capsys, tmp_path):
    (tmp_path / "requests.jsonl").write_text('{"prompt": "x"}\n')
    argv = [word.format(requests=tmp_path / "requests.jsonl", out=tmp_path / "out") for word in argv]
    assert cli.main([*argv, "--model", str(tmp_path / "missing")]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
