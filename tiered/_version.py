"""The package version, at the bottom of the import graph so that any module may name it."""

__version__ = "0.1.0"
