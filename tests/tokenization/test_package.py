"""epp.tokenization is one package: the contract (`protocol`) and the byte estimate
(`estimate`) import without the model tokenizers' dependencies, and the package's names
load on first use."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_request_parser_does_not_import_the_model_tokenizers() -> None:
    code = (
        "import sys, epp.request, epp.prefix.blocks, epp.tokenization.estimate\n"
        "heavy = {'tokenizers', 'jinja2', 'pydantic', 'epp.tokenization.hf'} & set(sys.modules)\n"
        "assert not heavy, sorted(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_package_names_load_on_first_use() -> None:
    import epp.tokenization as package
    from epp.tokenization.hf import HfTokenizer, load_tokenizer_dir
    from epp.tokenization.registry import TokenizerRegistry

    assert package.HfTokenizer is HfTokenizer
    assert package.load_tokenizer_dir is load_tokenizer_dir
    assert package.TokenizerRegistry is TokenizerRegistry
    assert all(getattr(package, name) is not None for name in package.__all__)
    with pytest.raises(ImportError, match="Nothing"):
        from epp.tokenization import Nothing  # type: ignore[attr-defined]  # noqa: F401
