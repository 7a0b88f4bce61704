"""README.md and docs/*.md quote only benchmark figures the committed results contain, and
benchmarks/results/INDEX.md says truthfully where each result comes from.

The convention (benchmarks/README.md, "Quoting a figure"): a paragraph or table that quotes a
measured figure names the result it comes from; every number with a unit there must be in that
result (its Markdown or JSON) at the precision quoted, and a commit it quotes must be the commit
one of those results was measured at. ``tools.bench_figures`` does the work.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import bench_figures as bf


def test_every_quoted_figure_is_in_the_result_it_names() -> None:
    missing, unknown = bf.check()
    assert not unknown, unknown
    assert not missing, "\n".join(
        f"{f.doc}:{f.line}: {f.text!r} is not in {', '.join(f.results)} (fix the text or "
        "re-run the benchmark: benchmarks/README.md, 'Quoting a figure')" for f in missing)


def test_the_check_finds_the_readme_figures() -> None:
    """It does look: the README's headline figures are parsed, each with the result named."""
    figs = list(bf.figures(bf.ROOT / "README.md"))
    texts = {f.text for f in figs}
    assert "799,958 block events/s" in texts and "1.2M" in texts
    assert all(f.results for f in figs)


def test_a_figure_the_results_do_not_hold_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a result of its own: the committed ones change whenever a benchmark is re-run
    results = tmp_path / "results"
    results.mkdir()
    (results / "relay_e2e.md").write_text(
        "sustained 400,006 block events/s; delta p50 0.24 ms, 1.15 ms and 1.26 ms\n")
    monkeypatch.setattr(bf, "RESULTS", results)
    bf.result_numbers.cache_clear()
    try:
        _check_the_made_up_document(tmp_path)
    finally:
        bf.result_numbers.cache_clear()


def _check_the_made_up_document(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "The short run ([r](benchmarks/results/relay_e2e.md)) sustained 400,800 block "
        "events/s, a delta p50 of 0.24 ms and 1.15–1.26 ms.\n\n"
        "| it sustained | 400,006 block events/s |\n\n"
        "A criterion paragraph naming results/relay_e2e.md <!-- bench-figures: none --> "
        "above 2 × 25 ms.\n\n"
        "No result named: 400,800 block events/s, 20 ms.\n\n"
        "- a list item naming results/relay_e2e.md: 400,006 block events/s\n"
        "- the next item names none: 3 ms\n")
    figs = list(bf.figures(doc))
    bad = sorted((f.text, f.results) for f in figs if not bf.found(f))
    # relay_e2e holds 400,006 (and 0.24, 1.15, 1.26), not 400,800; the table quotes what the
    # paragraph above it names; the marked paragraph is not read; in a paragraph that names no
    # result only an ingest rate counts, and fails
    assert bad == [("400,800 block events/s", ()), ("400,800 block events/s", ("relay_e2e",))]
    assert sorted(f.text for f in figs) == [  # a range gives one figure per end
        "0.24 ms", "1.15–1.26 ms", "1.15–1.26 ms", "400,006 block events/s",
        "400,006 block events/s", "400,800 block events/s", "400,800 block events/s"]


def test_precision_is_the_quoted_one(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("From benchmarks/results/relay_e2e-full.md: 0.8M block events/s, 800 K "
                   "events/s, 799,958 block events/s, 799,959 block events/s, 4.4M ev/s.\n")
    found = {f.text: bf.found(f) for f in bf.figures(doc)}
    assert found == {"0.8M block events/s": True, "800 K events/s": True,
                     "799,958 block events/s": True, "799,959 block events/s": False,
                     "4.4M ev/s": False}


def test_results_index_is_current() -> None:
    path = bf.RESULTS / "INDEX.md"
    assert path.read_text() == bf.index(), "run: python -m tools.bench_figures --index"


def test_quoted_commits_are_those_of_the_results_named() -> None:
    """A paragraph that names results and says which commit they come from says the right one:
    a result re-run at a later commit leaves such text stale even where its figures are found."""
    stale = [msg for doc in bf.documents() for msg in bf.stale_commits(doc)]
    assert not stale, "\n".join(stale)


def test_a_commit_the_named_results_do_not_carry_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "relay_e2e.json").write_text(
        '{"machine": {"git_commit": "ceed1a1"}, "sustained": 399999}\n')
    (results / "pool.json").write_text('{"machine": {"cpu_model": "x"}}\n')  # no commit
    monkeypatch.setattr(bf, "RESULTS", results)
    bf.result_commit.cache_clear()
    try:
        doc = tmp_path / "doc.md"
        doc.write_text(
            "The short run (benchmarks/results/relay_e2e.md, commit ceed1a1, or "
            "ceed1a1f00ba4 in full) sustained 399,999 block events/s.\n\n"
            "The short run (results/relay_e2e.md, commit 2c0f544) sustained it too.\n\n"
            "An older run at 2459b18 names no result, and `abc1234` is code.\n\n"
            "<!-- bench-figures: none -->\nCriteria from results/relay_e2e.md at 2c0f544.\n\n"
            "Not commits in results/relay_e2e.md: 8388608 buckets, a deadbeef, 0x1f2e3d4c.\n\n"
            "A result without a commit, results/pool.json, at 1dc5282.\n\n"
            "| a table row naming results/relay_e2e.md | 4eef3c9 |\n")
        stale = list(bf.stale_commits(doc))
    finally:
        bf.result_commit.cache_clear()
    assert [s.split(": ", 1)[1] for s in stale] == [
        "commit 2c0f544 is not the commit of relay_e2e (ceed1a1)",
        "commit 4eef3c9 is not the commit of relay_e2e (ceed1a1)"]
    assert [s.split(":")[1] for s in stale] == ["3", "14"]
