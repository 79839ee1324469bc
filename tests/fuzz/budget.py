"""Example counts per property, scaled by the loaded Hypothesis profile (conftest.py)."""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 60  # the `ci` profile's max_examples


def examples(n: int) -> int:
    """`n` examples under the `ci` profile; proportionally more under `long`."""
    return max(1, n * settings.default.max_examples // CI_EXAMPLES)
