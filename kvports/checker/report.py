"""What `kvports check` found: one row per check, the diagnoses, and how both are shown."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, NOISE, FAIL, SKIP = "pass", "noise", "FAIL", "skip"


@dataclass
class Check:
    name: str
    status: str  # pass (identical), noise (within float noise, or a near-tie), FAIL (a real defect), skip
    detail: str  # the figure: max |logit diff|, tokens agreeing, forward calls
    where: str = ""  # the first step, row and position of a defect; the peak of noise
    max_abs_diff: float | None = None
    first_step: int | None = None  # cached checks: 0 is the prefill, k the k-th token after it
    row: int | None = None
    position: int | None = None
    reference_margin: float | None = None  # the reference's top-2 logit margin where tokens part
    diagnosis: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    implementation: str
    interface: str  # "post" or "adapter"
    family: str
    reference: str  # which port the implementation was held to
    checks: list[Check] = field(default_factory=list)
    diagnoses: list[str] = field(default_factory=list)  # names, in the order found
    explanations: list[str] = field(default_factory=list)  # one line per diagnosis or unexplained failure

    @property
    def ok(self) -> bool:
        return all(check.status != FAIL for check in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "implementation": self.implementation,
            "interface": self.interface,
            "family": self.family,
            "reference": self.reference,
            "checks": [check.as_dict() for check in self.checks],
            "diagnoses": list(self.diagnoses),
            "explanations": list(self.explanations),
        }

    def summary(self) -> str:
        failed = [check.name for check in self.checks if check.status == FAIL]
        if not failed:
            return f"{self.implementation}: every check passes"
        return f"{self.implementation}: {len(failed)} check(s) FAIL; " + " | ".join(self.explanations)

    def table(self) -> Any:
        from rich.table import Table

        table = Table(
            title=f"kvports check {self.implementation} ({self.interface} interface), {self.family} model; "
            f"reference: {self.reference}",
            box=None,
        )
        for column in ("check", "status", "figure", "where"):
            table.add_column(column)
        styles = {PASS: "green", NOISE: "green", FAIL: "bold red", SKIP: "dim"}
        for check in self.checks:
            table.add_row(check.name, f"[{styles[check.status]}]{check.status}[/]", check.detail, check.where or "-")
        return table
