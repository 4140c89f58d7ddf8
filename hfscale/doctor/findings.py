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


def render_table(findings: list[Finding], limit: int | None = None) -> str:
    """The findings as a table: the first `limit` (None: all), then one line counting the rest."""
    if not findings:
        return "doctor: no problems found"
    shown = findings if limit is None else findings[:limit]
    rows = [("severity", "where", "problem", "fix")] + [(f.severity, f.where, f.what, f.fix) for f in shown]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(3)]
    lines = []
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    if len(shown) < len(findings):
        lines.append(more_line(len(findings) - len(shown)))
    n_err = sum(f.severity == "error" for f in findings)
    lines.append(f"\n{n_err} error(s), {len(findings) - n_err} warning(s)")
    return "\n".join(lines)


def more_line(n: int) -> str:
    return f"… and {n} more finding{'s' if n != 1 else ''} (--max-findings 0 lists all)"
