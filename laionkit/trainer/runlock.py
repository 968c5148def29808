"""train's run-folder lock: laionkit.common.runlock (moved there so that the other stages take it too)."""

from laionkit.common.runlock import (  # noqa: F401 - re-exported for the trainer
    LEASE_NAME,
    LOCK_NAME,
    BucketLease,
    LocalLock,
    hold,
    lease_seconds,
    release_all,
    session,
)
