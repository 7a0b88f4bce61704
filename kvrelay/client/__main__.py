"""``python -m kvrelay.client``: the standalone inspection CLI."""

from kvrelay.client.cli import main

raise SystemExit(main())
