

from importlib import metadata as _metadata

try:
    # the release, as installed (`stovepipe --version`, the API, /metrics)
    __version__ = _metadata.version("stovepipe")
except _metadata.PackageNotFoundError:  # run from a source tree never installed
    __version__ = "0+unknown"
