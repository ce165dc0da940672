"""Widgets: thin ipywidgets views over the plain functions in labutils."""
from .quiz import Quiz, quiz
from .token_viewer import token_viewer
