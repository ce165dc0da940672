"""Widgets: thin ipywidgets views over the plain functions below them.
May import: every part below it, core to figures; never the top-level commands (bench, train, gpu_table)."""
from labutils.widgets.batch_roofline import BatchRoofline, batch_roofline
from labutils.widgets.decode_stream import DecodeStream, decode_stream
from labutils.widgets.explorer import Explorer, explorer
from labutils.widgets.kv_calculator import KVCalculator, kv_calculator, kv_summary
from labutils.widgets.plot import LiveCurve, Plot, live_curve
from labutils.widgets.quiz import Quiz, quiz
from labutils.widgets.token_viewer import token_viewer
from labutils.widgets.serving_dashboard import ServingDashboard, serving_dashboard
