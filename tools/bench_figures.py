"""Benchmark figures quoted in README.md and docs/*.md against the committed results.

The convention (benchmarks/README.md, "Quoting a figure"): a paragraph or table row that quotes a
measured figure names the result it comes from, ``benchmarks/results/NAME.md`` (or ``.json``;
``results/NAME.md`` and ``NAME[-full].md`` for both variants are understood), as a link or in code;
a table quotes what the paragraph just above it names. Every number with a unit in such a paragraph
(``400,800 block events/s``, ``0.3–1.1 ms``, ``1.6M``, ``0.26×``, ``14.3 B``, ``85 MiB``, ``2.5%``,
``0.18 cores``; both ends of a range) must then be found in one of the named results: a number in
its Markdown, or a numeric value in its JSON, equal at the precision quoted (``1.6M`` matches
1,600,523; ``0.26`` matches 0.2561). Figures in paragraphs that name no result are not taken for
measurements (targets, defaults, limits), except ingest rates (``… block events/s``, ``events/s``,
``ev/s``): kvrelay's headline kind of figure, which must always name the result it comes from.

A paragraph that names a result only for context (it states criteria, not measurements) says
so with ``<!-- bench-figures: none -->``.

A commit such a paragraph quotes (``commit 2c0f544``) must be the commit of one of the results it
names (their JSON's ``machine.git_commit``): when a result is re-run, the text that still names
the old commit is stale even where its figures happen to be found. A figure from an older run
goes, with its commit, in a paragraph that names no result.

``python -m tools.bench_figures`` prints every quoted figure not found; ``--index`` rewrites
``benchmarks/results/INDEX.md``: which commit, when and on how quiet a machine each committed
result was measured (a test keeps it current).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

#: units that make a number a figure (longest first: the regex alternation is ordered)
UNITS = ("block events/s", "events/s", "ev/s", "req/s", "frames/s", "deltas/s", "B/membership",
         "bytes", "MiB", "GiB", "KiB", "MB/s", "ms", "µs", "us", "cores", "core", "×", "%", "s",
         "B")
SKIP_MARK = "<!-- bench-figures: none -->"
#: figures that are always taken for measurements: they must name their result
RATE_UNITS = ("block events/s", "events/s", "ev/s")
_NUM = r"(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)"
_SUFFIX = r"(?:\s?([kKM])(?![a-zA-Z]))?"
_UNIT = "|".join(re.escape(u) for u in UNITS)
# a number, optionally a range (– or -) to a second number, then a unit or a K/M suffix
FIGURE_RE = re.compile(
    rf"(?<![\w.,/-]){_NUM}{_SUFFIX}(?:\s?[–-]\s?{_NUM}{_SUFFIX})?"
    rf"(?:\s?({_UNIT})(?![\w/]))?"
)
RESULT_REF_RE = re.compile(r"results/([A-Za-z0-9_]+(?:\[-full\]|-full|-short)?)\.(?:md|json)")
NUMBER_RE = re.compile(rf"(?<![\w.])-?{_NUM}{_SUFFIX}")
MULT = {None: 1.0, "": 1.0, "k": 1e3, "K": 1e3, "M": 1e6}
#: an abbreviated git commit: 7-40 hex digits with at least one letter and one digit
COMMIT_RE = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


@dataclass(frozen=True)
class Figure:
    doc: str
    line: int
    text: str  # the figure as written
    value: float  # one end, multiplier applied
    tolerance: float
    results: tuple[str, ...]  # result stems the paragraph names


def _num(text: str) -> tuple[float, int]:
    """Value and decimals of a number as written (``400,800`` → 400800, 0)."""
    plain = text.replace(",", "")
    return float(plain), len(plain.split(".")[1]) if "." in plain else 0


def _stems(ref: str) -> list[str]:
    if "[-full]" in ref:
        base = ref.replace("[-full]", "")
        return [base, f"{base}-full"]
    return [ref]


ITEM_RE = re.compile(r"(?:[*-]|\d+\.) ")


def paragraphs(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each paragraph; every table row and every top-level list
    item counts as one."""
    start = 1
    buf: list[str] = []
    for i, line in enumerate([*text.splitlines(), ""], 1):
        if ITEM_RE.match(line) and buf:
            yield start, "\n".join(buf)
            buf, start = [], i
        if line.lstrip().startswith("|"):
            if buf:
                yield start, "\n".join(buf)
                buf = []
            yield i, line
            start = i + 1
        elif line.strip():
            if not buf:
                start = i
            buf.append(line)
        else:
            if buf:
                yield start, "\n".join(buf)
            buf = []
            start = i + 1


