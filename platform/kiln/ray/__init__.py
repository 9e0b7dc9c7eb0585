"""Ray adapters: the Ray Train worker function, the Ray Data datasource and the progress board."""
