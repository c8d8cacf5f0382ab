"""One `krex doctor` finding and its verdicts, shared by doctor.py and doctor_kernel.py (both report
them; keeping them here lets doctor.py call the kernel checks without a circle of imports)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Check:
    name: str
    verdict: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)
