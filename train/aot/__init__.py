"""Ahead-of-time compilation of the train step for a device layout this host does not have.

`upcycle continued-pretrain --compile-only` lowers and compiles the exact step a run uses, for the local
devices or for a TPU pod described by libtpu (`topology`), and reports what one chip needs: memory by
category against its HBM (`report`), analytic FLOPs, the collectives in the compiled program
(`collectives`), and a roofline estimate from the chip's published figures (`hardware`).
"""
