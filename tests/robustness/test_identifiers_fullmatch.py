"""A pattern that validates an identifier matches the whole of it: ``^...$`` with
``re.match`` accepts a trailing newline (``$`` matches before one), so a claim UID
``"abc\\n"`` passed ``cdi.check_uid`` and reached a file name. Every validator is
fed a good value with a newline after it. (Parsers that trim on purpose -- a driver
version, a quantity -- are not identifiers and are not listed.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpulet_common.dra import cdi, limits, mig

ACCEPTS: list[tuple[str, Callable[[str], object], str]] = [
    ("cdi.check_uid", cdi.check_uid, "0b8e3c1e-0000-4000-8000-000000000001"),
    ("limits.is_dns_label", limits.is_dns_label, "gpu-0"),
    ("limits.is_dns_subdomain", limits.is_dns_subdomain, "gpu.gpulet.io"),
    ("limits.is_driver_name", limits.is_driver_name, "gpu.gpulet.io"),
    ("limits.is_semver", limits.is_semver, "1.2.3"),
    ("limits.is_label_value", limits.is_label_value, "a.b-c"),
    ("limits.is_label_name", limits.is_label_name, "a.b-c"),
    ("limits.is_qualified_name", limits.is_qualified_name, "gpulet.io/a"),
    ("mig.parse_name", mig.parse_name, "gpu-0-mig-1g-5gb-9-0"),
]


def _accepted(check: Callable[[str], object], value: str) -> bool:
    try:
        result = check(value)
    except ValueError:
        return False
    return result not in (False, None)


@pytest.mark.parametrize(("name", "check", "good"), ACCEPTS, ids=[a[0] for a in ACCEPTS])
def test_a_trailing_newline_is_not_part_of_an_identifier(
    name: str, check: Callable[[str], object], good: str
) -> None:
    assert _accepted(check, good), name
    for bad in (good + "\n", good + "\r\n", "\n" + good):
        assert not _accepted(check, bad), (name, bad)
