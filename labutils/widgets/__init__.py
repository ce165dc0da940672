"""Widgets: thin ipywidgets views over the plain functions in labutils."""
from .explorer import Explorer, explorer
from .quiz import Quiz, quiz
from .token_viewer import token_viewer
