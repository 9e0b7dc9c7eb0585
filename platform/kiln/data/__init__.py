"""Corpus -> tokenized Parquet shards + manifest, and reading them back for training."""
