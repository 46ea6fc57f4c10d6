"""The declared torch range is the tested one: an older torch fails at import with a clear message."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import distoptim


@pytest.mark.parametrize("version", ["2.4.1", "2.10.2+cpu", "1.13.0", "nonsense"])
def test_older_torch_is_refused_with_the_minimum_named(version: str) -> None:
    with pytest.raises(ImportError, match=r"needs torch >= 2\.11, found torch " + version.replace("+", r"\+")):
        distoptim._check_torch_version(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.14.0a0+git1234", "3.0.0"])
def test_tested_and_newer_torch_is_accepted(version: str) -> None:
    distoptim._check_torch_version(version)


def test_import_under_an_old_torch_fails_clearly() -> None:
    code = "import torch; torch.__version__ = '2.4.0'; import distoptim"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "ImportError: distoptim needs torch >= 2.11, found torch 2.4.0" in result.stderr


def test_version_is_the_installed_distributions() -> None:
    try:
        installed = importlib.metadata.version("distoptim")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("distoptim is imported from a source tree, not installed")
    assert distoptim.__version__ == installed
