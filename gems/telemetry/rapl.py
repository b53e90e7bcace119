"""A CPU rank's energy from RAPL (the kernel's powercap counters, ``/sys/class/powercap/*/energy_uj``).

Each package zone (``intel-rapl:N``; AMD's packages are named so too) counts µJ up to ``max_energy_range_uj``
and wraps; :class:`Rapl` adds up the steps between reads, a wrap taken as one. Since 2020 most kernels let only
root read the counters: where none can be read, :attr:`Rapl.why` says why and the energy is not measured.
"""
from __future__ import annotations

import threading
from pathlib import Path

ROOT = Path("/sys/class/powercap")


class Rapl:
    """The summed energy of this node's CPU packages, in J from the first read (``read``), wraps handled."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.zones: list[tuple[Path, int]] = []  # (energy_uj file, its range in µJ)
        self.why: str | None = None
        self._lock = threading.Lock()
        root = Path(root if root is not None else ROOT)  # (read when made: a test points it at its own zones)
        found = sorted(p for p in root.glob("*:*") if p.name.count(":") == 1) if root.is_dir() else []
        errors = []
        for zone in found:
            try:
                top = int((zone / "max_energy_range_uj").read_text())
                int((zone / "energy_uj").read_text())
            except (OSError, ValueError) as e:
                errors.append(f"{zone / 'energy_uj'}: {getattr(e, 'strerror', None) or e}")
                continue
            self.zones.append((zone / "energy_uj", top))
        if not self.zones:
            self.why = ("RAPL not readable here (" + ("; ".join(errors[:2]) if errors else f"no package zone under {root}")
                        + ")")
        self._last = [self._raw(p) for p, _ in self.zones]
        self._joules = 0.0

    @staticmethod
    def _raw(path: Path) -> int | None:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return None

    def read(self) -> float | None:
        """J since this object was made (None where nothing can be read)."""
        if not self.zones:
            return None
        with self._lock:
            for k, (path, top) in enumerate(self.zones):
                now, before = self._raw(path), self._last[k]
                if now is None or before is None:
                    continue
                self._joules += ((now - before) % top if top > 0 else max(0, now - before)) / 1e6
                self._last[k] = now
            return self._joules


__all__ = ["ROOT", "Rapl"]
