"""tidal.integration: the full Tidal system, composed from the tidal-* packages.

For now it holds the `tidal` command; the learner loop, launcher and recipes arrive with their issues.
"""

__version__ = "0.1.0"
