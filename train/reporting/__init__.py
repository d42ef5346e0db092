"""What a run reports: the metrics it logs, one JSON line per step in `RUN_DIR/metrics.jsonl`
(`metrics`: the one owner of that file's format), and `upcycle report`'s plots of them (`report`).

May import: `upcycler.train.techniques.expert_health` (the health figures a record carries) and the
layers below the trainer; never the loop or the model, so a report runs without JAX.
"""
