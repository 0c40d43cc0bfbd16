"""What a run needs besides capture: ``gc`` (tombstones, then whole files), ``timelines``
(rename, delete), ``verify`` (every byte, every zip entry, the index) and ``retention`` (the
policy gc applies)."""
