"""Oracles and helpers of the tests and benchmarks: the full-sequence reference forward, a
KV-event mirror, torch emulations of the Gluon kernels' arithmetic, the loader's packing
plan. Dev-only: the product (``app``, ``kernels``) never imports this package."""
