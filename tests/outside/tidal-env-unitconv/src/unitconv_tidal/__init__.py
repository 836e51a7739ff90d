"""A unit-conversion environment for Tidal, with switchable author mistakes (a test fixture)."""
