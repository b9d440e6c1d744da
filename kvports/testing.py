"""For your own tests: `kvports check` as a pytest helper.

from kvports.testing import check_implementation

def test_my_kv_cache():
    check_implementation("decoder_gen.py")   # or an adapter module, with family="llama"
"""

from __future__ import annotations

from types import ModuleType

from kvports.checker import DEFAULT_TIMEOUT, Report, run_check, run_isolated


def check_implementation(
    path_or_module: str | ModuleType, family: str = "seed", quick: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> Report:
    """The report of `kvports check` on an implementation (a file, a module name or a module);
    raises AssertionError naming each diagnosis where a check fails, and kvports.UserError
    where the implementation cannot be used at all (as the command's exit status 2). A file or
    a module name is checked in a child process, as the command does (an exit or a hang there
    is a failed check, each call limited to `timeout` seconds); a module object, in this one."""
    if isinstance(path_or_module, ModuleType):
        report = run_check(path_or_module, family, quick)
    else:
        report = run_isolated(path_or_module, family, quick, timeout)
    if not report.ok:
        raise AssertionError(report.summary())
    return report
