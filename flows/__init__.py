"""Prefect orchestration of the pipeline (``flows.retrain``) and the dvc.yaml generator (``flows.dvcgen``).

Importing the package imports neither Prefect nor DVC; ``flows.retrain`` does.
"""
