from tidal.core.errors import TidalError


class WeightSyncError(TidalError):
    """A weight transfer was incomplete or corrupt; the receiver kept its previous version."""
