"""What a check reports: one problem, where it is, and the exact fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    code: str  # stable id, e.g. "batch-arithmetic"
    severity: Severity
    where: str  # file:dotted.key
    what: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


def render_table(findings: list[Finding]) -> str:
    if not findings:
        return "doctor: no problems found"
    rows = [("severity", "where", "problem", "fix")] + [(f.severity, f.where, f.what, f.fix) for f in findings]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(3)]
    lines = []
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    n_err = sum(f.severity == "error" for f in findings)
    lines.append(f"\n{n_err} error(s), {len(findings) - n_err} warning(s)")
    return "\n".join(lines)
