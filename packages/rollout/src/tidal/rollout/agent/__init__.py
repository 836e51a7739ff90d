"""Agents written for the OpenAI API, trained as Tidal episodes (the `agent` environment)."""
