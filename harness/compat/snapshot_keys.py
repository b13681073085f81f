"""The names a tracker snapshot files bytes under: MemTracker's reference types and its total.

A leaf module so both engines (``tracker`` checks them against the installed torch,
``memtracker_public`` produces them) and ``accounting`` (reads them) share one spelling without
importing each other.
"""

SNAPSHOT_KEYS = ("Parameter", "Buffer", "Gradient", "Activation", "Temp", "Optstate", "Other")
TOTAL = "Total"
