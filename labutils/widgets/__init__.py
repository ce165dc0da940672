"""Widgets: thin ipywidgets views over the plain functions in labutils."""
from .batch_roofline import BatchRoofline, batch_roofline
from .decode_stream import DecodeStream, decode_stream
from .explorer import Explorer, explorer
from .kv_calculator import KVCalculator, kv_calculator, kv_summary
from .plot import LiveCurve, Plot, live_curve
from .quiz import Quiz, quiz
from .token_viewer import token_viewer
from .serving_dashboard import ServingDashboard, serving_dashboard
