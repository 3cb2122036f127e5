"""The engine wing: what runs a stage, whatever the stage is.

Locks on the run folder (:mod:`.locking`), records of what produced an output (:mod:`.state`),
model folders and checkpoints (:mod:`.checkpoints`), how stages share the machine
(:mod:`.execution`) and run side by side (:mod:`.fanout`, :mod:`.processes`), what a stage function
gets (:mod:`.context`) and reads (:mod:`.inputs`), what is printed (:mod:`.console`), errors and
exit codes (:mod:`.errors`), and S3 settings and secret redaction (:mod:`.storage`).
"""
