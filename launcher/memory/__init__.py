"""Memory model: the layout machinery shared by every backend (common.py), the allocator (allocator.py,
replay.py), runtime terms (runtime.py), and the driver that turns a backend's layouts into a
per-rank estimate (estimate.py)."""
