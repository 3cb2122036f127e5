"""One module per pipeline stage; each exposes ``run(ctx) -> summary`` (see :mod:`vpo.pipeline.steps`)."""
