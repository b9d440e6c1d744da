"""`kvports --version`: the package's version."""

from __future__ import annotations

import pytest

from tests.helpers.commands import run_cli


def test_version_prints_the_package_version(capsys):
    import kvports

    with pytest.raises(SystemExit) as exit_info:
        run_cli(capsys, "--version")
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"kvports {kvports.__version__}\n"
