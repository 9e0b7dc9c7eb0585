"""The Ray-free core: the per-worker training loop and the parts it delegates to (meter,
checkpoints, health guard, sinks, optimizers and LR schedules with their registries), and the
`Engine` seam through which it reaches the model. Never imports Ray, MLflow or DeepSpeed (an
import-linter contract)."""
