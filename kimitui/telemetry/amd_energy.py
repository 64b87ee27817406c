"""CPU socket energy from AMD's ``amd_energy`` hwmon driver, for EPYC hosts without RAPL powercap."""

from __future__ import annotations

from kimitui.telemetry.rapl import RaplBackend, _read_int, _Zone

DEFAULT_HWMON_ROOT = "/sys/class/hwmon"


class AmdEnergyBackend(RaplBackend):
    """Sum of the ``Esocket*`` counters of every ``amd_energy`` hwmon device.

    Same readings and unwrapping as ``RaplBackend``; ``root`` is the hwmon class directory.
    The driver already widens the 32-bit MSR to 64 bits, so there is no range to wrap at.
    """

    name = "amd_energy"
    _what = "amd_energy hwmon socket counter"
    default_root = DEFAULT_HWMON_ROOT
    _permission_hint = "the counters are root-only (CVE-2020-12912); run as root or add a udev rule"

    def _open_zones(self) -> list[_Zone]:
        zones: list[_Zone] = []
        for hwmon in sorted(self._root.glob("hwmon*")):
            try:
                if (hwmon / "name").read_text().strip() != "amd_energy":
                    continue
            except OSError:
                continue
            # Per-core counters (Ecore*) are inside the socket figure; only sockets count.
            for label_file in sorted(hwmon.glob("energy*_label")):
                label = label_file.read_text().strip()
                if not label.startswith("Esocket"):
                    continue
                counter = label_file.with_name(label_file.name.replace("_label", "_input"))
                zones.append(_Zone(counter, label, None, _read_int(counter)))
        return zones
