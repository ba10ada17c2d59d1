"""The BERT large-batch recipe (You et al. 2019) at a scale that runs on a laptop CPU.

The recipe's pieces: ``schedules`` (pure optax), ``data`` (King James Bible text and a
synthetic hidden-Markov language), ``model`` (a small masked-LM BERT in Flax NNX) and
``train`` (the optimizers of the recipe and a jitted loop that trains several learning rates
side by side). The experiments, one job per module: ``presets`` (what a sweep is), ``splits``
(its training stream and evaluation sets), ``sweep`` (the main job: the tuning grid,
``python -m optax_lamb_recipes.sweep``), ``report`` (the arms, their choices, the table),
``records`` (runs and sessions as JSON), ``study`` (the arms trained again on more seeds,
``python -m optax_lamb_recipes.study``), ``analysis`` (paired t-intervals over seeds) and
``plots``.
"""
