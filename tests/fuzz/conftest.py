"""Hypothesis profiles of the fuzz suite (tests/fuzz).

- `ci` (the default): few examples per property, no deadline: the whole directory runs in
  well under a minute on a CI runner, so it is part of every `make test`.
- `long` (`make fuzz`, or HYPOTHESIS_PROFILE=long): many examples per property, for a
  developer's machine or a nightly job.

Each property sets its own example count with `budget.examples(n)`: n under `ci`, scaled
up under `long`, so the expensive ones (large bodies, deep nesting) stay cheap in CI.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=_SUPPRESSED, print_blob=True
)
settings.register_profile(
    "long", max_examples=2_000, deadline=None, suppress_health_check=_SUPPRESSED, print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
