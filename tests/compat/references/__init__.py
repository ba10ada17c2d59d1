"""Float64 NumPy transcriptions of other libraries' LAMB, one module per library.

Each module keeps its library's class name, argument names, defaults and refusals, and cites
in its docstring the source files, commit and lines it transcribes. Parameters are a flat dict
path -> array (paths '/'-joined); the torch libraries also take torch-style parameter groups
(see `_param_groups`). Each optimizer holds float64 copies of the parameters in `.params`
and updates them in place on `step(grads)` (Keras and TF Addons: `apply(grads)`; ONNX Runtime:
`step(grads, eta, ...)`, the op's optional inputs as keywords).

  apex             apex.optimizers.FusedLAMB               (CUDA only: checked by properties)
  deepspeed        deepspeed.ops.lamb.FusedLamb            (CUDA only: checked by properties)
  timm             timm.optim.Lamb
  torch_optimizer  torch_optimizer.Lamb
  keras            keras.optimizers.Lamb (Keras 3)
  tfa              tensorflow_addons.optimizers.LAMB
  onnxruntime      ONNX Runtime training's LambOptimizer op   (CUDA only: checked by properties)
"""
