"""Shared test settings."""
from hypothesis import settings

# CI machines are small and sometimes busy: a wall-clock deadline per example would make property
# tests flaky without testing anything. derandomize makes every run explore the same examples.
settings.register_profile("course", deadline=None, derandomize=True)
settings.load_profile("course")
