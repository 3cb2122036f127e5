"""vpo: Vector Policy Optimization post-training and test-time search.

The library is plain Python (no Prefect, no DVC imports): advantage estimators,
the multi-answer format, vector rewards, metrics, the TRL trainer, tasks and search.
"""

__version__ = "0.1.0"
