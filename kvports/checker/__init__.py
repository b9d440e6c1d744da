"""`kvports check`: an implementation of the seed's model (the post's own interface, or a
framework-neutral adapter) held to the reference, and each defect matched to a known mistake.
suite.py runs the checks, plugin.py loads the implementation, variants.py holds the broken
reference forwards, report.py the findings, isolate.py runs it all in a child process."""

from kvports.checker.isolate import DEFAULT_TIMEOUT, run_isolated
from kvports.checker.report import Check, Report
from kvports.checker.suite import FAMILIES, run_check
from kvports.checker.variants import DIAGNOSES

__all__ = ["DEFAULT_TIMEOUT", "DIAGNOSES", "FAMILIES", "Check", "Report", "run_check", "run_isolated"]
