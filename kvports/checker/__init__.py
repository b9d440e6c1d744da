"""`kvports check`: an implementation of the seed's model (the post's own interface, or a
framework-neutral adapter) held to the reference, and each defect matched to a known mistake.
run.py runs the checks, plugin.py loads the implementation, variants.py holds the broken
reference forwards, report.py the findings."""

from kvports.checker.report import Check, Report
from kvports.checker.suite import FAMILIES, run_check
from kvports.checker.variants import DIAGNOSES

__all__ = ["DIAGNOSES", "FAMILIES", "Check", "Report", "run_check"]
