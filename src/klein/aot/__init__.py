"""Programs compiled ahead of time for a machine that need not be this one, for `klein plan`: XLA's memory
analysis of the pipeline's programs, compiled from abstract arrays (`compiled`), the device topologies they
are compiled for (`topology`) and the GPU cards' compiler descriptions (`gpu_targets`). Generation never
imports it. May import the pipeline's step functions and everything below the pipeline; never a front end.
"""
