"""Helpers shared by test modules (importable as `helpers.*`: tests/conftest.py puts tests/
on the path), so test modules never import each other."""
