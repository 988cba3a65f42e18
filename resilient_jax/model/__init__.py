"""Your own Flax NNX model in the pipeline: the protocol (`staging`), the automatic split of a
stage's backward into B and W (`split`), and the checks and cost description of a user's model
(`check`). `config` holds the model families' config sections and the cost description the
planners use; it does not import JAX.
"""