def _strip(text: str) -> str:
    """Link targets and code spans out: their digits are names, not figures."""
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return re.sub(r"`[^`]*`", " ", text)


def figures(doc: Path) -> Iterator[Figure]:
    rel = str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else str(doc)
    caption: list[str] = []  # a table's rows quote what the paragraph just above it names
    for line, para in paragraphs(doc.read_text()):
        stems = [s for m in RESULT_REF_RE.finditer(para) for s in _stems(m.group(1))]
        if para.lstrip().startswith("|"):
            stems = stems or caption
        else:
            caption = [] if SKIP_MARK in para else stems
        if SKIP_MARK in para or para.lstrip().startswith("#"):
            continue
        for m in FIGURE_RE.finditer(_strip(para)):
            a, sa, b, sb, unit = m.groups()
            if unit is None and not (sa or sb):
                continue  # a bare number (a count, a year, a step): not a figure
            if not stems and unit not in RATE_UNITS:
                continue
            for num, suf in ((a, sa or sb), (b, sb)):
                if num is None:
                    continue
                v, nd = _num(num)
                mult = MULT[suf]
                yield Figure(rel, line, m.group(0).strip(), v * mult, 0.5 * 10**-nd * mult,
                             tuple(dict.fromkeys(stems)))


def _json_numbers(obj: Any) -> Iterator[float]:
    """Numeric leaves, less raw byte counts (``*_bytes``: quoted in MiB from the Markdown, and
    their many large values would match almost any figure of a million)."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        yield float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if not str(k).endswith("bytes"):
                yield from _json_numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _json_numbers(v)


@cache
def result_numbers(stem: str) -> tuple[float, ...] | None:
    """Every number of a result (its Markdown and its JSON), or None when it does not exist."""
    md, js = RESULTS / f"{stem}.md", RESULTS / f"{stem}.json"
    if not md.exists() and not js.exists():
        return None
    out: list[float] = []
    if md.exists():
        for m in NUMBER_RE.finditer(md.read_text()):
            v, _ = _num(m.group(1))
            out.append(v * MULT[m.group(2)])
    if js.exists():
        for x in _json_numbers(json.loads(js.read_text())):
            out += [x, x * 100.0]  # shares quoted as percentages
    return tuple(out)


def found(fig: Figure) -> bool:
    """In one of the results its paragraph names (never, when it names none)."""
    for stem in fig.results:
        nums = result_numbers(stem)
        if nums and any(abs(x - fig.value) <= fig.tolerance * 1.0001 for x in nums):
            return True
    return False


@cache
def result_commit(stem: str) -> str | None:
    """The commit a result was measured at (its JSON's ``machine.git_commit``), if it says."""
    js = RESULTS / f"{stem}.json"
    if not js.exists():
        return None
    m = json.loads(js.read_text()).get("machine")
    commit = m.get("git_commit") if isinstance(m, dict) else None
    return commit if isinstance(commit, str) and commit else None


def stale_commits(doc: Path) -> Iterator[str]:
    """``doc:line: …`` for each commit a result-naming paragraph quotes that none of its named
    results was measured at."""
    rel = str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else str(doc)
    for line, para in paragraphs(doc.read_text()):
        if SKIP_MARK in para or para.lstrip().startswith("#"):
            continue
        stems = list(dict.fromkeys(
            s for m in RESULT_REF_RE.finditer(para) for s in _stems(m.group(1))))
        commits = {c for s in stems if (c := result_commit(s))}
        if not commits:
            continue
        for m in COMMIT_RE.finditer(_strip(para)):
            quoted = m.group(0)
            if not any(c.startswith(quoted) or quoted.startswith(c) for c in commits):
                yield (f"{rel}:{line}: commit {quoted} is not the commit of "
                       f"{', '.join(stems)} ({', '.join(sorted(commits))})")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def check() -> tuple[list[Figure], list[str]]:
    """(figures not found in the results they name, result names that do not exist)."""
    missing, unknown = [], []
    for doc in documents():
        for fig in figures(doc):
            for stem in fig.results:
                if result_numbers(stem) is None and not any(
                        result_numbers(s) for s in fig.results):
                    unknown.append(f"{fig.doc}:{fig.line}: results/{stem} does not exist")
            if not found(fig):
                missing.append(fig)
    return missing, sorted(set(unknown))


def _provenance(doc: dict[str, Any]) -> tuple[str, str, str, str]:
    """(commit, UTC, 1-min load at start, quiet) of one result, as its machine block says."""
    from benchmarks._load import assess

    m: dict[str, Any] = doc["machine"] if isinstance(doc.get("machine"), dict) else {}
    commit = m.get("git_commit") or (
        f"not recorded (file committed in {m['committed_in']})" if m.get("committed_in") else "–")
    if m.get("git_dirty"):
        commit += " + local changes"
    utc = m.get("utc") or (m.get("committed_utc", "–")[:10] + " (committed)")
    load = m.get("load_1min")
    if load is None and m.get("loadavg_at_start"):
        load = m["loadavg_at_start"][0]
    if load is None:
        load = doc.get("loadavg_1m")
    quiet = m.get("quiet")
    if quiet is None and load is not None and m.get("cores"):
        quiet = assess(float(load), 1, int(m["cores"]), None)["quiet"]  # from the load average
    q = "–" if quiet is None else "yes" if quiet else "**no**"
    return commit, utc, "–" if load is None else f"{float(load):.2f}", q


def index() -> str:
    """``benchmarks/results/INDEX.md``: the provenance of every committed result."""
    lines = ["# Where each committed result comes from", "",
             "Generated by `python -m tools.bench_figures --index` from each result's `machine` "
             "block (a test keeps it current). *Quiet*: the 1-min load average at the start, less "
             "the benchmark's own process, was at most half the cores (benchmarks/README.md, "
             "\"On a loaded machine\"; for results that predate the `quiet` flag it is derived "
             "from their load average, counting one process of their own). Results from "
             "different commits or from a loaded machine "
             "do not compare; `make bench FULL=1` regenerates all of them from one commit.", "",
             "| result | commit | measured (UTC) | 1-min load at start | quiet |",
             "|---|---|---|---:|:---:|"]
    for path in sorted(RESULTS.glob("*.json")):
        commit, utc, load, quiet = _provenance(json.loads(path.read_text()))
        lines.append(f"| [{path.stem}]({path.name}) | {commit} | {utc} | {load} | {quiet} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.argv[1:] == ["--index"]:
        (RESULTS / "INDEX.md").write_text(index())
        return 0
    missing, unknown = check()
    commits = [msg for d in documents() for msg in stale_commits(d)]
    for fig in missing:
        print(f"{fig.doc}:{fig.line}: {fig.text!r} not in "
              f"{', '.join(fig.results) or 'any result: the paragraph names none'}")
    for u in unknown:
        print(u)
    for msg in commits:
        print(msg)
    n = sum(1 for d in documents() for _ in figures(d))
    print(f"{n} quoted figure ends, {len(missing)} not found, {len(unknown)} unknown results, "
          f"{len(commits)} stale commits")
    return 1 if missing or unknown or commits else 0


if __name__ == "__main__":
    sys.exit(main())
