"""Where models logged before Kiln 0.1's house plan find their pyfunc class: their copy of
`pyfunc_entry.py` imports it from here. The code lives in `kiln.tracking.model`."""

from kiln.tracking.model import KilnTextModel  # noqa: F401
