"""scripts/sanitize_calls.py without a GPU: which calls a selection runs, and how the table reads
sanitizer logs (reports attributed to the call between its markers, a resumed process)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location(
        "sanitize_calls", ROOT / "scripts" / "sanitize_calls.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_selection_only_and_after(sc) -> None:
    names = sc.selected(None)
    assert names[:2] == ["sm90-dense", "sm80-dense"] and len(names) == len(set(names))
    assert sc.selected("seqused_k") == ["sm90-seqused_k", "sm80-seqused_k"]
    assert sc.selected("sm90-d256") == ["sm90-d256"]
    after = sc.selected(None, after="sm90-d256")
    assert after == names[names.index("sm90-d256") + 1 :]
    assert sc.selected("dense", after="sm90-dense") == ["sm80-dense"]
    with pytest.raises(SystemExit, match="--after nope"):
        sc.selected(None, after="nope")
    with pytest.raises(SystemExit, match="no call matches"):
        sc.selected("nothing-like-this")


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_report_attributes_reports_and_reads_a_resumed_log(sc, tmp_path, capsys) -> None:
    clean = _write(tmp_path, "memcheck.log", (
        "========= COMPUTE-SANITIZER\n@@ BEGIN sm90-dense\n@@ END sm90-dense ok\n"
        "@@ BEGIN sm80-dense\n@@ END sm80-dense ok\n========= ERROR SUMMARY: 0 errors\n"
    ))  # fmt: skip
    # synccheck: two reports in the first call, which broke the context; the second process
    # (--after) ran the rest.
    sync = _write(tmp_path, "synccheck.log", (
        "========= COMPUTE-SANITIZER\n@@ BEGIN sm90-dense\n"
        "========= Barrier error detected. Divergent thread(s) in block.\n"
        "=========     at kernel_x+0x6bc0\n"
        "========= Barrier error detected. Divergent thread(s) in block.\n"
        "@@ END sm90-dense exception:RuntimeError\n@@ STICKY sm90-dense\n"
        "========= ERROR SUMMARY: 2 errors\n"
        "========= COMPUTE-SANITIZER\n@@ BEGIN sm80-dense\n@@ END sm80-dense ok\n"
    ))  # fmt: skip
    assert sc.report([clean, sync]) == 1
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["sm90-dense"] == ["ok", "2", "reports,", "exception:RuntimeError"]
    assert rows["sm80-dense"] == ["ok", "ok"]
    assert sc.report([clean]) == 0


def test_report_counts_stray_reports_and_crashed_calls(sc, tmp_path, capsys) -> None:
    log = _write(tmp_path, "racecheck.log", (
        "========= Error: Race reported outside any call\n"
        "@@ BEGIN sm90-causal\n"  # no END: the process died
    ))  # fmt: skip
    assert sc.report([log]) == 1
    out = capsys.readouterr().out
    assert "(outside calls)  1 reports" in out
    assert "sm90-causal" in out and "crashed" in out
