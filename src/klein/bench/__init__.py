"""`klein bench`: klein and diffusers side by side on the same random weights, and the KV speedup against
its FLOP ceiling (docs/benchmarks.md); also the roofline `klein plan --compiled` prints. A front end:
imports the pipeline and below, no other front end.
"""
