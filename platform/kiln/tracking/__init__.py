"""MLflow: runs, the background sender, redaction, plots, and the local services."""
