"""Serving: many requests at once, on the course's own engine or on a real server through its OpenAI API."""
