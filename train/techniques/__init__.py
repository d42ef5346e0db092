"""What rides on the training loop, each turned on by a config key: the routers' selection-bias
balancing (`balancing`) and weight averaging (`ema`), inside the step; a run started from a merge of
checkpoints (`init_merge`); and the loop's techniques, one object each implementing the `Technique`
protocol (`protocol`): the loss-spike guard (`spike_guard`), the finiteness check (`finiteness`), expert
load health (`expert_window`, over the windows of steps it sums, with `expert_health`'s figures and the
collapse stop), the checkpoint schedule (`checkpoint_schedule`) and preemption (`preemption`).

The loop walks its list of techniques at fixed points of every step, acts on what they ask for, and saves
and restores their states with every checkpoint. May import: `upcycler.train.config`, `model.params` (the
parameter tree), and the layers below the trainer; never the loop itself, so a technique can be read and
tested alone.
"""
