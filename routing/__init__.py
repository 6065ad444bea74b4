"""Routers: which expert a frame's chain starts with.

The rule router is imported eagerly (it is tiny); the learned router and its
training code pull in torch and cv2, so they load on first use.
"""
from .rules import Route, RouteError, RuleRouter

_LAZY = {
    "LearnedRouter": "learned", "RouterNet": "learned", "ROUTER_ID": "learned",
    "train_router": "train", "evaluate_router": "train", "plot_confusion": "train",
    "sample_probabilities": "train", "EvalReport": "train", "TrainReport": "train", "EpochStats": "train",
}

__all__ = ["Route", "RouteError", "RuleRouter", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
