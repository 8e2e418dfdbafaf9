"""The package version, in a leaf module: importing it loads nothing else of fedsplice, so any
module may read it (`from fedsplice.version import __version__`) without an edge to the package."""

__version__ = "0.1.0"
