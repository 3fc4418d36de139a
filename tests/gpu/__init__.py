"""GPU tests. A package so that its conftest.py does not replace tests/conftest.py as the
module ``conftest`` that every test module imports its helpers from."""
