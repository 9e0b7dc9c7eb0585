"""Corpus -> tokenized Parquet shards + manifest, the data order, and reading the shards back.

`kiln.data.prepare(inputs=[...], output=..., **options)` is `kiln data prepare` for Python
(the options are `PrepareConfig`'s fields); it returns the dataset's manifest.
"""

from kiln.data.prepare import PrepareConfig, prepare  # noqa: F401  (the API; shadows the module's name)
