"""What rides on the training loop, each turned on by a config key: the routers' selection-bias
balancing (`balancing`), weight averaging (`ema`), expert load health (`expert_health`, over the windows
of steps `expert_window` sums), the loss-spike guard (`spike_guard`) and a run started from a merge of
checkpoints (`init_merge`).

Each module is one technique with its own state and checks, called by the loop at a fixed point of the
step or the run. May import: `upcycler.train.config`, `model.params` (the parameter tree), and the layers
below the trainer; never the loop itself, so a technique can be read and tested alone.
"""
