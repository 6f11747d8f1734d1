"""ETTR simulator: checkpoint-restart vs elastic -1/+1 vs TrainMover with warm standbys (`trainmover simulate`).

`inputs` holds every published number and assumption; `kernel` the numba Monte-Carlo; `model`
runs and summarises; `cli` parses, prints and plots. See docs/simulator.md.
"""
