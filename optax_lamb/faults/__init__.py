"""What goes wrong and what is done about it: the checks of every update (`_checks`) and of
the constructors' arguments (`_check_args`) with their messages (`_explain`); skipping a step
(`_skip`: non-finite gradients; `_spikes`: the spike test; `_decision`: whether a step is
taken) and dividing by the loss scale (`_loss_scale`). Imports only `optax_lamb.core` (and the
top-level helpers). Private: the public names are in `optax_lamb`."""
