"""hookloop's version, in the bottom layer of the core so that any module may read it
without importing the package's facade (``hookloop.__version__`` re-exports it)."""

__version__ = "0.11.0"
