"""The device side (docs/architecture.md "Device"): pure functions over immutable state pytrees,
jitted; no threads, no text, no clocks. Never imports `host`, `engine`, `models` or `serving`."""
