"""The BERT large-batch recipe (You et al. 2019) at a scale that runs on a laptop CPU.

Reusable pieces for the notebooks and the sweep (``python -m optax_lamb_recipes.sweep``):
``schedules`` (pure optax), ``data`` (King James Bible text and a synthetic hidden-Markov
language), ``model`` (a small masked-LM BERT in Flax NNX) and ``train`` (the optimizers
of the recipe and a jitted training loop).
"""
