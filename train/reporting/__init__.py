"""What a run reports: the metrics it logs, one JSON line per step in `RUN_DIR/metrics.jsonl`
(`metrics`: the one owner of that file's format, and its checked reading; `metrics_log` writes it,
`metrics_resume` cuts it back on resume, `metrics_objects` holds it in a bucket run_dir), the mirrors of
it (`writers`), the model FLOPs and peak MFU is measured with (`flops`, `peak`), the run's clock
(`goodput`), the progress line (`progress`), and `upcycle report`'s PNGs of them (`plots`, with the
expert figures in `expert_plots` and the writing of each file in `figure_file`).

May import: `upcycler.train.techniques.expert_health` (the health figures a record carries) and the
layers below the trainer; never the loop or the model, so a report runs without JAX.
"""
