"""The weight formats one `kvports bench` run measures: `--dtype` and `--quant` each take one value
or a comma-separated list, and every port runs every (dtype, quant) pair it offers
(`kvports.validation.PRECISIONS`), one row each, its `weights` field naming the format: the dtype, then
the quantization after a plus (`float32`, `bfloat16`, `float32+int8`, `bfloat16+q4`).

A flag given one value is checked as `generate` checks it: a port without it is refused in the
same one line. A flag given a list skips, silently, the pairs a port does not offer, and every
pair that puts a quantization over float64. q4 keeps a GGUF file's own 4-bit blocks: when a port
will run a q4 row, a file without any is refused in `--quant q4`'s line, listed or not (a row the
file cannot give is not a format to skip quietly). torch's compiled row runs every format torch runs;
the baselines and the peers run once, at the first format (the lists are taken in DTYPES' and QUANTS'
order: float32 first)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvports.bench.options import parse_choices
from kvports.shared.config import DTYPES, QUANTS
from kvports.shared.errors import UserError
from kvports.validation import Setup, check_rules, offers


def format_name(dtype: str, quant: str) -> str:
    """A row's weight format: "float32", "bfloat16", "float32+int8", "bfloat16+q4"."""
    return dtype if quant == "none" else f"{dtype}+{quant}"


@dataclass(frozen=True)
class Formats:
    """The dtypes and quantizations asked for, each in its flag's canonical order."""

    dtypes: tuple[str, ...]
    quants: tuple[str, ...]

    @property
    def listed(self) -> bool:
        """Either flag gave several values: the pairs a port lacks are skipped, not refused."""
        return len(self.dtypes) > 1 or len(self.quants) > 1

    @property
    def first(self) -> tuple[str, str]:
        """The format the baselines and the peers run at, and the reference's."""
        return self.dtypes[0], self.quants[0]

    @property
    def read_dtype(self) -> str:
        """The dtype the tensors are read at, once for every row: float64 when a row needs its digits,
        else float32 (what bfloat16 reads at too, `config.host_dtype`); each row casts its own copy."""
        return "float64" if "float64" in self.dtypes else self.dtypes[0] if len(self.dtypes) == 1 else "float32"

    def of(self, framework: str) -> list[tuple[str, str]]:
        """The (dtype, quant) pairs `framework` runs, dtype by dtype."""
        return [(dtype, quant) for dtype in self.dtypes for quant in self.quants if offers(framework, dtype, quant)]

    def offered(self, frameworks: Sequence[str]) -> list[tuple[str, str]]:
        """Every pair at least one of `frameworks` runs, in the order of the rows."""
        runs = [pair for framework in frameworks for pair in self.of(framework)]
        return [(dtype, quant) for dtype in self.dtypes for quant in self.quants if (dtype, quant) in runs]

    def check(self, frameworks: Sequence[str]) -> None:
        """Before anything loads: a single value a port lacks is refused as `generate` refuses it (the same
        line, for every port); so is a list that leaves no port a format to run."""
        for framework in frameworks:
            if not self.listed:
                check_rules(Setup((framework,), dtype=self.dtypes[0], quant=self.quants[0]))
            elif len(self.dtypes) == 1:
                check_rules(Setup((framework,), dtype=self.dtypes[0]))
            elif len(self.quants) == 1:
                check_rules(Setup((framework,), quant=self.quants[0]))
        if frameworks and not self.offered(frameworks):
            raise UserError(
                f"--dtype {','.join(self.dtypes)} --quant {','.join(self.quants)} leave no format to run for "
                f"{', '.join(frameworks)}: quantized weights need float32 or bfloat16 activations"
            )


def parse_formats(dtype: str, quant: str) -> Formats:
    """--dtype's and --quant's values: one each, or comma-separated lists."""
    dtypes, quants = (
        parse_choices(dtype, DTYPES, "dtypes", "--dtype"),
        parse_choices(quant, QUANTS, "quants", "--quant"),
    )
    return Formats(tuple(dtypes), tuple(quants))
