"""Make the generated ``PoolServingLoad`` and ``ModelServingLoad`` parseable.

Both messages have a field named ``load`` (Dynamo 1.7's wire name). betterproto2 parses with
``cls().load(stream)``, and the dataclass field, an instance attribute, hides ``Message.load``:
parsing raised ``TypeError: 'NoneType' object is not callable``. Encoding is unaffected. The
generated code stays as generated (a test keeps it fresh); this module gives just those classes a
``parse`` that calls ``Message.load`` through the class. ``tests/contract/test_proto_fixes.py``
names the behaviour it works around, so a betterproto2 that fixes it shows up there.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

import betterproto2

from kvrelay._proto.dynamo.kvrelay import v1 as pb

#: The generated messages with a field that hides a ``betterproto2.Message`` method.
SHADOWED: tuple[type[betterproto2.Message], ...] = (pb.PoolServingLoad, pb.ModelServingLoad)


def _parse(cls: type[Any], data: bytes) -> Any:
    message = cls()
    with BytesIO(data) as stream:
        betterproto2.Message.load(message, stream)
    return message


def install() -> None:
    """Idempotent; run when ``kvrelay.contract`` is imported, before anything parses."""
    for cls in SHADOWED:
        if cls.__dict__.get("parse") is None:
            cls.parse = classmethod(_parse)  # type: ignore[assignment,method-assign]
            cls.FromString = classmethod(_parse)  # type: ignore[assignment,method-assign]


install()
