"""The sidecar's HTTP face: the aiohttp app, request validation and drain.

Nothing below this room knows HTTP: the handlers parse and validate a request into the typed calls of
:mod:`kvshard_sidecar.serving.calls`, hand them to the serving room, and turn its answer (or its typed
error) into JSON. The Prometheus metrics and the pressure gauge (:mod:`kvshard_sidecar.metrics`,
:mod:`kvshard_sidecar.pressure`) sit beside the settings, not here, because every room records into them.
"""
