"""What `kvports check` found: one row per check, the diagnoses, and how both are shown."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, NOISE, FAIL, SKIP = "pass", "noise", "FAIL", "skip"
NOISE_F32 = "noise-f32"  # a float64 row off by float32's noise, every float32 row passing: float32 inside
TIMEOUT = "TIMEOUT"  # a call that did not return within --timeout seconds (the checker's child was stopped)
FAILING = (FAIL, TIMEOUT)  # the statuses that make the exit status 1


def failing(check: Check) -> bool:
    return check.status in FAILING


@dataclass
class Check:
    name: str
    status: str  # pass (identical), noise (float noise, or a near-tie), noise-f32, FAIL (a defect), TIMEOUT, skip
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
    notes: list[str] = field(default_factory=list)  # what is not a failure but must be said (a 16-bit dtype)

    @property
    def ok(self) -> bool:
        return not any(failing(check) for check in self.checks)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The report as_dict() gave (the child process's, sent over a pipe)."""
        fields = {name: data[name] for name in ("implementation", "interface", "family", "reference")}
        report = cls(**fields, diagnoses=list(data["diagnoses"]), explanations=list(data["explanations"]))
        report.checks = [Check(**check) for check in data["checks"]]
        report.notes = list(data.get("notes", []))
        return report

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
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        failed = [check.name for check in self.checks if failing(check)]
        if not failed:
            return f"{self.implementation}: every check passes"
        return f"{self.implementation}: {len(failed)} check(s) FAIL; " + " | ".join(self.explanations)

    def table(self) -> Any:
        """The rows as a rich table; their text (an exception's message among it) is shown as it is,
        never read as rich's markup."""
        from rich.markup import escape
        from rich.table import Table

        table = Table(
            title=escape(
                f"kvports check {self.implementation} ({self.interface} interface), {self.family} model; "
                f"reference: {self.reference}"
            ),
            box=None,
        )
        for column in ("check", "status", "figure", "where"):
            table.add_column(column)
        styles = {PASS: "green", NOISE: "green", NOISE_F32: "green", FAIL: "bold red", TIMEOUT: "bold red", SKIP: "dim"}
        for check in self.checks:
            status = f"[{styles[check.status]}]{check.status}[/]"
            table.add_row(escape(check.name), status, escape(check.detail), escape(check.where or "-"))
        return table
