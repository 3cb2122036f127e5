"""The DVC wing: ``dvc.yaml`` and ``params.yaml`` generated from ``pipelines.yaml`` and the stage table
(:mod:`.generate`), and stages that ran outside ``dvc repro`` recorded in ``dvc.lock`` (:mod:`.record`)."""
