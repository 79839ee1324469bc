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


# Goes with src/epp/tokenize.py once routing/ and epp_bench/virtual/epp.py stop importing it.
def test_the_old_module_re_exports_the_same_objects() -> None:
    import epp.tokenize as old
    from epp.tokenization import estimate, protocol

    for name in old.__all__:
        new = getattr(protocol, name, None) or getattr(estimate, name)
        assert getattr(old, name) is new, name
