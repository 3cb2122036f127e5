"""``python -m vpo.pipeline.registry``: the registry CLI without the ``vpo`` entry point."""

from vpo.pipeline.registry.cli import main

raise SystemExit(main(prog="python -m vpo.pipeline.registry"))
