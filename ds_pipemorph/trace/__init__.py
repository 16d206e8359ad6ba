"""Timelines out: Chrome/Perfetto trace JSON and Gantt pictures (pure Python + matplotlib)."""
