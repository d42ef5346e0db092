"""Ahead-of-time compilation of the train step for a device layout this host does not have.

`upcycle continued-pretrain --compile-only` lowers and compiles the exact step a run uses (`compile`,
through the run's one builder, `upcycler.train.loop.run_build`), for the local devices or for a TPU pod
described by libtpu (`topology`), and reports what one chip needs (`compile_report`): memory by category
against its HBM, analytic FLOPs, the collectives in the compiled program (`collectives`), the HBM traffic
with every loop and kernel charged (`hbm_traffic`, its sources named by `hlo_sources`), a roofline bound
from the chip's published figures (`roofline`) and the checkpoint save's (`save_time`). `plan` searches
the options that fit for the best bound (`--plan`); `prefill` compiles `upcycle eval`'s long prefills.
"""
