"""argparse with subcommands that own their usage errors.

Why: argparse hands a subcommand's unknown options back to the top-level parser, which then
prints the top-level usage (``kvrelay [-h] [--version] COMMAND ...``): a typo in
``kvrelay serve --confg`` did not show ``serve``'s options. A subcommand parser of this class
reports them itself, with its own usage (exit status 2, as argparse's).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["StrictSubcommand"]


class StrictSubcommand(argparse.ArgumentParser):
    """Pass as ``add_subparsers(parser_class=StrictSubcommand)``."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra
