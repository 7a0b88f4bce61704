"""Files shipped inside the package (``kvrelay/ops/assets/``) for installs without a checkout.

``deploy/`` in the repository holds identical copies (a test keeps them so), so the recipe in
deploy/README.md works from a clone and from ``pip install`` alike.
"""

from __future__ import annotations

from importlib.resources import files

ASSETS = ("kvrelay.example.toml", "kvrelay.service", "kvrelay@.service")


def asset_text(name: str) -> str:
    """The text of one shipped asset; ``KeyError`` for a name not in :data:`ASSETS`."""
    if name not in ASSETS:
        raise KeyError(name)
    return files("kvrelay.ops").joinpath("assets", name).read_text(encoding="utf-8")
