"""The implementations of one lamb step; `optax_lamb._dispatch` picks one per call.

Each computes from the step plan (`optax_lamb._plan.StepPlan`) and flat lists of
leaves, and returns (updates or new params, new mu, new nu, ratio vector):
`xla` (the reference) and `pallas` (Triton kernels; imported only when used).
"""
