"""tools/bench: the installer of the live benchmark's peer tools and the code freezer.

Nothing here installs anything for real (minutes and ~1 GB): a tool that cannot be
installed, a tool whose stamp says it is there, and a commit extracted from this clone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))

import freeze_code
import install_peers

from epp_bench.live.bench_dir import STAMP, BenchDir

REPO = Path(__file__).resolve().parents[2]


def test_a_tool_that_cannot_be_installed_is_reported_and_the_rest_carries_on(
    tmp_path: Path,
) -> None:
    bench = BenchDir(tmp_path)
    ghost = install_peers.ToolSpec("ghost", (2, 99), ("nothing",), ("true",))
    report = install_peers.install_tool(bench, ghost)
    assert not report.ok and not report.cached
    assert "no Python 2.99 interpreter" in (report.error or "")
    assert not bench.installed("ghost")
    table = install_peers.format_reports([report])
    assert "ghost" in table and "FAILED" in table and "no Python 2.99" in table


def test_a_tool_whose_stamp_matches_is_not_installed_again(tmp_path: Path) -> None:
    bench = BenchDir(tmp_path)
    spec = install_peers.TOOLS["vllm-router"]
    venv = bench.venv(spec.name)
    venv.mkdir(parents=True)
    (venv / STAMP).write_text(json.dumps(list(spec.requirements)))
    report = install_peers.install_tool(bench, spec)
    assert report.ok and report.cached and report.seconds == 0.0
    assert bench.installed(spec.name)
    assert "cached" in install_peers.format_reports([report])


def test_find_python_finds_an_interpreter_of_the_version_asked() -> None:
    wanted = sys.version_info[:2]
    found = install_peers.find_python(wanted)
    assert found is not None
    ran = subprocess.run(
        [found, "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert tuple(int(part) for part in ran.stdout.split()) == wanted
    assert install_peers.find_python((2, 99)) is None


def test_unknown_tool_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        install_peers.main(["--only", "nope"])
    assert "unknown tools: ['nope']" in capsys.readouterr().err


def test_freeze_extracts_a_commits_src_once(tmp_path: Path) -> None:
    commit, path = freeze_code.snapshot_commit(REPO, tmp_path, "HEAD")
    assert len(commit) == 40 and path == tmp_path / commit
    for package in ("epp", "vllm_sim", "epp_harness", "epp_bench", "epp_demo"):
        assert (path / package / "__init__.py").is_file(), package
    # The kernels built as pip builds them, so a before column runs them, not the twins.
    sources = sorted(path.glob("epp/*/_kernels.c"))
    assert sources
    if shutil.which(sysconfig.get_config_var("CC").split()[0]):
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for source in sources:
            assert source.with_name(f"_kernels{suffix}").is_file(), source
    marker = path / "epp" / "marker"
    marker.write_text("kept")
    # A second freeze of the same commit finds it there and extracts nothing.
    assert freeze_code.snapshot_commit(REPO, tmp_path, commit) == (commit, path)
    assert marker.read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == [commit]


def test_freeze_prints_commit_and_directory_or_fails_on_an_unknown_revision(
    tmp_path: Path,
) -> None:
    tool = REPO / "tools" / "bench" / "freeze_code.py"
    done = subprocess.run(
        [sys.executable, str(tool), "HEAD", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    answer = json.loads(done.stdout)
    assert Path(answer["path"]) == tmp_path / answer["commit"]
    bad = subprocess.run(
        [sys.executable, str(tool), "no-such-revision", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1 and "no-such-revision" in bad.stderr and not bad.stdout
