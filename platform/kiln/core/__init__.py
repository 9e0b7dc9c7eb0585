"""The Ray-free core: the per-worker training loop and the parts it delegates to (meter,
checkpoints, health guard, sinks, optimizers, LR schedules). Never imports Ray, MLflow or
DeepSpeed (an import-linter contract)."""
