"""`kernels`: a test taking it runs once with the compiled prefix kernels and once with
their pure-Python twins (epp.prefix.kernels), on the same inputs."""

from __future__ import annotations

import pytest

from epp.prefix import approximate, hashing, holders, kernels

# The modules that chose an implementation at import.
_USERS = (approximate, hashing, holders)


@pytest.fixture(params=["compiled", "python"])
def kernels_used(request, monkeypatch):
    if request.param == "compiled":
        if kernels.COMPILED is None:
            pytest.skip("the compiled kernels are not built (no C compiler at install)")
        module = kernels.COMPILED
    else:
        module = None
    for user in _USERS:
        monkeypatch.setattr(user, "COMPILED", module)
    return request.param
