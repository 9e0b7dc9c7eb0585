"""MLflow, the only package that imports it: runs, the background sender, the model as an
MLflow pyfunc, plots, the calls other layers need (`client`), and the local services."""
