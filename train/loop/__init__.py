"""The training loop: the run (`trainer`), the compiled step (`train_step`), what it optimises and how
(`optim`, `trainable`), where state lives on devices (`mesh`, `sharding`), checks before anything starts
(`preflight`) and the checkpoints a run writes and resumes from (`checkpointing`).

May import: `upcycler.train.config`, `model`, `data`, `techniques`, `reporting` and the layers below the
trainer. Nothing outside the loop imports it but `aot` (which compiles the loop's step for other
devices), `upcycler.verify` and the command line. `sharding` is the one module that knows the mesh: it
maps the model's logical axes to mesh axes and places the model from outside (see `train/model`).
"""
