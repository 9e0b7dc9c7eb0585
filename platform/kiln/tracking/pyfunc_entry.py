"""The MLflow model's code (MLflow's "models from code"): MLflow copies this file into the logged
model and runs it to load the model, instead of unpickling an object."""

import mlflow

from kiln.tracking.model import KilnTextModel

mlflow.models.set_model(KilnTextModel())
