"""The CPU's instruction sets, asked in one place: what a CPU-specific route (each port's fast/) needs
before it is chosen, and the switch that makes this machine answer as a plainer one.

A kernel built for AVX-512 or AMX dies on a CPU without them (oneDNN's packed bfloat16 linear:
"bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"), so a route
asks `has_all`/`has_any` first and the model takes the plain route where the answer is no.

KVPORTS_CPU=avx2 makes every answer that of an x86-64 CPU with AVX2 but no AVX-512, AMX or
AVX-NE-CONVERT (most laptops, AMD before Zen 4): the suite runs the precision and quantization
tests under it too, so a machine with AVX-512 tests the route an AVX2 machine takes. Unset (or
`native`), the answers are this CPU's own flags (Linux's /proc/cpuinfo; none elsewhere, so no
CPU-specific route is taken there unless its framework's own check says yes).
"""

from __future__ import annotations

import functools
import os

from kvports.shared.errors import UserError

SWITCH = "KVPORTS_CPU"
CHOICES = ("native", "avx2")
# The flags a CPU answering as AVX2-only lacks: every AVX-512 subset, AMX, and the AVX-NE-CONVERT
# bfloat16 conversions (Intel's client cores since 2023 have those without AVX-512).
WIDER_THAN_AVX2 = ("avx512", "amx", "avx_ne_convert", "avx_vnni_int8", "avx_vnni_int16")
CPUINFO = "/proc/cpuinfo"
CPUINFO_LIMIT = 1 << 22  # bytes read at most: a few hundred cores' entries


def forced() -> str:
    """The switch's value: `native` (unset) or `avx2`; anything else is refused by name."""
    value = os.environ.get(SWITCH, "").strip().lower() or "native"
    if value not in CHOICES:
        raise UserError(f"{SWITCH}={os.environ[SWITCH]!r}: expected one of {', '.join(CHOICES)} (unset means native)")
    return value


@functools.lru_cache(maxsize=1)
def native_flags() -> frozenset[str]:
    """This CPU's own feature flags, as the kernel reports them (the first processor's line)."""
    try:
        with open(CPUINFO, "rb") as handle:
            text = handle.read(CPUINFO_LIMIT).decode("ascii", "replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            return frozenset(value.split())
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The flags every route asks about: this CPU's, or an AVX2-only CPU's under KVPORTS_CPU=avx2."""
    flags = native_flags()
    if forced() == "avx2":
        flags = frozenset(flag for flag in flags if not flag.startswith(WIDER_THAN_AVX2))
    return flags


def has_all(*features: str) -> bool:
    """Whether the CPU (as the switch lets it answer) has every one of `features`."""
    flags = cpu_flags()
    return all(feature in flags for feature in features)


def has_any(*feature_sets: tuple[str, ...]) -> bool:
    """Whether the CPU has every feature of at least one of `feature_sets`."""
    return any(has_all(*features) for features in feature_sets)


def describe() -> str:
    """One line for a report: the widest vector extensions the routes may use here."""
    shown = [name for name in ("avx2", "avx512bw", "avx512_bf16", "amx_tile", "avx_ne_convert") if has_all(name)]
    suffix = f" ({SWITCH}=avx2)" if forced() == "avx2" else ""
    return (", ".join(shown) or "no AVX2") + suffix
