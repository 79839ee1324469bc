from __future__ import annotations

import pytest
from tokenizer_fixtures import FIXTURES, tokenizer_dir

from epp.tokenization import HfTokenizer, load_tokenizer_dir


@pytest.fixture(params=["llama3", "chatml"])
def any_tokenizer(request: pytest.FixtureRequest) -> HfTokenizer:
    return load_tokenizer_dir(tokenizer_dir(request.param))


@pytest.fixture
def llama3() -> HfTokenizer:
    return load_tokenizer_dir(FIXTURES / "llama3")


@pytest.fixture
def chatml() -> HfTokenizer:
    return load_tokenizer_dir(FIXTURES / "chatml")
