"""Corpus -> tokenized Parquet shards + manifest, the data order, and reading the shards back."""
