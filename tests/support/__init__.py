"""Helpers shared by the tests (and the benches and experiments that run the workflow), one
concept a module. Test modules import helpers from here or get them as conftest fixtures, never
from another test module."""
