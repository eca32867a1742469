"""Node health before user code (`GPUPool(preflight=...)`): see docs/node-health.md.

`rules` decides from figures (pure), `probe` measures them on the ranks, `check` runs the probe
through the ordinary call path before the first user call on new nodes and carries out what the
rules decided; `report` holds its events and table.
"""
