"""Units through the `pint` library, which this package does not depend on: importing it fails, as an
author's lazily imported module does when a dependency is missing."""

import pint  # noqa: F401  (not installed: ModuleNotFoundError, on purpose)


class PintUnits:
    pass
