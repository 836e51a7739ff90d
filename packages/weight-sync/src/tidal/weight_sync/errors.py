from tidal.core.errors import TidalError


class WeightSyncError(TidalError):
    """A weight transfer was incomplete or corrupt; the receiver kept its previous version."""


class WeightFetchCancelled(WeightSyncError):
    """A fetch given up on purpose (`cancel()`: e.g. the sender it was fetching from was replaced by a
    restarted one); the receiver kept its previous version and can fetch again at once."""


class WeightSenderGone(WeightSyncError):
    """The sender went away mid-fetch (its process died: a learner that crashed or was killed); the
    receiver kept its previous version and fetches the next announcement (a restarted learner's)."""
