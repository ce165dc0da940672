"""Build backend: setuptools, except that a plain (non-editable) install stops at once and says why.

The lessons read data/ (tokenizer, checkpoints, quizzes, texts) from the clone, next to labutils/. A wheel
would carry labutils/ into site-packages without it, and the course would break at its first import.
"""
from setuptools.build_meta import *  # noqa: F401,F403  (every hook, editable installs included)

MESSAGE = ("labutils is the course's helper package and reads data/ from the clone, so it installs only as an "
           "editable install. From the clone run:  pip install -e .   (or `make setup`), not `pip install .`")


def get_requires_for_build_wheel(config_settings=None):
    raise SystemExit(MESSAGE)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise SystemExit(MESSAGE)
