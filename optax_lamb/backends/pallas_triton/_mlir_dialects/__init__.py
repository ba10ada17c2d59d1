"""Python modules named after MLIR dialects, for the MLIR bindings' dialect lookup (`common`)."""
