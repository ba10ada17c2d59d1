"""One lamb update from its configuration: `_lamb` (the constructor), `_transform` (the
transformation: its prologue, the planned step or the chain of stages, the wrappers, the state
after), `_plan` (the step planned for every backend, and what a backend reads and returns),
`_registry` (the backends by name, loaded by their module's name; one picked per step),
`_reference` (the chain of stages) and `_update_and_apply`. Private modules: the public names
are in `optax_lamb`."""
