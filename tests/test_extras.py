"""Without Ray installed, the commands that need it say so (exit 2, naming `pip install 'klein[ray]'`)
and nothing else changes."""

import importlib.util

import pytest

from klein.cli import main as cli

REAL = importlib.util.find_spec


@pytest.mark.parametrize("argv", [["serve", "--replicas", "2"]])
def test_ray_commands_name_the_extra_when_ray_is_missing(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ray" else REAL(name, *a)
    )
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert "pip install 'klein[ray]'" in error and "Traceback" not in error


def test_ray_flags_go_with_replicas(capsys):
    assert cli.main(["serve", "--ray-address", "auto"]) == 2
    assert "--replicas" in capsys.readouterr().err
