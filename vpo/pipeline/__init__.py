"""The pipeline: configuration (``config``), the engine that runs stages (``engine``), the stage table
(``steps``) with one module per stage (``stages``), DVC generation and recording (``dvc``) and the model
registry (``registry``). Built on the library in ``vpo``; nothing here imports Prefect."""
