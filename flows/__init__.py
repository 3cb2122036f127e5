"""Prefect orchestration of the pipeline: the flow run (resolved from the stage table), the tasks, the report, a
local server for the UI, and the ``retrain`` flow with its cron deployment.

Importing the package imports neither Prefect nor DVC; its modules do.
"""
