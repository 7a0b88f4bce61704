"""kvrelay benchmarks (scripts; run ``python -m benchmarks.run``). Not part of the package."""
