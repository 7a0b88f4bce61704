"""Per-message decode statistics (plain ints; the subscriber folds them into its counters)."""

from __future__ import annotations

from dataclasses import dataclass, field

# drop reasons (also the counter labels)
DROP_MEDIUM_PREFIX = "medium_"  # + tier: host_pinned, disk, external, unknown
DROP_LOCALITY = "locality"
DROP_NON_FULL_ATTENTION = "non_full_attention"
DROP_GROUP = "group"
DROP_PLACEHOLDER = "placeholder"
DROP_BLOCK_SIZE = "block_size_mismatch"
DROP_TOKENS_SHORT = "tokens_short"
DROP_TOKENS_EXCESS = "tokens_excess"
DROP_EMPTY = "empty"
DROP_SELF_REFERENCE = "self_reference"
DROP_MALFORMED = "malformed_event"
DROP_UNKNOWN_TAG = "unknown_tag"


@dataclass(slots=True)
class DecodeStats:
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_tags: int = 0
    unknown_fields: int = 0
    malformed_events: int = 0
    eagle_bigram: int = 0
    truncated: int = 0
    extra_keys_ignored: int = 0
    slow_path: int = 0  # 1 when the msgspec path decoded this message (not the numba walker)
    drops: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
