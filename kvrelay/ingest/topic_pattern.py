"""Topic patterns of connect mode: which member a message on the pool's bound SUB belongs to.

Syntax (``docs/contract.md`` §22.2): literal text with placeholders ``{engine}`` (required, once:
the member's engine name), ``{rank}`` (optional: the DP rank, decimal) and ``{model}`` (optional:
must equal the pool's model). ``{{`` and ``}}`` are literal braces. Two placeholders must be
separated by literal text. Matching is anchored at both ends; a placeholder followed by literal
text ends at that text's *first* occurrence (so it cannot contain it), the last placeholder runs
to the end. ``kv@{engine}@{model}`` (llm-d's convention) reads ``kv@10.0.0.7:8000@Qwen/Qwen3``
as engine ``10.0.0.7:8000``, model ``Qwen/Qwen3``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from kvrelay._text import is_decimal

PLACEHOLDERS = ("engine", "rank", "model")
MAX_ENGINE_NAME = 256
MAX_RANK = 1023
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


class PatternError(ValueError):
    """The pattern itself is invalid (a configuration error)."""


class TopicError(Exception):
    """A topic the pattern does not accept; ``kind`` is the counter label."""

    kind = "topic"


class TopicUnmatchedError(TopicError):
    kind = "topic_unmatched"


class TopicMalformedError(TopicError):
    kind = "topic_malformed"


@dataclass(frozen=True, slots=True)
class TopicMatch:
    engine: str
    rank: int | None
    model: str | None


class TopicPattern:
    """A compiled pattern; ``match(topic_bytes)`` → ``TopicMatch`` or a ``TopicError``."""

    __slots__ = ("_regex", "has_rank", "prefix", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        parts: list[tuple[str, str]] = []  # ("lit", text) | ("ph", name)
        pos = 0
        for m in _TOKEN.finditer(text):
            if m.start() > pos:
                parts.append(("lit", text[pos : m.start()]))
            tok = m.group(0)
            if tok in ("{{", "}}"):
                parts.append(("lit", tok[0]))
            elif m.group(1) is None:
                raise PatternError(f"unbalanced {tok!r} at {m.start()} (write {tok * 2})")
            elif m.group(1) not in PLACEHOLDERS:
                known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                raise PatternError(f"unknown placeholder {tok!r}; known: {known}")
            else:
                parts.append(("ph", m.group(1)))
            pos = m.end()
        if pos < len(text):
            parts.append(("lit", text[pos:]))
        merged: list[tuple[str, str]] = []
        for kind, val in parts:
            if kind == "lit" and merged and merged[-1][0] == "lit":
                merged[-1] = ("lit", merged[-1][1] + val)
            else:
                merged.append((kind, val))
        names = [v for k, v in merged if k == "ph"]
        if names.count("engine") != 1:
            raise PatternError("the pattern needs exactly one {engine}")
        for n in ("rank", "model"):
            if names.count(n) > 1:
                raise PatternError(f"{{{n}}} may appear at most once")
        for a, b in itertools.pairwise(merged):
            if a[0] == b[0] == "ph":
                raise PatternError(f"{{{a[1]}}}{{{b[1]}}}: placeholders need literal text between")
        regex = []
        for i, (kind, val) in enumerate(merged):
            if kind == "lit":
                regex.append(re.escape(val))
            elif i + 1 < len(merged):
                stop = re.escape(merged[i + 1][1][0])
                regex.append(f"(?P<{val}>[^{stop}]+)")
            else:
                regex.append(f"(?P<{val}>.+)")
        self._regex = re.compile("".join(regex), re.DOTALL)
        self.prefix = (merged[0][1] if merged[0][0] == "lit" else "").encode()
        self.has_rank = "rank" in names

    def match(self, topic: bytes) -> TopicMatch:
        if not topic.startswith(self.prefix):
            raise TopicUnmatchedError("topic does not start with the pattern's prefix")
        try:
            text = topic.decode("utf-8")
        except UnicodeDecodeError:
            raise TopicMalformedError("topic is not UTF-8") from None
        m = self._regex.fullmatch(text)
        if m is None:
            raise TopicUnmatchedError("topic does not match the pattern")
        engine = m.group("engine")
        if (
            len(engine.encode()) > MAX_ENGINE_NAME
            or engine != engine.strip()
            or not engine.isprintable()
        ):
            raise TopicMalformedError("engine name is too long, padded or not printable")
        rank = None
        if self.has_rank:
            r = m.group("rank")
            if not is_decimal(r) or len(r) > 4 or int(r) > MAX_RANK:
                raise TopicMalformedError(f"rank is not a number in 0..{MAX_RANK}")
            rank = int(r)
        model = m.group("model") if "model" in self._regex.groupindex else None
        return TopicMatch(engine, rank, model)
