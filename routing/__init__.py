"""Routers: which expert a frame's chain starts with."""
from .rules import Route, RouteError, RuleRouter

__all__ = ["Route", "RouteError", "RuleRouter"]
